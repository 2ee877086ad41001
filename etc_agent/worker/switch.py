"""The generation switch: one process's way from the generation it leaves into the next one.

Call sequence (every process of the old and the new generation: members, joiners, senders):

1. :meth:`Switch.run` describes the state this process holds (boxes only: :class:`Held`), drops the
   app objects and tears the old groups down (peers blocked on this process fail now instead of at
   their timeout), settles the periodic checkpointer, and asks the agent for its
   :class:`~etc_agent.protocol.control.Assignment`;
2. ``_arrive``: every process of the generation reaches its store (or a newer generation comes);
3. ``_form``: members form the training group and mesh and call ``build(ctx)``; everyone forms the
   migration group (members then senders, by transport rank);
4. ``_exchange``: each process says which versions of the state it holds (its live state, its
   periodic snapshots) and which checkpoints it sees (one ``all_gather_object``);
5. the checkpoint baseline (``--migration checkpoint``) loads from its save and stops here;
6. ``_migrate``: the newest step some set of sources covers is tried first; the plan is computed on
   every process from the same descriptions and its hash compared before anything moves
   (:func:`~etc_agent.migrate.executor.migrate_state`); a step with a gap falls back to an older one;
7. ``_settle``: the plain state (step, RNG, param-group settings, LR scheduler) is carried from the
   first source, new rank 0 reports one :class:`~etc_agent.rendezvous.records.MigrationRecord`, a
   sender exits.

A peer failure during 2-7 abandons the generation: this process still holds its old shards
(sources are only read) and takes part again in the one the agent publishes next.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device
from etc_agent.migrate.describe import BoxedTensor, describe_state
from etc_agent.migrate.executor import MigrationResult, migrate_state
from etc_agent.migrate.storage import read_regions
from etc_agent.migrate.transport import GroupTransport
from etc_agent.planner.core import StateLostError
from etc_agent.planner.validate import PlanValidationError
from etc_agent.protocol.control import Assignment, SwitchFailed
from etc_agent.protocol.phases import Phase
from etc_agent.utils.plainstate import from_json, to_json
from etc_agent.worker.appstate import load_state, split_state
from etc_agent.worker.connect import gloo_group, init_default_group
from etc_agent.worker.context import ParallelContext, make_context
from etc_agent.worker.errors import ArrivalTimeout, BuildMismatch, JobFinished, PlannerBug, StateLost, is_peer_failure
from etc_agent.worker.genstore import GenerationStore
from etc_agent.worker.report import Clocks, Stopped, checkpoint_record, live_record

if TYPE_CHECKING:
    from etc_agent.worker.job import Job
    from etc_agent.worker.link import AgentLink

FAULT_SENDER_PAUSE_S = float(os.environ.get("ETC_AGENT_FAULT_SENDER_PAUSE_S", 0) or 0)
"""Tests only: a departing sender sleeps this long between the status exchange and sending."""


@dataclass
class Held:
    """What this process brings from the generation it leaves (nothing, for a new process)."""

    rank: int | None = None
    config: str | None = None
    boxed: dict[str, BoxedTensor] | None = None
    plain: dict | None = None


@dataclass
class Entry:
    """A generation being entered: the assignment, the groups formed, the state built for it."""

    assignment: Assignment
    device: Device
    clocks: Clocks
    transport: GroupTransport
    group: Any
    ctx: ParallelContext | None = None
    new_state: dict | None = None
    new_tensors: dict | None = None

    @property
    def new_rank(self) -> int | None:
        return self.assignment.rank


@dataclass
class Exchanged:
    """Every process's versions of the state (index = transport rank) and this process's snapshots."""

    statuses: list[dict]
    snapshots: dict[int, Any]

    @property
    def holders(self) -> list[int]:
        return [i for i, s in enumerate(self.statuses) if any(v["kind"] == "live" for v in s["versions"])]

    @property
    def live_step(self) -> int | None:
        return max((self.statuses[i]["versions"][0]["step"] for i in self.holders), default=None)


@dataclass
class Source:
    """What the migration started from, and what it did."""

    resume_step: int
    config: str | None = None
    carried: dict | None = None
    result: MigrationResult | None = None
    restored_from: str | None = None
    lost: list[str] = field(default_factory=list)


class _Standby(Exception):
    """A sender of a restarting node sent its state and stays, without it, for a later generation."""


class Switch:
    """One switch of ``job`` (see the module docstring); :meth:`run` returns once the job is in."""

    def __init__(self, job: Job, stopped: Stopped | None, failure: bool):
        self.job, self.stopped, self.failure = job, stopped, failure
        assert job.link is not None  # only an elastic job switches, and it has its agent link
        self.link: AgentLink = job.link

    def run(self, at_least: int, why: str) -> None:
        """Move from the current generation (if any) into the first one >= ``at_least`` the agent serves."""
        job = self.job
        held = self._hold()
        job.teardown_group()  # peers blocked on this process fail now instead of at their timeout
        if job.checkpointer is not None:
            job.checkpointer.settle(self.failure)  # its own group: after the teardown, which must not wait
        assignment = self.link.assignment(at_least, job.timeout_s, why)
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
                job.state, job.ctx = None, None
                job.teardown_group()
                assignment = self.link.assignment(assignment.generation + 1, job.timeout_s, "standby after sending")
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
        may hold old groups, go now."""
        job = self.job
        if job.state is None:
            return Held()
        assert job.ctx is not None  # set with the state (teardown_group clears it only once the state is gone)
        tensors, plain = split_state(job.state)
        boxed = {
            s.shard.key: BoxedTensor(
                s.tensor, s.shard.global_shape, s.shard.offsets, s.shard.lengths, s.shard.flat_range
            )
            for s in describe_state(tensors)
        }
        held = Held(
            rank=job.ctx.rank,
            config=job.ctx.config.short(),
            boxed=boxed,
            plain={"app": plain, "rng": to_json(torch.get_rng_state(), "rng")},
        )
        del tensors
        job.state = None
        return held

    def _abandon(self, assignment: Assignment, err: BaseException) -> Assignment:
        """A peer failed during the switch: say so, tear down, wait for the generation after it."""
        job = self.job
        job.phase.to(Phase.RECOVERING, assignment.generation)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        print(
            f"[etc_agent] {job.node_id}:{job.local_rank}: switch to generation {assignment.generation} failed "
            f"({first_line}); waiting for the next generation",
            file=sys.stderr,
            flush=True,
        )
        traceback.clear_frames(err.__traceback__)
        del err
        job.state, job.ctx = None, None
        job.teardown_group()
        # The leader may not know (a departing sender has no status to fail): ask for a new generation.
        self.link.send(SwitchFailed(local_rank=job.local_rank, generation=assignment.generation, reason=first_line))
        self.failure = True
        return self.link.assignment(assignment.generation + 1, job.timeout_s, "retry after a failed switch")

    def _enter(self, assignment: Assignment, held: Held) -> Assignment | None:
        """Enter ``assignment``'s generation; a newer assignment if one superseded it while arriving."""
        started = time.perf_counter()
        if not self._arrive(assignment):
            return self.link.newer_than(assignment.generation)
        entry = self._form(assignment, started)
        exchanged = self._exchange(entry, held)
        if self._restore_baseline(entry, exchanged):
            return None
        source = self._migrate(entry, exchanged, held)
        self._settle(entry, exchanged, source)
        return None

    def _arrive(self, assignment: Assignment) -> bool:
        """Wait until every process of the generation reached its store (False: a newer one came)."""
        from torch.distributed import TCPStore

        job, generation = self.job, assignment.generation
        job.store = TCPStore(
            assignment.store_addr,
            assignment.store_port,
            is_master=False,
            timeout=timedelta(seconds=job.timeout_s),
            wait_for_workers=False,
        )
        key = f"gen{generation}/arrived"
        job.store.set(f"{key}/{assignment.pg_rank}", "1")
        job.store.add(key, 1)
        deadline = time.monotonic() + job.timeout_s
        while True:
            count = job.store.add(key, 0)
            if count >= assignment.pg_world_size:
                return True
            if self.link.newer_than(generation):
                return False
            if self.link.finished:
                raise JobFinished()
            if time.monotonic() > deadline:
                missing = [d for r, d in enumerate(assignment.devices) if not job.store.check([f"{key}/{r}"])]
                raise ArrivalTimeout(
                    f"generation {generation}: {count} of {assignment.pg_world_size} processes arrived within "
                    f"{job.timeout_s:.0f} s; missing: {', '.join(missing)}"
                )
            time.sleep(0.01)

    def _form(self, assignment: Assignment, started: float) -> Entry:
        """Members: the training group, the context and ``build(ctx)``; everyone: the migration group."""
        job, generation = self.job, assignment.generation
        timeout = timedelta(seconds=job.timeout_s)
        ctx = new_state = new_tensors = None
        grouped = built = time.perf_counter()
        assert job.store is not None  # _arrive connected it
        store = GenerationStore(job.store, generation, lambda: self._newer(generation), job.timeout_s)
        if assignment.rank is not None:
            init_default_group(
                job.backend,
                dist.PrefixStore(f"gen{generation}/train/", store),
                assignment.rank,
                assignment.world_size,
                timeout,
            )
            config = job.config_for(assignment.parallel, assignment.world_size)
            # Before the first optimizer step nothing is lost if nobody holds state: build it fresh.
            ctx = make_context(
                config, assignment.rank, generation, job.device, restoring=assignment.trained, timeout=timeout
            )
            grouped = time.perf_counter()
            new_state = job.build_state(ctx)
            new_tensors, _ = split_state(new_state)
            built = time.perf_counter()
        group = gloo_group(
            dist.PrefixStore(f"gen{generation}/migrate/", store),
            assignment.pg_rank,
            assignment.pg_world_size,
            timeout,
        )
        return Entry(
            assignment=assignment,
            device=Device.parse(assignment.device),
            clocks=Clocks(started, grouped, built),
            # GroupTransport's hint says ProcessGroup; it uses only rank/size/allgather/send/recv, which gloo has.
            transport=GroupTransport(group, "gloo"),  # type: ignore[arg-type]
            group=group,
            ctx=ctx,
            new_state=new_state,
            new_tensors=new_tensors,
        )

    def _newer(self, generation: int) -> int | None:
        """The number of a generation the agent published after ``generation`` (None: none yet)."""
        newer = self.link.newer_than(generation)
        return newer.generation if newer is not None else None

    def _exchange(self, entry: Entry, held: Held) -> Exchanged:
        """Which versions of the state every process holds, and the checkpoints it sees (collective)."""
        job, assignment = self.job, entry.assignment
        versions = []
        if held.boxed is not None:
            versions.append(
                {
                    "kind": "live",
                    "step": job.next_step,
                    "old_rank": held.rank,
                    "config": held.config,
                    "plain": held.plain,
                }
            )
        checkpointer = job.checkpointer if assignment.started else None
        snapshots = {s.step: s for s in checkpointer.snapshots} if checkpointer is not None else {}
        for snapshot in sorted(snapshots.values(), key=lambda s: -s.step):
            versions.append(
                {
                    "kind": "snapshot",
                    "step": snapshot.step,
                    "old_rank": snapshot.rank,
                    "config": snapshot.config,
                    "plain": snapshot.plain,
                }
            )
        storage = checkpointer.storage_steps() if checkpointer is not None else {}
        if job.resumes_from_storage(assignment):
            from etc_agent.worker.checkpoint import resumable_checkpoints

            assert job.checkpoint_dir is not None  # resumes_from_storage() asks for it
            storage = resumable_checkpoints(job.checkpoint_dir)
        statuses = entry.transport.all_gather_object(
            {"device": str(entry.device), "new_rank": entry.new_rank, "versions": versions, "storage": storage}
        )
        return Exchanged(statuses, snapshots)

    def _restore_baseline(self, entry: Entry, exchanged: Exchanged) -> bool:
        """``--migration checkpoint``: fresh workers load the last save (True when they did)."""
        job, assignment = self.job, entry.assignment
        if exchanged.holders or job.migration != "checkpoint" or not assignment.started or entry.new_rank is None:
            return False
        from etc_agent.worker.baseline import load_checkpoint

        # A member (new_rank set) has its context and new state from _form; the agent's config
        # requires --checkpoint-dir with --migration checkpoint.
        assert entry.ctx is not None and entry.new_state is not None and entry.new_tensors is not None
        assert job.checkpoint_dir is not None
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
        job.state, job.ctx, job.next_step, job.generation = (
            entry.new_state,
            entry.ctx,
            meta["step"],
            assignment.generation,
        )
        record = checkpoint_record(
            entry.transport, assignment, entry.ctx.config.short(), job.next_step, meta, entry.clocks, entry.new_tensors
        )
        if record is not None:
            job.publish(record)
        job.phase.to(Phase.RUNNING, assignment.generation)
        return True

    def _migrate(self, entry: Entry, exchanged: Exchanged, held: Held) -> Source:
        """Try the candidate states newest first; the first one the sources cover is migrated."""
        job, generation = self.job, entry.assignment.generation
        candidates, stored = candidate_states(exchanged.statuses)
        if not candidates:
            if entry.assignment.trained:
                job.fatal(
                    StateLost(
                        f"generation {generation}: no process holds any training state (all holders are gone) "
                        "and there is no checkpoint to restore from"
                    )
                )
            return Source(resume_step=job.next_step)
        last_error: Exception | None = None
        for (step, config), sources in candidates:
            try:
                return self._migrate_from(entry, exchanged, held, step, config, sources, stored.get(step))
            except StateLostError as err:
                # Every process computed the same plan and hit the same gap: try an older step.
                last_error = err
        if not entry.assignment.trained:
            # Nothing trained yet: the state every process built is the initial one, so a part
            # that died with its process is built again (a crash before the first step).
            return Source(resume_step=job.next_step)
        hint = (
            ""
            if job.checkpointer is not None
            else " (etcrun --checkpoint-dir and --checkpoint-interval keep periodic checkpoints to restore from)"
        )
        job.fatal(
            StateLost(
                f"generation {generation}: training state lost, no step has a live copy or a "
                f"checkpoint of every shard: {last_error}{hint}"
            )
        )
        raise AssertionError("unreachable: fatal raises")

    def _migrate_from(
        self,
        entry: Entry,
        exchanged: Exchanged,
        held: Held,
        step: int,
        config: str | None,
        sources: dict[int, dict],
        restore_path: str | None,
    ) -> Source:
        """Migrate the state of ``step`` (layout ``config``; None: only the checkpoint has it) into the new layout."""
        job = self.job
        state_file: dict[str, Any] | None = None
        if config is None:
            from etc_agent.worker.checkpoint import STATE_FILE

            assert restore_path is not None  # candidate_states() gives no layout only to steps a checkpoint has
            state_file = json.loads((Path(restore_path) / STATE_FILE).read_text())
            config = state_file["config"]
        held_ranks = {v["old_rank"] for v in sources.values()}
        lost_ranks: dict[int, tuple[Device, list]] = {
            r: (Device(f"lost{r}", 0), [])
            for r in range(ParallelConfig.parse(config).world_size)
            if r not in held_ranks
        }
        mine = sources.get(entry.transport.rank)
        old_state = None
        if mine is not None:
            old_state = held.boxed if mine["kind"] == "live" else exchanged.snapshots[mine["step"]].boxed
        if entry.new_rank is None:
            _pause_before_sending(entry)
        plan_hook = self._announcer(entry.assignment, step, exchanged.live_step, restore_path)
        result = self._execute(
            entry, old_state, mine["old_rank"] if mine else None, lost_ranks, restore_path, plan_hook
        )
        if sources:
            carried = sources[min(sources)]["plain"]
        else:
            assert state_file is not None  # no process holds this step: it was read above
            carried = {"app": state_file["app"], "rng": state_file["rng"]}
        if mine is not None and mine["kind"] == "snapshot":
            assert job.checkpointer is not None  # this process has snapshots only with periodic checkpoints
            job.checkpointer.drop(lambda s: s.step == mine["step"])  # the new state may hold its buffers now
        return Source(
            resume_step=step,
            config=config,
            carried=carried,
            result=result,
            restored_from=restore_path if result.plan.bytes_restored else None,
            lost=[str(d) for d, _ in lost_ranks.values()],
        )

    def _execute(
        self,
        entry: Entry,
        old_state: dict | None,
        old_rank: int | None,
        lost_ranks: dict[int, tuple[Device, list]],
        restore_path: str | None,
        plan_hook: Any,
    ) -> MigrationResult:
        """Run the executor; its errors become the job's error families (a gap in the state stays
        :class:`StateLostError`, so that the caller tries an older step)."""
        job, generation = self.job, entry.assignment.generation
        read_checkpoint = None
        if restore_path:
            # Read straight from storage: a full restart with --checkpoint-dir alone has no checkpointer.
            read_checkpoint = partial(read_regions, restore_path)
        try:
            return migrate_state(
                old_state,
                entry.new_tensors,
                device=entry.device,
                old_rank=old_rank,
                new_rank=entry.new_rank,
                transport=entry.transport,
                tp=entry.ctx.config.tp if entry.ctx else 1,
                failed=[d for d, _ in lost_ranks.values()],
                lost_old_ranks=lost_ranks,
                timeout_s=job.timeout_s,
                read_checkpoint=read_checkpoint,
                on_plan=plan_hook,
                same_keys=pipeline_stages(job.config_for(entry.assignment.parallel, entry.assignment.world_size)),
            )
        except StateLostError:
            raise
        except PlanValidationError as err:
            job.fatal(
                PlannerBug(
                    f"generation {generation}: the migration plan broke one of the planner's own invariants "
                    f"(a bug in etc_agent; every process computed the same plan): {err}"
                )
            )
        except ValueError as err:
            # The descriptions do not fit together (every process sees the same, before anything
            # moved): what build() returned is wrong somewhere; a restart would repeat it.
            job.fatal(
                BuildMismatch(
                    f"generation {generation}: the state build() returned does not fit the migrating "
                    f"state ({entry.ctx.config.short() if entry.ctx else 'sender'}): {err}"
                )
            )
        raise AssertionError("unreachable: fatal raises")

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
                print(
                    f"[etc_agent] {entry.device}: state sent for generation {assignment.generation}; waiting as a "
                    "standby until this node rejoins",
                    file=sys.stderr,
                    flush=True,
                )
                raise _Standby()
            print(
                f"[etc_agent] {entry.device}: state sent for generation {assignment.generation}; leaving the job",
                file=sys.stderr,
                flush=True,
            )
            self.link.close()
            raise SystemExit(0)
        # A member: _form made its context and built its state.
        assert entry.ctx is not None and entry.new_state is not None and entry.new_tensors is not None
        if source.carried is not None:
            load_state(entry.new_state, source.carried["app"], entry.new_tensors)
            torch.set_rng_state(from_json(source.carried["rng"]))
        redone = (live_step - source.resume_step) if live_step is not None else 0
        job.state, job.ctx, job.next_step, job.generation = (
            entry.new_state,
            entry.ctx,
            source.resume_step,
            assignment.generation,
        )
        self._report(entry, source, entry.ctx.config.short(), redone)
        if source.restored_from and not assignment.trained:
            job.mark_trained()  # resumed from storage: from now on a crash loses state, not an initial one
        job.phase.to(Phase.RUNNING, assignment.generation)

    def _report(self, entry: Entry, source: Source, new_config: str | None, redone: int) -> None:
        record = live_record(
            entry.transport,
            entry.assignment,
            new_config or "",
            self.job.next_step,
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

    def _announcer(self, assignment: Assignment, step: int, live_step: int | None, restore_path: str | None):
        """What new rank 0 says once the plan is known and before anything moves, when state is lost."""
        if assignment.rank != 0:
            return None

        def announce(plan) -> None:
            if not assignment.started and plan.restores:
                print(
                    f"[etc_agent] generation {assignment.generation}: resuming the job from {restore_path} at step "
                    f"{step} in layout {assignment.parallel or 'the default'}; each rank reads only its regions "
                    f"({plan.bytes_restored} bytes in all); etcrun --fresh-start would start from scratch",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if not plan.restores and (live_step is None or step >= live_step):
                return
            keys = plan.restored_keys
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            what = (
                (
                    f"{plan.bytes_restored} bytes of {len(keys)} tensors have no live copy ({shown}); reading only those from "
                    f"{restore_path}"
                )
                if plan.restores
                else "the survivors' snapshots hold every shard"
            )
            redo = f", training {live_step - step} steps again" if live_step is not None and step < live_step else ""
            print(
                f"[etc_agent] generation {assignment.generation}: {what}; resuming at step {step}{redo}",
                file=sys.stderr,
                flush=True,
            )

        return announce


def _pause_before_sending(entry: Entry) -> None:
    """Fault injection for tests: a window in which a sender can be killed mid-migration."""
    if FAULT_SENDER_PAUSE_S > 0:
        print(
            f"[etc_agent] {entry.device}: fault injection: pausing {FAULT_SENDER_PAUSE_S:g} s before sending",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(FAULT_SENDER_PAUSE_S)


def pipeline_stages(config: ParallelConfig) -> dict[str, list[int]]:
    """The new ranks of each pipeline stage: they hold the same tensors (boxes of them), by construction."""
    return {
        f"pipeline stage {pp}": [config.rank(pp, dp, tp) for dp in range(config.dp) for tp in range(config.tp)]
        for pp in range(config.pp)
    }


def candidate_states(
    statuses: list[dict],
) -> tuple[list[tuple[tuple[int, str | None], dict[int, dict]]], dict[int, str]]:
    """The states a migration may start from, newest step first, and the checkpoints every new member sees.

    A candidate is ``(step, old layout) -> {transport rank: version}``, one version per process (its
    live state before its snapshot of the same step). A step that only a complete checkpoint has is a
    candidate with no sources (layout None: read from the checkpoint). Every process computes the
    same list from the same statuses.
    """
    readers = [s for s in statuses if s["new_rank"] is not None]
    # JSON object keys are strings: the steps come back as "12".
    stored = {int(k): v for k, v in readers[0]["storage"].items()} if readers else {}
    for s in readers[1:]:
        stored = {step: path for step, path in stored.items() if str(step) in s["storage"]}
    by_id: dict[tuple[int, str | None], dict[int, dict]] = {}
    for i, s in enumerate(statuses):
        for v in s["versions"]:
            sources = by_id.setdefault((v["step"], v["config"]), {})
            if i not in sources:
                sources[i] = v
    for step in stored:
        if not any(k[0] == step for k in by_id):
            by_id[(step, None)] = {}
    order = sorted(by_id, key=lambda k: (-k[0], k[1] or ""))
    return [(k, by_id[k]) for k in order], stored
