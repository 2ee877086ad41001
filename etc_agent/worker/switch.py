"""The generation switch: one process's way from the generation it leaves into the next one.

Call sequence (every process of the old and the new generation: members, joiners, senders):

1. :meth:`Switch.run` describes the state this process holds (boxes only:
   :class:`~etc_agent.worker.versions.Held`), drops the app objects and tears the old groups down
   (peers blocked on this process fail now instead of at their timeout), settles the periodic
   checkpointer, and asks the agent for its :class:`~etc_agent.protocol.control.Assignment`;
2. :func:`~etc_agent.worker.entry.arrive`: every process of the generation reaches its store (or a
   newer generation comes);
3. :func:`~etc_agent.worker.entry.form`: everyone forms the migration group (members then
   senders, by transport rank); members form or take their training groups and mesh, install
   them as torch's, and call ``build(ctx)`` unless it ran while training
   (:mod:`etc_agent.worker.member`);
4. :func:`~etc_agent.worker.versions.exchange`: each process says which versions of the state it
   holds (its live state, its periodic snapshots) and which checkpoints it sees (one
   ``all_gather_object``);
5. the checkpoint baseline (``--migration checkpoint``) loads from its save and stops here;
6. :class:`~etc_agent.worker.migration.Migration`: the newest step some set of sources covers is
   tried first; the plan is computed on every process from the same descriptions and its hash
   compared before anything moves (:func:`~etc_agent.migrate.executor.migrate_state`); a step with
   a gap falls back to an older one;
7. ``_settle``: the plain state (step, RNG, param-group settings, LR scheduler) is carried from the
   first source, new rank 0 reports one :class:`~etc_agent.rendezvous.records.MigrationRecord`, a
   sender exits.

A peer failure during 2-7 abandons the generation: this process still holds its old shards
(sources are only read) and takes part again in the one the agent publishes next.

The switch sees its job only through a :class:`~etc_agent.worker.switch_view.JobView`: it reads
the job's settings there and changes the job's state only through that view's calls.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from etc_agent.migrate.exchange import PlanAhead
from etc_agent.protocol.control import Assignment, SwitchFailed
from etc_agent.protocol.phases import Phase
from etc_agent.utils.plainstate import from_json
from etc_agent.worker.ahead import SWITCH_WAIT_S, plan_ahead_on, publish_null
from etc_agent.worker.appstate import load_state
from etc_agent.worker.entry import Entry, arrive, form, newer_generation
from etc_agent.worker.errors import JobFinished, is_peer_failure
from etc_agent.worker.logs import say
from etc_agent.worker.migration import Migration, Source
from etc_agent.worker.prepare import Preparation
from etc_agent.worker.report import Stopped, checkpoint_record, live_record
from etc_agent.worker.switch_view import JobView, Resumed
from etc_agent.worker.versions import Exchanged, Held, exchange, hold


class _Standby(Exception):
    """A sender of a restarting node sent its state and stays, without it, for a later generation."""


class Switch:
    """One switch of the job seen through ``job`` (see the module docstring); :meth:`run` returns once it is in."""

    def __init__(self, job: JobView, stopped: Stopped | None, failure: bool):
        self.job, self.stopped, self.failure = job, stopped, failure

    def run(self, at_least: int, why: str) -> None:
        """Move from the current generation (if any) into the first one >= ``at_least`` the agent serves."""
        job = self.job
        held = self._hold()
        job.teardown()  # peers blocked on this process fail now instead of at their timeout
        if job.checkpointer is not None:
            job.checkpointer.settle(self.failure)  # its own group: after the teardown, which must not wait
        assignment = job.link.assignment(at_least, job.timeout_s, why)
        while True:
            job.phase.to(Phase.MIGRATING, assignment.generation)
            try:
                newer = self._enter(assignment, held)
            except JobFinished:
                raise
            except _Standby:
                # Sent: what this process held now lives elsewhere; it joins later as a fresh one
                # (its own downtime is no stall of the job's, and it saw no failure of the next one).
                held = Held()
                self.stopped, self.failure = None, False
                job.leave()
                assignment = job.link.assignment(assignment.generation + 1, job.timeout_s, "standby after sending")
                continue
            except Exception as err:
                if not is_peer_failure(err):
                    raise
                assignment = self._abandon(assignment, err)
                continue
            if newer is None:
                return
            assignment = newer  # superseded while gathering: go to the newer generation

    def _hold(self) -> Held:
        """Describe the state this process holds (the boxes keep the tensors); the app objects, which
        may hold old groups, go now (the job let go of them, and this frame's reference ends here)."""
        state, ctx = self.job.take_state()
        if state is None:
            return Held()
        assert ctx is not None  # set with the state (teardown clears it only once the state is gone)
        return hold(state, ctx)

    def _abandon(self, assignment: Assignment, err: BaseException) -> Assignment:
        """A peer failed during the switch: say so, tear down, wait for the generation after it."""
        job = self.job
        job.phase.to(Phase.RECOVERING, assignment.generation)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        say(
            f"{job.node_id}:{job.local_rank}: switch to generation {assignment.generation} failed "
            f"({first_line}); waiting for the next generation",
        )
        traceback.clear_frames(err.__traceback__)
        del err
        job.leave()
        # The leader may not know (a departing sender has no status to fail): ask for a new generation.
        job.link.send(SwitchFailed(local_rank=job.local_rank, generation=assignment.generation, reason=first_line))
        self.failure = True
        return job.link.assignment(assignment.generation + 1, job.timeout_s, "retry after a failed switch")

    def _enter(self, assignment: Assignment, held: Held) -> Assignment | None:
        """Enter ``assignment``'s generation; a newer assignment if one superseded it while arriving."""
        started = time.perf_counter()
        preparation = self.job.preparations.take(assignment.generation)
        prepared_group = prepared_member = None
        if preparation is None or preparation.store is None:
            store = arrive(self.job, assignment)
        else:  # counted in while training: what the preparation's thread made, or how it ended
            store = preparation.store
            self.job.use_store(store)
            if preparation.error is not None:
                raise preparation.error
            if preparation.superseded:
                store = None
            prepared_group, prepared_member = preparation.group, preparation.member
        if store is None:
            if preparation is not None:
                preparation.discard()
            return self.job.link.newer_than(assignment.generation)
        entry = form(self.job, assignment, store, started, prepared_group, prepared_member)
        ahead = self._plan_ahead(preparation, entry, held, store)
        exchanged = exchange(self.job, entry, held)
        entry.clocks.exchanged = time.perf_counter()
        if self._restore_baseline(entry, exchanged):
            return None
        source = Migration(self.job, entry, exchanged, held, ahead).run()
        self._settle(entry, exchanged, source)
        return None

    def _plan_ahead(
        self, preparation: Preparation | None, entry: Entry, held: Held, store: dist.Store
    ) -> PlanAhead | None:
        """The migration's plan made ahead (:mod:`etc_agent.worker.ahead`): the preparation's, or,
        for a process that entered without one, made now when it brings no state (a joiner, a
        spare: the others may still train); one that brings state is inside the stall already."""
        job = self.job
        if preparation is not None and preparation.published:
            return preparation.ahead
        if not job.preparations.enabled:
            return None
        if held.boxed is not None:  # inside the stall already: a plan made now saves nothing
            publish_null(store, entry.assignment)
            return None
        generation = entry.assignment.generation

        def newer() -> bool:
            return newer_generation(job.link, generation) is not None

        return plan_ahead_on(job, store, entry.assignment, None, entry.new_tensors, newer, SWITCH_WAIT_S)

    def _restore_baseline(self, entry: Entry, exchanged: Exchanged) -> bool:
        """``--migration checkpoint``: fresh workers load the last save (True when they did)."""
        job, assignment = self.job, entry.assignment
        if exchanged.holders or job.migration != "checkpoint" or not assignment.started or entry.new_rank is None:
            return False
        from etc_agent.worker.baseline import load_checkpoint

        # A member (new_rank set) has its context and new state from form(); the agent's config
        # requires --checkpoint-dir with --migration checkpoint.
        assert entry.ctx is not None and entry.new_state is not None and entry.new_tensors is not None
        assert job.checkpoint_dir is not None
        entry.wait_resident()  # the load writes into the new shards
        meta = load_checkpoint(
            entry.new_state,
            entry.new_tensors,
            job.checkpoint_dir,
            assignment.generation,
            assignment.published_at,
            periodic=job.checkpointer is not None,
        )
        if meta is None:
            return False
        load_state(entry.new_state, meta["app"], entry.new_tensors)
        torch.set_rng_state(from_json(meta["rng"]))
        job.resume(Resumed(entry.new_state, entry.ctx, meta["step"], assignment.generation, entry.new_tensors))
        record = checkpoint_record(
            entry.transport, assignment, entry.ctx.config.short(), meta["step"], meta, entry.clocks, entry.new_tensors
        )
        if record is not None:
            job.publish(record)
        job.phase.to(Phase.RUNNING, assignment.generation)
        return True

    def _settle(self, entry: Entry, exchanged: Exchanged, source: Source) -> None:
        """Carry the plain state, report, and either resume (a member) or exit (a sender)."""
        job, assignment = self.job, entry.assignment
        live_step = exchanged.live_step
        if job.checkpointer is not None:
            job.checkpointer.drop(lambda s: s.step > source.resume_step)  # taken on steps that are trained again
            if entry.new_rank == 0 and live_step is not None and source.resume_step < live_step:
                job.checkpointer.discard_after(source.resume_step)
        entry.clocks.migrated = time.perf_counter()
        if entry.new_rank is None:
            job.phase.to(Phase.DEPARTING, assignment.generation)
            self._report(entry, source, None, 0)
            if assignment.standby_after:
                say(
                    f"{entry.device}: state sent for generation {assignment.generation}; waiting as a "
                    "standby until this node rejoins",
                )
                raise _Standby()
            say(
                f"{entry.device}: state sent for generation {assignment.generation}; leaving the job",
            )
            job.link.close()
            raise SystemExit(0)
        # A member: form() made its context and built its state.
        assert entry.ctx is not None and entry.new_state is not None and entry.new_tensors is not None
        if source.carried is not None:
            load_state(entry.new_state, source.carried["app"], entry.new_tensors)
            torch.set_rng_state(from_json(source.carried["rng"]))
        redone = (live_step - source.resume_step) if live_step is not None else 0
        job.resume(Resumed(entry.new_state, entry.ctx, source.resume_step, assignment.generation, entry.new_tensors))
        self._report(entry, source, entry.ctx.config.short(), redone)
        if source.restored_from and not assignment.trained:
            job.mark_trained()  # resumed from storage: from now on a crash loses state, not an initial one
        job.phase.to(Phase.RUNNING, assignment.generation)

    def _report(self, entry: Entry, source: Source, new_config: str | None, redone: int) -> None:
        record = live_record(
            entry.transport,
            entry.assignment,
            new_config or "",
            self.job.next_step(),
            source.config,
            source.result,
            source.lost,
            self.stopped,
            entry.clocks,
            self.failure,
            source.restored_from,
            redone,
        )
        if record is not None:
            self.job.publish(record)
