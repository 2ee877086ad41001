"""The worker API: a training loop that lives across membership changes.

::

    job = etc_agent.init()
    job.start(build)                     # build(ctx) -> app state for ctx's layout
    for step in job.steps(num_steps):    # global steps, continuing across migrations
        state, ctx = job.state, job.ctx
        ...
    job.finish()

At voting step boundaries (about 0.5 s of training apart: :mod:`~etc_agent.worker.boundary`) each
rank all-reduces (MAX) the newest generation number its agent has seen, so all ranks stop at the
same boundary and none is left inside a collective; then every process runs the switch
(:mod:`etc_agent.worker.switch`, whose docstring is the call sequence).

A peer crash surfaces as an error inside the user's step. Under ``etcrun`` the worker launcher
(:mod:`etc_agent.worker.launch`) calls :meth:`Job.recover`: the group is torn down at once (so
peers fail fast too), the job waits for the generation the agent publishes after the failure,
runs the switch with the surviving replicas as sources, and re-enters the script, whose
``init``/``start`` return the live job and whose ``steps`` continue from the recovered step.

The worker's modules: this one (the public API), :mod:`~etc_agent.worker.link` (the agent link),
:mod:`~etc_agent.worker.boundary` (the step boundary's votes), :mod:`~etc_agent.worker.switch` (the switch; it sees
this job through a :class:`~etc_agent.worker.switch_view.JobView`; a member's groups and state:
:mod:`~etc_agent.worker.member`), :mod:`~etc_agent.worker.report` (migration records), :mod:`~etc_agent.worker.baseline`
(the checkpoint baseline), :mod:`~etc_agent.worker.checkpoint` (periodic checkpoints), :mod:`~etc_agent.worker.gather`
(the whole state on one rank), :mod:`~etc_agent.worker.errors` (what can stop a worker).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from etc_agent.integrations import megatron
from etc_agent.layout.config import ParallelConfig, ParallelSpec
from etc_agent.migrate.executor import warm_migration
from etc_agent.protocol.control import Fatal, Finished, Migration, PeerFailed, Trained
from etc_agent.protocol.phases import Phase, PhaseTracker
from etc_agent.protocol.settings import WorkerSettings
from etc_agent.rendezvous.records import MigrationRecord
from etc_agent.utils.plainstate import to_json
from etc_agent.worker import boundary
from etc_agent.worker.ahead import JobPreparer
from etc_agent.worker.appstate import split_state
from etc_agent.worker.boundary import VoteSchedule, agree_on_checkpoint, boundary_vote
from etc_agent.worker.connect import init_static_group
from etc_agent.worker.context import ParallelContext, make_context
from etc_agent.worker.errors import ArrivalTimeout, JobError, JobFinished, StateLost, is_peer_failure
from etc_agent.worker.gather import gather_state
from etc_agent.worker.groups import GroupReleases, mark_loaded_modules_clean, release_all_groups
from etc_agent.worker.link import AgentLink
from etc_agent.worker.logs import configure_worker_logging, say, write_json
from etc_agent.worker.member import BuiltState, build_state
from etc_agent.worker.prepare import Preparations
from etc_agent.worker.report import Stopped
from etc_agent.worker.spare import become_worker
from etc_agent.worker.switch import Switch
from etc_agent.worker.switch_view import JobView, Resumed

__all__ = ["ArrivalTimeout", "Build", "Job", "JobError", "JobFinished", "StateLost", "current", "init"]

if TYPE_CHECKING:
    from etc_agent.worker.checkpoint import PeriodicCheckpointer

log = logging.getLogger("etc_agent.worker")

Build = Callable[[ParallelContext], dict]


class Job:
    """One worker's view of the elastic job. Create it with :func:`etc_agent.init`."""

    _build_ahead = False
    """``start(build, build_ahead=True)``: the build may run beside training."""
    _held: dict | None = None
    """:attr:`state`'s tensors by flattened key (:attr:`JobView.held_tensors`); in a switch, those it brings."""

    def __init__(self, parallel: str | None = None, commit_barrier: bool | None = None):
        self.default_parallel = ParallelSpec.parse(parallel) if parallel else ParallelSpec()
        self.commit_barrier = commit_barrier
        """Before every optimizer step, all ranks meet (a one-element all-reduce): a rank's peer that
        died during the step then fails every rank before any optimizer steps, so all states stay at
        the same step (otherwise dp groups away from the failure could step while others cannot).
        None (default): where the state needs it (:func:`~etc_agent.worker.boundary.needs_commit_barrier`)."""
        self._barrier_wanted = self._barrier_on = True  # this rank's answer in the votes; the last vote's
        # Read once here; a sidecar's hello then fills in what etcrun would have put in the
        # environment, and the settings are read again with it.
        settings = WorkerSettings.from_env(os.environ)
        self.timeout_s = settings.timeout_s
        """Bound on every wait of a switch in the store, on every collective, and on waiting for a generation."""
        self.connect_timeout_s = settings.connect_timeout_s
        """Bound on a gloo group's connect once its store calls are over (x5; read here so a bad value fails at start)."""
        # ETC_AGENT_LOCAL_RANK: the agent's own count, which --virtual-local-rank leaves intact (LOCAL_RANK is then 0).
        self.local_rank = settings.local_rank
        self.elastic = settings.agent_addr is not None and settings.elastic
        self.link = AgentLink(settings.agent_addr, self.local_rank) if self.elastic and settings.agent_addr else None
        for key, value in (self.link.hello.env if self.link else {}).items():
            os.environ.setdefault(key, value)  # a sidecar's workers get from it what etcrun puts in their environment
        self.settings = settings = WorkerSettings.from_env(os.environ)
        """What the agent told this process (:class:`etc_agent.protocol.settings.WorkerSettings`)."""
        configure_worker_logging(settings)
        self.backend = settings.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.node_id = settings.node_id
        # LOCAL_RANK is the CUDA index (0 under --virtual-local-rank, where each worker sees one device).
        self.device = torch.device("cuda", settings.cuda_index) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.state: dict | None = None
        """The app state of the current layout (what ``build`` returned, holding the migrated data)."""
        self.ctx: ParallelContext | None = None
        """The current :class:`ParallelContext`; replaced after every migration."""
        self.next_step = 0
        """Steps completed so far (the next global step to run)."""
        self.generation = -1
        self.phase = PhaseTracker(f"worker {self.node_id}:{self.local_rank}")
        """Where this process is in the protocol's state table (``docs/protocol.md``)."""
        self.migrations: list[dict] = []
        """One record per migration this process took part in (as sent to the agent)."""
        self._build: Build | None = None
        self.releases = GroupReleases()
        """Torn-down groups being freed in the background."""
        self.store: dist.Store | None = None
        self._stepped = self._in_step = self._finished = self._trained_sent = False
        self._held_at = -1
        """The step boundary this rank last held at for a fenced agent (said once per boundary)."""
        self.migration = settings.migration
        """live, or checkpoint: at a switch save with DCP and exit; new workers load (the baseline)."""
        self.preparations = Preparations(self.link, self.timeout_s, settings.prepare and self.migration == "live")
        """The next generation entered while training (:mod:`etc_agent.worker.prepare`)."""
        self.checkpoint_dir, self.fresh_start = settings.checkpoint_dir, settings.fresh_start
        """``etcrun --fresh-start``: never resume from the checkpoints in ``checkpoint_dir``."""
        self.votes = VoteSchedule(settings.vote_interval_s)
        """Which step boundaries hold the ranks' vote (:class:`~etc_agent.worker.boundary.VoteSchedule`)."""
        self.checkpointer = self._periodic_checkpointer()
        """Periodic asynchronous checkpoints (``etcrun --checkpoint-interval``): restore what a failure
        leaves without any live copy; see :mod:`etc_agent.worker.checkpoint`."""

    def _periodic_checkpointer(self) -> PeriodicCheckpointer | None:
        if not (self.settings.checkpoint_interval > 0 and self.checkpoint_dir and self.elastic):
            return None
        # Imported here: torch.distributed.checkpoint stays out of processes that never checkpoint.
        from etc_agent.worker.checkpoint import PeriodicCheckpointer

        return PeriodicCheckpointer.from_settings(self.settings, self.link.commit if self.link else None)

    # ---- public API ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank if self.ctx else -1

    def start(self, build: Build, build_ahead: bool = False) -> None:
        """Join the job: the first generation builds fresh state; a later joiner receives it from peers.

        ``build_ahead``: ``build(ctx)`` may run beside training when ``ctx.restoring``; it must then
        only allocate and use nothing but ``ctx`` (:mod:`etc_agent.worker.member`). Calling it again
        (the launcher re-entering the script after a recovery) keeps the live state.
        """
        if self._build is not None:
            return
        self._build = build
        self._build_ahead = build_ahead
        if not self.elastic:
            self._start_static()
            return
        warm_migration(self.device)  # its first-use costs would otherwise fall in this process's first switch
        # Every switch runs a full collection so that nothing keeps an old group's connections open;
        # what is alive now (imported modules, mostly) is never that garbage, and frozen it is not
        # scanned again (a full collection after `import torch` costs 0.1-0.3 s on the stall).
        gc.freeze()
        mark_loaded_modules_clean()  # teardowns then look only at modules imported later
        self.preparations.preparer = JobPreparer(self._switch_view())
        self._switch(self.settings.generation, "start", stopped=None, failure=False)

    def steps(self, num_steps: int) -> Iterator[int]:
        """Global step numbers from the current one to ``num_steps - 1``; switches between steps."""
        if self._build is None:
            raise RuntimeError("call job.start(build) before job.steps()")
        while True:
            if self.elastic:
                self.votes.boundary(time.perf_counter())
                if self.link is not None:
                    self.link.progress = (self.next_step, self.votes.last_step_s)
                self.preparations.notice(self.generation)
                checkpoint_due = self._maybe_switch(num_steps)
            else:
                checkpoint_due = self.checkpointer is not None and self.checkpointer.due(self.next_step)
            if self.next_step >= num_steps:
                return
            if checkpoint_due:
                self._checkpoint()
            self._stepped = False
            self._in_step = True
            yield self.next_step
            self._in_step = False
            self.next_step += 1

    def finish(self) -> None:
        """Leave cleanly after the last step (all ranks call it)."""
        if self._finished:
            return
        self._finished = True
        if self.elastic:
            self.phase.to(Phase.FINISHED)
        if self.checkpointer is not None:
            self.checkpointer.settle(failure=False)
            self.checkpointer.wait_commit(limit_s=10.0)
        if self.link is not None and self.ctx is not None and self.ctx.rank == 0:
            self.link.send(Finished(step=self.next_step, generation=self.generation))
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
        self.releases.report(wait=True)
        if self.link is not None:
            self.link.close()

    def gather_state(self) -> dict[str, torch.Tensor] | None:
        """The whole app state's tensors, unsharded, on rank 0 (None elsewhere); all ranks call it.
        Runs on the executor: rank 0's new layout holds every key as one full box."""
        if self.state is None or self.ctx is None:
            raise RuntimeError("call job.start(build) before job.gather_state()")
        return gather_state(self.state, self.ctx, self.timeout_s)

    # ---- static (no agent) ---------------------------------------------------------------
    def _start_static(self) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        rank, world = init_static_group(self.backend, timeout)
        config = self.config_for(self.settings.parallel, world)
        self.ctx = make_context(config, rank, 0, self.device, timeout=timeout)
        self.state = self.build_state(self.ctx)

    def config_for(self, parallel: str | None, world: int) -> ParallelConfig:
        config: ParallelConfig | None
        if parallel:
            config = ParallelConfig.parse(parallel)
        else:
            config = self.default_parallel.resolve(world)
            if config is None:
                raise ValueError(f"parallel config {self.default_parallel.short()} does not fit a world of {world}")
        config.check_world_size(world)
        return config

    def build_state(self, ctx: ParallelContext) -> dict:
        built = self.build(ctx)
        self.take_built(built)
        return built.state

    def build(self, ctx: ParallelContext) -> BuiltState:
        """Run ``build(ctx)`` and ready its state; sets nothing of the job (it may run ahead)."""
        assert self._build is not None  # start() sets it before any generation is built
        barrier = self._before_optimizer_step if self.elastic and self.commit_barrier is not False else None
        fixed = self._barrier_wanted if self.commit_barrier is not None else None
        return build_state(self._build, ctx, lambda: self.next_step, barrier, self._on_optimizer_step, fixed)

    def take_built(self, built: BuiltState) -> None:
        self._barrier_wanted = built.commit_barrier_wanted

    def _checkpoint(self) -> None:
        """Snapshot this rank's state and write it in the background (every rank at this boundary)."""
        # A checkpoint is due only in a job with periodic checkpoints (every agent gives its workers the
        # same settings); steps() runs in a started job, which holds its state and context.
        assert self.checkpointer is not None and self.state is not None and self.ctx is not None
        tensors, plain = split_state(self.state)
        self.checkpointer.save(
            tensors,
            {"app": plain, "rng": to_json(torch.get_rng_state(), "rng")},
            self.next_step,
            self.generation,
            self.ctx.config.short(),
            self.ctx.rank,
            self.ctx.world_size,
            self.store,
        )

    def _before_optimizer_step(self, *args: Any) -> None:
        if self._barrier_on:
            dist.all_reduce(torch.zeros(1))

    def _on_optimizer_step(self, *args: Any) -> None:
        self._stepped = True
        self.mark_trained()

    def mark_trained(self) -> None:
        """Training rank 0 tells its agent (once) that the job holds state a crash would lose."""
        if not self._trained_sent and self.link is not None and self.ctx is not None and self.ctx.rank == 0:
            self._trained_sent = True
            self.link.send(Trained(step=self.next_step))

    # ---- switching generations -----------------------------------------------------------
    def _maybe_switch(self, num_steps: int) -> bool:
        """The step-boundary agreement, where :attr:`votes` holds one; after any switch it runs
        again, so that the first collective of every process in a new generation (survivor,
        joiner, recovered) is this one. Returns
        whether every rank takes a periodic checkpoint at this boundary: where any rank lacks this
        step's snapshot, all take it (after a switch the ranks' snapshot lists may differ, and a rank
        that forms the checkpoint group alone waits for the others until its timeout while they
        train on and wait for it). Where a rank's previous write still runs, see
        :func:`~etc_agent.worker.boundary.agree_on_checkpoint`."""
        assert self.link is not None  # only an elastic job switches, and it has its agent link
        checkpoint_boundary = self.checkpointer is not None and self.checkpointer.is_boundary(self.next_step)
        if not self.votes.due(self.next_step, checkpoint_boundary, self.next_step >= num_steps):
            return False
        while True:
            try:
                seen = max(self.link.latest, self.generation)
                slowest = self.votes.slowest_step_s
                preparing = self.preparations.preparing(seen, self.link.latest_status, self.generation)
                vote = boundary_vote(
                    seen, self.checkpointer, self.next_step, self.link.fenced, slowest, self._barrier_wanted, preparing
                )
            except Exception as err:  # a peer died between steps
                if not self.recover(err):
                    raise
                continue
            self._barrier_on = vote.commit_barrier
            if vote.pending <= self.generation and vote.fenced:
                rank = self.ctx.rank if self.ctx is not None else -1
                self._held_at = boundary.hold_fenced(self.generation, self.next_step, rank, self._held_at)
                continue
            # The next generation is still being prepared somewhere: train on, vote at the next boundary.
            train_on = vote.preparing and not vote.fenced and self.next_step < num_steps
            if vote.pending <= self.generation or train_on:
                if not train_on:
                    self.votes.voted(self.next_step, vote.slowest_step_s)
                if not (vote.checkpoint_due and vote.writing):
                    return vote.checkpoint_due
                try:
                    # Some rank's checkpoint is due: this job has periodic checkpoints (see _checkpoint).
                    assert self.checkpointer is not None and self.ctx is not None
                    return agree_on_checkpoint(self.checkpointer, self.timeout_s, self.ctx.rank, self.next_step)
                except Exception as err:  # a peer died while the others waited for a write
                    if not self.recover(err):
                        raise
                    continue
            self.phase.to(Phase.PENDING, vote.pending)
            if self.migration == "checkpoint":
                self._save_and_exit(vote.pending, time.time())
            self._switch(vote.pending, f"switch to generation {vote.pending}", stopped=Stopped.now(), failure=False)

    def _save_and_exit(self, pending: int, stopped_at: float) -> None:
        """The checkpoint baseline: save with DCP and exit (:func:`etc_agent.worker.baseline.save_and_exit`)."""
        from etc_agent.worker.baseline import save_and_exit

        # A started job holds its state and context; the agent's config requires --checkpoint-dir with
        # --migration checkpoint.
        assert self.state is not None and self.ctx is not None and self.checkpoint_dir is not None
        ctx = self.ctx
        save_and_exit(
            self.state, self.checkpoint_dir, pending, self.next_step, ctx.rank, ctx.config.short(), stopped_at
        )

    def recover(self, err: BaseException) -> bool:
        """After a peer failed mid-step: keep the state, switch to the next generation. False if ``err``
        is not a communication failure (or there is no agent), so the caller re-raises it."""
        if not self.elastic or self.state is None or self._finished or self.migration != "live":
            return False
        if not is_peer_failure(err):
            return False
        stopped = Stopped.now()
        self.phase.to(Phase.RECOVERING)
        if self._in_step and self._stepped:
            self.next_step += 1  # the optimizer stepped before the failure: that step is done
        self._in_step = False
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        # The failed step's frames hold the old groups (a ctx local, a pending work); gloo closes a
        # group's connections only when its last reference goes, and peers blocked on this process
        # fail fast only then.
        traceback.clear_frames(err.__traceback__)
        say(
            f"rank {self.rank}: communication failed at step {self.next_step} ({first_line}); "
            "keeping the state, waiting for the next generation",
        )
        if self.link is not None:
            # The leader then checks which member agents are gone instead of waiting for their leases.
            # In the background: peers blocked on this process's groups are released only by the
            # teardown in the switch below, which must not wait for the agent's reply and store writes.
            report = PeerFailed(local_rank=self.local_rank, generation=self.generation, reason=first_line)
            threading.Thread(target=self.link.send, args=(report,), name="etc-peer-failed", daemon=True).start()
        self._switch(self.generation + 1, "recovery after a failure", stopped=stopped, failure=True)
        return True

    def teardown_group(self) -> None:
        megatron.destroy_model_parallel()  # its groups are subgroups of the group that ends here
        if self.ctx is not None:
            self.ctx.mesh._pg_registry.clear()  # old DTensors keep their mesh; it must not keep the groups
        self.ctx = None
        self.releases.report(wait=False)
        with self.preparations.beside_no_build():
            # The old groups' sockets close in the background: the next generation's groups do not wait for them.
            self.releases.add(release_all_groups())
            # DTensor's sharding cache matches meshes by shape and names: old entries would tie new DTensors to it
            torch._C._clear_DTensor_sharding_propagator_cache()
        gc.collect()

    def _switch(self, at_least: int, why: str, stopped: Stopped | None, failure: bool) -> None:
        try:
            Switch(self._switch_view(), stopped, failure).run(at_least, why)
        except JobFinished:
            self.phase.to(Phase.FINISHED)
            say(
                f"{self.node_id}:{self.local_rank}: training finished before this process got into the job; exiting",
            )
            if self.link is not None:
                self.link.close()
            raise SystemExit(0) from None

    def _switch_view(self) -> JobView:
        """The switch's view of this job: settings, services, and the calls that change the job's state."""
        assert self.link is not None  # only an elastic job switches, and it has its agent link
        return JobView(
            link=self.link,
            phase=self.phase,
            checkpointer=self.checkpointer,
            timeout_s=self.timeout_s,
            backend=self.backend,
            device=self.device,
            node_id=self.node_id,
            local_rank=self.local_rank,
            migration=self.migration,
            checkpoint_dir=self.checkpoint_dir,
            fresh_start=self.fresh_start,
            config_for=self.config_for,
            build=self.build,
            take_built=self.take_built,
            build_ahead=self._build_ahead,
            training_ctx=lambda: self.ctx,
            held_tensors=lambda: self._held,
            publish=self.publish,
            fatal=self.fatal,
            mark_trained=self.mark_trained,
            next_step=lambda: self.next_step,
            take_state=self._take_state,
            teardown=self.teardown_group,
            leave=self._leave,
            use_store=partial(setattr, self, "store"),
            resume=self._resume,
            preparations=self.preparations,
        )

    def _take_state(self) -> tuple[dict | None, ParallelContext | None]:
        # The app objects may hold old groups (the teardown frees them); _held stays for a preparation.
        state, self.state = self.state, None
        return state, self.ctx

    def _leave(self) -> None:
        self.state, self.ctx, self._held = None, None, None
        self.teardown_group()

    def _resume(self, resumed: Resumed) -> None:
        self.state, self.ctx, self._held = resumed.state, resumed.ctx, resumed.tensors
        self.next_step, self.generation = resumed.next_step, resumed.generation
        self.votes.restart(self.next_step)

    def publish(self, record: MigrationRecord) -> None:
        """Keep, log and hand one migration record to the agent (which stores it for `etc-agent status`)."""
        fields = record.model_dump(exclude={"schema_version"})
        self.migrations.append(fields)
        write_json({"event": "etc_migration", **fields})
        if self.link is not None:
            self.link.send(Migration(record=record))

    def fatal(self, err: JobError) -> None:
        """Tell the agent the job cannot go on (it fails the job instead of restarting), then raise."""
        if self.link is not None:
            self.link.send(Fatal(reason=str(err)))
        raise err


_CURRENT: Job | None = None


def init(parallel: str | None = None, commit_barrier: bool | None = None) -> Job:
    """The job of this process (created on first call; later calls return the same live job).

    ``parallel``: the layout to use when ``etcrun --parallel`` does not say (e.g. ``tp=2,dp=auto``);
    by default every device is a data-parallel replica. ``commit_barrier``: see :attr:`Job.commit_barrier`.
    """
    global _CURRENT
    if _CURRENT is None:
        become_worker()  # a warm spare waits here for the rank of a crashed worker (worker/spare.py)
        _CURRENT = Job(parallel, commit_barrier)
    return _CURRENT


def current() -> Job | None:  # the job of this process, if init() made one
    return _CURRENT
