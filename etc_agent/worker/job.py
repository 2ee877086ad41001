"""The worker API: a training loop that lives across membership changes.

::

    job = etc_agent.init()
    job.start(build)                     # build(ctx) -> app state for ctx's layout
    for step in job.steps(num_steps):    # global steps, continuing across migrations
        state, ctx = job.state, job.ctx
        ...
    job.finish()

Generation switch (every process of the old and the new generation; call sequence):

1. at every step boundary each rank all-reduces (MAX) the newest generation number its agent has
   seen, so all ranks stop at the same boundary and none is left inside a collective;
2. each rank describes its shards (boxes only), destroys the old process group and clears
   DTensor's dispatch cache (no mesh or group of the old generation may outlive the switch);
3. it asks its agent for its part of the new generation (transport rank, training rank or none
   when it departs) and waits on the generation's store until every process has arrived;
4. members form the new training group and mesh and call ``build(ctx)`` for the new layout;
5. all (members, departing senders) form a separate migration group, exchange which step their
   state is at, and run :func:`~etc_agent.migrate.executor.migrate_state`: the plan is computed on
   every process from the same descriptions and its hash compared before anything moves;
6. the small plain state (step, RNG, param-group settings, LR scheduler) is carried from the first
   source; new rank 0 reports one :class:`~etc_agent.rendezvous.records.MigrationRecord`;
7. departing processes exit; the others resume at the step their state is at.

A peer crash surfaces as an error inside the user's step. Under ``etcrun`` the worker launcher
(:mod:`etc_agent.worker.launch`) calls :meth:`Job.recover`: the group is torn down at once (so
peers fail fast too), the job waits for the generation the agent publishes after the failure,
runs the switch above with the surviving replicas as sources, and re-enters the script, whose
``init``/``start`` return the live job and whose ``steps`` continue from the recovered step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
import gc
from datetime import timedelta
from math import prod
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from etc_agent.integrations import megatron
from etc_agent.layout.config import ParallelConfig, ParallelSpec
from etc_agent.layout.devices import Device
from etc_agent.migrate.describe import BoxedTensor, describe_state
from etc_agent.migrate.executor import migrate_state
from etc_agent.migrate.transport import GroupTransport, MigrationError, TorchTransport
from etc_agent.planner.core import StateLostError
from etc_agent.utils.jsonline import JsonLineError, parse_address, request
from etc_agent.worker.appstate import from_json, load_state, materialize_optimizer_state, split_state, to_json
from etc_agent.worker.context import ParallelContext, make_context

log = logging.getLogger("etc_agent.worker")

Build = Callable[[ParallelContext], dict]

_COMM_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "process group", "processgroup", "socket")


class JobError(RuntimeError):
    """The job cannot go on (state lost, the agent unreachable, a switch that did not complete)."""


class StateLost(JobError):
    """Some training state has no live copy; the job cannot go on without a checkpoint."""


class JobFinished(Exception):
    """Training completed its last step before this process got into the job."""


FAULT_SENDER_PAUSE_S = float(os.environ.get("ETC_AGENT_FAULT_SENDER_PAUSE_S", 0) or 0)
"""Tests only: a departing sender sleeps this long between the status exchange and sending."""


class ArrivalTimeout(JobError):
    """Not every process of a generation reached its store in time (one may have died)."""


def is_communication_error(err: BaseException) -> bool:
    """Errors a failed or vanished peer causes (as opposed to bugs in the training script)."""
    if isinstance(err, (MigrationError, ArrivalTimeout)) or isinstance(err, getattr(dist, "DistError", MigrationError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and not isinstance(err, JobError) and any(m in text for m in _COMM_MARKERS)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not a number") from None


class _AgentLink:
    """The worker's side of its agent's control channel (``ETC_AGENT_ADDR``), polled in a thread."""

    def __init__(self, address: str, local_rank: int, poll_interval: float = 0.1):
        self.address = parse_address(address)
        self.local_rank = local_rank
        self.poll_interval = poll_interval
        self.latest: int = -1
        self.reply: dict[str, Any] = {}
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._stopping = False
        self.hello = request(self.address, {"op": "hello", "local_rank": local_rank, "pid": os.getpid(), "elastic": True}, timeout=10)
        self._attachment: socket.socket | None = None
        if self.hello.get("sidecar"):
            self._attach()
        self._thread = threading.Thread(target=self._poll, name="etc-agent-link", daemon=True)
        self._thread.start()

    def _attach(self) -> None:
        """Sidecar mode: hold a connection to the agent for as long as this process lives; the agent is
        not our parent, and that connection closing is how it learns we are gone."""
        sock = socket.create_connection(self.address, timeout=10)
        sock.sendall((json.dumps({"op": "attach", "local_rank": self.local_rank, "pid": os.getpid()}) + "\n").encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                raise JobError(f"the agent at {self.address[0]}:{self.address[1]} closed the attach connection")
            reply += chunk
        answer = json.loads(reply)
        if "error" in answer:
            raise JobError(f"the agent at {self.address[0]}:{self.address[1]} refused the attachment: {answer['error']}")
        sock.settimeout(None)
        self._attachment = sock

    def _poll(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                reply = request(self.address, {"op": "assignment", "local_rank": self.local_rank}, timeout=10)
                failures = 0
                if reply.get("stop") and not self._stopping:
                    # Sidecar mode: the agent cannot signal a process it did not start; it asks instead.
                    self._stopping = True
                    print(f"[etc_agent] local_rank {self.local_rank}: the agent asks this worker to stop", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGTERM)
                with self._changed:
                    self.reply = reply
                    if reply.get("latest") is not None:
                        self.latest = max(self.latest, int(reply["latest"]))
                    self.error = None
                    self._changed.notify_all()
            except (OSError, JsonLineError) as err:
                failures += 1
                if failures >= 3:
                    with self._changed:
                        self.error = f"agent at {self.address[0]}:{self.address[1]} unreachable: {err}"
                        self._changed.notify_all()
            self._stop.wait(self.poll_interval)

    def assignment(self, at_least: int, timeout_s: float, why: str) -> dict[str, Any]:
        """The newest assignment for a generation >= ``at_least`` (waiting for the agent to prepare it)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                current = self.reply.get("assignment")
                if current is not None and current["generation"] >= at_least:
                    return current
                if self.reply.get("latest_status") in ("failed", "succeeded") and (self.reply.get("latest") or -1) >= at_least:
                    raise JobError(f"the job {self.reply['latest_status']} while this worker waited for generation {at_least}")
                if self.reply.get("finished"):
                    raise JobFinished()
                if self.reply.get("standby"):
                    deadline = time.monotonic() + timeout_s  # a warm joiner waits as long as its node does
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = f"; last error: {self.error}" if self.error else ""
                    raise JobError(f"no generation >= {at_least} from the agent within {timeout_s:.0f} s ({why}){detail}")
                self._changed.wait(min(remaining, 0.5))

    def newer_than(self, generation: int) -> dict[str, Any] | None:
        with self._lock:
            current = self.reply.get("assignment")
            return current if current is not None and current["generation"] > generation else None

    def send(self, req: dict[str, Any]) -> None:
        try:
            request(self.address, req, timeout=10)
        except (OSError, JsonLineError) as err:
            log.warning("could not send %s to the agent: %s", req.get("op"), err)

    def close(self, exit_code: int = 0) -> None:
        """Stop polling; a sidecar's worker reports ``exit_code`` and detaches."""
        self._stop.set()
        self._thread.join(timeout=2)
        if self._attachment is not None:
            self.send({"op": "exiting", "local_rank": self.local_rank, "pid": os.getpid(), "code": exit_code})
            self._attachment.close()
            self._attachment = None


class Job:
    """One worker's view of the elastic job. Create it with :func:`etc_agent.init`."""

    def __init__(self, parallel: str | None = None, commit_barrier: bool = True):
        self.default_parallel = ParallelSpec.parse(parallel) if parallel else ParallelSpec()
        self.commit_barrier = commit_barrier
        """Before every optimizer step, all ranks meet (a one-element all-reduce): a rank's peer that
        died during the step then fails every rank before any optimizer steps, so all states stay at
        the same step (otherwise dp groups away from the failure could step while others cannot)."""
        self.timeout_s = _env_float("ETC_AGENT_TIMEOUT", 120.0)
        """Bound on forming a group, on every collective of the switch, and on waiting for a generation."""
        # ETC_AGENT_LOCAL_RANK: the agent's own count, which --virtual-local-rank leaves intact (LOCAL_RANK is then 0).
        self.local_rank = int(os.environ.get("ETC_AGENT_LOCAL_RANK", os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))))
        address = os.environ.get("ETC_AGENT_ADDR")
        self.elastic = address is not None and os.environ.get("ETC_AGENT_ELASTIC", "1") != "0"
        self._link = _AgentLink(address, self.local_rank) if self.elastic else None
        for key, value in (self._link.hello.get("env", {}) if self._link else {}).items():
            os.environ.setdefault(key, value)  # a sidecar's workers get from it what etcrun puts in their environment
        self.backend = os.environ.get("ETC_AGENT_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
        self.node_id = os.environ.get("ETC_AGENT_NODE_ID", "local")
        # LOCAL_RANK is the CUDA index (0 under --virtual-local-rank, where each worker sees one device).
        cuda_index = int(os.environ.get("LOCAL_RANK", self.local_rank))
        self.device = torch.device("cuda", cuda_index) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.state: dict | None = None
        """The app state of the current layout (what ``build`` returned, holding the migrated data)."""
        self.ctx: ParallelContext | None = None
        """The current :class:`ParallelContext`; replaced after every migration."""
        self.next_step = 0
        """Steps completed so far (the next global step to run)."""
        self.generation = -1
        self.migrations: list[dict] = []
        """One record per migration this process took part in (as sent to the agent)."""
        self._build: Build | None = None
        self._store = None
        self._stepped = False
        self._in_step = False
        self._finished = False
        self._trained_sent = False
        self.migration = os.environ.get("ETC_AGENT_MIGRATION", "live")
        """live, or checkpoint: at a switch save with DCP and exit; new workers load (the baseline)."""
        self.checkpoint_dir = os.environ.get("ETC_AGENT_CHECKPOINT_DIR")
        self._started_wall = time.time()
        interval = int(_env_float("ETC_AGENT_CHECKPOINT_INTERVAL", 0))
        self.checkpointer = None
        """Periodic asynchronous checkpoints (``etcrun --checkpoint-interval``): restore what a failure
        leaves without any live copy; see :mod:`etc_agent.worker.checkpoint`."""
        if interval > 0 and self.checkpoint_dir and self.elastic:
            # Imported here: torch.distributed.checkpoint stays out of processes that never checkpoint.
            from etc_agent.worker.checkpoint import PeriodicCheckpointer

            keep = int(_env_float("ETC_AGENT_CHECKPOINT_KEEP", 2))
            self.checkpointer = PeriodicCheckpointer(self.checkpoint_dir, interval, keep, self.timeout_s)

    # ---- public API ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank if self.ctx else -1

    def start(self, build: Build) -> None:
        """Join the job: the first generation builds fresh state; a later joiner receives it from peers.

        Calling it again (the launcher re-entering the script after a recovery) keeps the live state.
        """
        if self._build is not None:
            return
        self._build = build
        if not self.elastic:
            self._start_static()
            return
        # Every switch runs a full collection so that nothing keeps an old group's connections open;
        # what is alive now (imported modules, mostly) is never that garbage, and frozen it is not
        # scanned again (a full collection after `import torch` costs 0.1-0.3 s on the stall).
        gc.freeze()
        env_generation = int(os.environ.get("ETC_AGENT_GENERATION", 0))
        self._switch(env_generation, "start", stopped_at=None, failure=False)

    def steps(self, num_steps: int) -> Iterator[int]:
        """Global step numbers from the current one to ``num_steps - 1``; switches between steps."""
        if self._build is None:
            raise RuntimeError("call job.start(build) before job.steps()")
        while True:
            if self.elastic:
                self._maybe_switch()
            if self.next_step >= num_steps:
                return
            if self.checkpointer is not None and self.checkpointer.due(self.next_step):
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
        if self.checkpointer is not None:
            self.checkpointer.settle(failure=False)
        if self._link is not None and self.ctx is not None and self.ctx.rank == 0:
            self._link.send({"op": "finished", "step": self.next_step, "generation": self.generation})
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
        if self._link is not None:
            self._link.close()

    def gather_state(self) -> dict[str, torch.Tensor] | None:
        """The whole app state's tensors, unsharded, on rank 0 (None elsewhere). All ranks call it.

        Runs on the executor: rank 0's new layout holds every key as one full box.
        """
        tensors, _ = split_state(self.state)
        transport = TorchTransport()
        infos = transport.all_gather_object([[s.shard.key, list(s.shard.global_shape), s.shard.dtype] for s in describe_state(tensors)])
        full = None
        if self.ctx.rank == 0:
            from etc_agent.migrate.executor import TORCH_DTYPES

            shapes = {key: (tuple(shape), dtype) for info in infos for key, shape, dtype in info}
            full = {key: BoxedTensor(torch.empty(shape, dtype=TORCH_DTYPES[dtype]), shape, (0,) * len(shape)) for key, (shape, dtype) in sorted(shapes.items())}
        result = migrate_state(tensors, full, device=Device("g", self.ctx.rank), old_rank=self.ctx.rank,
                               new_rank=0 if self.ctx.rank == 0 else None, transport=transport, timeout_s=self.timeout_s)
        if full is None:
            return None
        return {key: result.tensors[key].view(full[key].global_shape) for key in full}

    # ---- static (no agent) ---------------------------------------------------------------
    def _start_static(self) -> None:
        world = int(os.environ.get("WORLD_SIZE", 1))
        rank = int(os.environ.get("RANK", 0))
        timeout = timedelta(seconds=self.timeout_s)
        if not dist.is_initialized():
            if world == 1 and "MASTER_ADDR" not in os.environ:
                dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(self.backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        config = self._config_for(os.environ.get("ETC_AGENT_PARALLEL"), world)
        self.ctx = make_context(config, rank, 0, self.device, timeout=timeout)
        self.state = self._build_state(self.ctx)

    def _config_for(self, parallel: str | None, world: int) -> ParallelConfig:
        if parallel:
            config = ParallelConfig.parse(parallel)
        else:
            config = self.default_parallel.resolve(world)
            if config is None:
                raise ValueError(f"parallel config {self.default_parallel.short()} does not fit a world of {world}")
        config.check_world_size(world)
        return config

    def _build_state(self, ctx: ParallelContext) -> dict:
        state = self._build(ctx)
        if not isinstance(state, dict):
            raise TypeError(f"build() must return a dict (the app state), got {type(state).__name__}")
        barrier = self.elastic and self.commit_barrier
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer):
                materialize_optimizer_state(obj, zero=not ctx.restoring)
                if barrier:
                    obj.register_step_pre_hook(self._before_optimizer_step)
                obj.register_step_post_hook(self._on_optimizer_step)
            elif megatron.is_optimizer(obj):
                megatron.materialize_optimizer_state(obj, zero=not ctx.restoring)
                megatron.wrap_step(obj, self._before_optimizer_step if barrier else None, self._on_optimizer_step)
        return state

    def _checkpoint(self) -> None:
        """Snapshot this rank's state and write it in the background (every rank at this boundary)."""
        tensors, plain = split_state(self.state)
        self.checkpointer.save(tensors, {"app": plain, "rng": to_json(torch.get_rng_state(), "rng")}, self.next_step,
                               self.generation, self.ctx.config.short(), self.ctx.rank, self.ctx.world_size, self._store)

    def _before_optimizer_step(self, *args: Any) -> None:
        dist.all_reduce(torch.zeros(1))

    def _on_optimizer_step(self, *args: Any) -> None:
        self._stepped = True
        if not self._trained_sent and self._link is not None and self.ctx is not None and self.ctx.rank == 0:
            self._trained_sent = True
            self._link.send({"op": "trained", "step": self.next_step})

    # ---- switching generations -----------------------------------------------------------
    def _maybe_switch(self) -> None:
        """The step-boundary agreement; after any switch it runs again, so that the first collective
        of every process in a new generation (survivor, joiner, recovered) is this one."""
        while True:
            flag = torch.tensor([max(self._link.latest, self.generation)], dtype=torch.int64)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except Exception as err:  # a peer died between steps
                if not self.recover(err):
                    raise
                continue
            pending = int(flag.item())
            if pending <= self.generation:
                return
            if self.migration == "checkpoint":
                self._save_and_exit(pending, time.time())
            self._switch(pending, f"switch to generation {pending}", stopped_at=(time.time(), time.perf_counter()), failure=False)

    def _save_and_exit(self, pending: int, stopped_at: float) -> None:
        """The checkpoint baseline: save every shard with DCP (files synced), then exit so the agent
        starts fresh workers for generation ``pending`` that load with resharding."""
        from etc_agent.agent.agent import RESTART_EXIT
        from etc_agent.baselines.checkpoint import save_shards

        path = Path(self.checkpoint_dir) / f"gen{pending}"
        tensors, plain = split_state(self.state)
        t0 = time.perf_counter()
        save_shards(describe_state(tensors), path)
        save_s = time.perf_counter() - t0
        if self.ctx.rank == 0:
            meta = {"app": plain, "rng": to_json(torch.get_rng_state(), "rng"), "step": self.next_step,
                    "stopped_at": stopped_at, "save_s": save_s, "config": self.ctx.config.short(), "generation": pending}
            (path / "etc_state.json").write_text(json.dumps(meta))
        dist.barrier()
        print(f"[etc_agent] rank {self.ctx.rank}: saved to {path} in {save_s:.3f} s; exiting for generation {pending} "
              "(--migration checkpoint)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(RESTART_EXIT)  # no interpreter teardown: the saved state is all that matters now

    def _load_checkpoint(self, new_tensors: dict, generation: int, published_at: float) -> dict | None:
        """Load the newest save into the new state (collective over the new world): the baseline's save
        at the last switch, or, after a failure, the newest complete periodic checkpoint (what a
        restarted ``torchrun`` job loads; its write ran in the background, off the stall)."""
        from etc_agent.baselines.checkpoint import load_shards

        saves = sorted(Path(self.checkpoint_dir).glob("gen*/etc_state.json"), key=lambda p: int(p.parent.name[3:]))
        # (step, the baseline's save over a periodic one, newest generation): the state to resume from.
        saves = [((json.loads(p.read_text())), p.parent, (1, int(p.parent.name[3:]))) for p in saves if int(p.parent.name[3:]) <= generation]
        if self.checkpointer is not None:
            from etc_agent.worker.checkpoint import complete_checkpoints

            for stored in complete_checkpoints(Path(self.checkpoint_dir)):
                saves.append(({**stored.state(), "stopped_at": published_at, "save_s": 0.0}, stored.path, (0, stored.generation)))
        if not saves:
            return None
        meta, path, _ = max(saves, key=lambda item: (item[0]["step"], *item[2]))
        t0 = time.perf_counter()
        load_shards(describe_state(new_tensors), path)
        meta["load_s"] = time.perf_counter() - t0
        meta["path"] = str(path)
        meta["written_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")
        return meta

    def recover(self, err: BaseException) -> bool:
        """After a peer failed mid-step: keep the state, switch to the next generation. False if ``err``
        is not a communication failure (or there is no agent), so the caller re-raises it."""
        if not self.elastic or self.state is None or self._finished or self.migration != "live":
            return False
        if not is_communication_error(err):
            return False
        stopped_at = (time.time(), time.perf_counter())
        if self._in_step and self._stepped:
            self.next_step += 1  # the optimizer stepped before the failure: that step is done
        self._in_step = False
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        # The failed step's frames hold the old groups (a ctx local, a pending work); gloo closes a
        # group's connections only when its last reference goes, and peers blocked on this process
        # fail fast only then.
        traceback.clear_frames(err.__traceback__)
        print(f"[etc_agent] rank {self.rank}: communication failed at step {self.next_step} ({first_line}); "
              "keeping the state, waiting for the next generation", file=sys.stderr, flush=True)
        self._switch(self.generation + 1, "recovery after a failure", stopped_at=stopped_at, failure=True)
        return True

    def _teardown_group(self) -> None:
        megatron.destroy_model_parallel()  # its groups are subgroups of the group that ends here
        if self.ctx is not None:
            self.ctx.mesh._pg_registry.clear()  # old DTensors keep their mesh; it must not keep the groups
        self.ctx = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:  # a broken group may fail to shut down cleanly
                log.warning("destroying the old process group: %s", err)
        # DTensor's dispatch cache compares meshes by shape and names: stale entries would attach
        # new DTensors to the old mesh.
        torch._C._clear_DTensor_sharding_propagator_cache()
        gc.collect()

    def _switch(self, at_least: int, why: str, stopped_at: tuple[float, float] | None, failure: bool) -> None:
        try:
            self._switch_to(at_least, why, stopped_at, failure)
        except JobFinished:
            print(f"[etc_agent] {self.node_id}:{self.local_rank}: training finished before this process got into the job; exiting",
                  file=sys.stderr, flush=True)
            if self._link is not None:
                self._link.close()
            raise SystemExit(0) from None

    def _switch_to(self, at_least: int, why: str, stopped_at: tuple[float, float] | None, failure: bool) -> None:
        """Move from the current generation (if any) into the first one >= ``at_least`` that the agent
        serves; see the module docstring."""
        if self.checkpointer is not None:
            self.checkpointer.settle(failure)
        old_rank = self.ctx.rank if self.ctx is not None else None
        old_config = self.ctx.config.short() if self.ctx is not None else None
        old_boxed = None
        plain: dict | None = None
        if self.state is not None:
            tensors, plain = split_state(self.state)
            old_boxed = {s.shard.key: BoxedTensor(s.tensor, s.shard.global_shape, s.shard.offsets, s.shard.lengths, s.shard.flat_range)
                         for s in describe_state(tensors)}
            plain = {"app": plain, "rng": to_json(torch.get_rng_state(), "rng")}
            # The boxes keep the tensors; the app objects (which may hold old groups) go now.
            del tensors
            self.state = None
        self._teardown_group()  # peers blocked on this process fail now instead of at their timeout
        assignment = self._link.assignment(at_least, self.timeout_s, why)
        while True:
            try:
                outcome = self._enter(assignment, old_rank, old_config, old_boxed, plain, stopped_at, failure)
            except JobFinished:
                raise
            except Exception as err:
                # A peer failed during the switch: this process still holds its old shards (sources
                # are only read), so it takes part again in the generation the agent publishes next.
                if not is_communication_error(err):
                    raise
                first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                print(f"[etc_agent] {self.node_id}:{self.local_rank}: switch to generation {assignment['generation']} failed "
                      f"({first_line}); waiting for the next generation", file=sys.stderr, flush=True)
                traceback.clear_frames(err.__traceback__)
                del err
                self.state, self.ctx = None, None
                self._teardown_group()
                # The leader may not know (a departing sender has no status to fail): ask for a new generation.
                self._link.send({"op": "switch_failed", "local_rank": self.local_rank, "generation": assignment["generation"],
                                 "reason": first_line})
                assignment = self._link.assignment(assignment["generation"] + 1, self.timeout_s, "retry after a failed switch")
                failure = True
                continue
            if outcome is not None:
                assignment = outcome  # superseded while gathering: go to the newer generation
                continue
            return

    def _arrive(self, assignment: dict) -> bool:
        """Wait until every process of the generation reached its store (False: a newer one came)."""
        from torch.distributed import TCPStore

        generation = assignment["generation"]
        self._store = TCPStore(assignment["store_addr"], assignment["store_port"], is_master=False,
                               timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        key = f"gen{generation}/arrived"
        self._store.set(f"{key}/{assignment['pg_rank']}", "1")
        self._store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while True:
            count = self._store.add(key, 0)
            if count >= assignment["pg_world_size"]:
                return True
            if self._link.newer_than(generation):
                return False
            if self._link.reply.get("finished"):
                raise JobFinished()
            if time.monotonic() > deadline:
                missing = [d for r, d in enumerate(assignment["devices"]) if not self._store.check([f"{key}/{r}"])]
                raise ArrivalTimeout(f"generation {generation}: {count} of {assignment['pg_world_size']} processes arrived within "
                                     f"{self.timeout_s:.0f} s; missing: {', '.join(missing)}")
            time.sleep(0.01)

    def _enter(self, assignment, old_rank, old_config, old_boxed, plain, stopped_at, failure) -> dict | None:
        generation = assignment["generation"]
        t0 = time.perf_counter()
        if not self._arrive(assignment):
            return self._link.newer_than(generation)
        timeout = timedelta(seconds=self.timeout_s)
        new_rank = assignment["rank"]
        device = Device.parse(assignment["devices"][assignment["pg_rank"]])
        new_state, new_tensors, ctx = None, None, None
        t_group = t_build = time.perf_counter()
        if new_rank is not None:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}/train/", self._store),
                                    rank=new_rank, world_size=assignment["world_size"], timeout=timeout)
            config = self._config_for(assignment["parallel"], assignment["world_size"])
            # Before the first optimizer step nothing is lost if nobody holds state: build it fresh.
            ctx = make_context(config, new_rank, generation, self.device, restoring=bool(assignment.get("trained", assignment["started"])),
                               timeout=timeout)
            t_group = time.perf_counter()
            new_state = self._build_state(ctx)
            new_tensors, _ = split_state(new_state)
            t_build = time.perf_counter()
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{generation}/migrate/", self._store), assignment["pg_rank"],
                                      assignment["pg_world_size"], timeout)
        transport = GroupTransport(group, "gloo")
        holds = old_boxed is not None
        versions = []
        if holds:
            versions.append({"kind": "live", "step": self.next_step, "old_rank": old_rank, "config": old_config, "plain": plain})
        snapshots = {s.step: s for s in self.checkpointer.snapshots} if self.checkpointer is not None and assignment["started"] else {}
        for snapshot in sorted(snapshots.values(), key=lambda s: -s.step):
            versions.append({"kind": "snapshot", "step": snapshot.step, "old_rank": snapshot.rank, "config": snapshot.config,
                             "plain": snapshot.plain})
        storage = self.checkpointer.storage_steps() if self.checkpointer is not None and assignment["started"] else {}
        statuses = transport.all_gather_object({"device": str(device), "new_rank": new_rank, "versions": versions, "storage": storage})
        holders = [i for i, s in enumerate(statuses) if any(v["kind"] == "live" for v in s["versions"])]
        result, source, lost = None, None, []
        if not holders and self.migration == "checkpoint" and assignment["started"] and new_rank is not None:
            meta = self._load_checkpoint(new_tensors, generation, assignment["published_at"])
            if meta is not None:
                load_state(new_state, meta["app"], new_tensors)
                torch.set_rng_state(from_json(meta["rng"]))
                self.state, self.ctx, self.next_step, self.generation = new_state, ctx, meta["step"], generation
                self._report_checkpoint(transport, assignment, meta, t_group, t_build, new_tensors)
                return None
        candidates, stored = _candidates(statuses)
        live_step = max((statuses[i]["versions"][0]["step"] for i in holders), default=None)
        carried, source_config, restored_from = None, None, None
        if not candidates:
            if assignment.get("trained", assignment["started"]):
                self._fatal(StateLost(f"generation {generation}: no process holds any training state (all holders are gone) "
                                      "and there is no checkpoint to restore from"))
            resume_step = self.next_step
        else:
            last_error: Exception | None = None
            for (step, config), sources in candidates:
                restore_path = stored.get(step)
                if config is None:  # only the checkpoint has this step
                    from etc_agent.worker.checkpoint import STATE_FILE

                    state_file = json.loads((Path(restore_path) / STATE_FILE).read_text())
                    config = state_file["config"]
                held = {v["old_rank"] for v in sources.values()}
                lost_ranks = {r: (Device(f"lost{r}", 0), []) for r in range(ParallelConfig.parse(config).world_size) if r not in held}
                lost = [str(d) for d, _ in lost_ranks.values()]
                mine = sources.get(transport.rank)
                old_state = None if mine is None else (old_boxed if mine["kind"] == "live" else snapshots[mine["step"]].boxed)
                if new_rank is None and FAULT_SENDER_PAUSE_S > 0:
                    # Fault injection for tests: a window in which a sender can be killed mid-migration.
                    print(f"[etc_agent] {device}: fault injection: pausing {FAULT_SENDER_PAUSE_S:g} s before sending",
                          file=sys.stderr, flush=True)
                    time.sleep(FAULT_SENDER_PAUSE_S)
                announce = self._announcer(assignment, step, live_step, restore_path)
                try:
                    result = migrate_state(
                        old_state, new_tensors, device=device, old_rank=mine["old_rank"] if mine else None,
                        new_rank=new_rank, transport=transport, tp=ctx.config.tp if ctx else 1,
                        failed=[d for d, _ in lost_ranks.values()], lost_old_ranks=lost_ranks, timeout_s=self.timeout_s,
                        read_checkpoint=self.checkpointer.reader(restore_path) if restore_path else None, on_plan=announce,
                        same_keys=_stages(self._config_for(assignment["parallel"], assignment["world_size"])),
                    )
                except StateLostError as err:
                    # Every process computed the same plan and hit the same gap: try an older step.
                    last_error = err
                    continue
                except ValueError as err:
                    # The descriptions do not fit together (every process sees the same, before anything
                    # moved): what build() returned is wrong somewhere; a restart would repeat it.
                    self._fatal(JobError(f"generation {generation}: the state build() returned does not fit the migrating "
                                         f"state ({ctx.config.short() if ctx else 'sender'}): {err}"))
                resume_step, source_config = step, config
                if sources:
                    source = min(sources)
                    carried = sources[source]["plain"]
                else:
                    carried = {"app": state_file["app"], "rng": state_file["rng"]}
                if result.plan.bytes_restored:
                    restored_from = restore_path
                if mine is not None and mine["kind"] == "snapshot":
                    self.checkpointer.drop(lambda s: s.step == mine["step"])  # the new state may hold its buffers now
                break
            else:
                if not assignment.get("trained", assignment["started"]):
                    # Nothing trained yet: the state every process built is the initial one, so a part
                    # that died with its process is built again (a crash before the first step).
                    resume_step, result = self.next_step, None
                else:
                    hint = "" if self.checkpointer is not None else " (etcrun --checkpoint-dir and --checkpoint-interval keep periodic checkpoints to restore from)"
                    self._fatal(StateLost(f"generation {generation}: training state lost, no step has a live copy or a "
                                          f"checkpoint of every shard: {last_error}{hint}"))
        if self.checkpointer is not None:
            self.checkpointer.drop(lambda s: s.step > resume_step)  # taken on steps that are trained again
            if new_rank == 0 and live_step is not None and resume_step < live_step:
                self.checkpointer.discard_after(resume_step)
        t_migrated = time.perf_counter()
        if new_rank is None:
            self._report(transport, assignment, source_config, result, lost, stopped_at, t0, t_group, t_build, t_migrated, failure,
                         restored_from, 0)
            print(f"[etc_agent] {device}: state sent for generation {generation}; leaving the job", file=sys.stderr, flush=True)
            if self._link is not None:
                self._link.close()
            raise SystemExit(0)
        if carried is not None:
            load_state(new_state, carried["app"], new_tensors)
            torch.set_rng_state(from_json(carried["rng"]))
        redone = (live_step - resume_step) if live_step is not None else 0
        self.state, self.ctx, self.next_step, self.generation = new_state, ctx, resume_step, generation
        self._report(transport, assignment, source_config, result, lost, stopped_at, t0, t_group, t_build, t_migrated, failure,
                     restored_from, redone)
        del group, transport
        return None

    def _report_checkpoint(self, transport, assignment, meta, t_group, t_build, new_tensors) -> None:
        """The baseline's record: stall from the old workers' stop to this resume (one clock: one machine
        here; across machines the wall clocks must agree)."""
        shards = describe_state(new_tensors)
        read = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
        sizes = {s.shard.key: prod(s.shard.global_shape) * s.tensor.element_size() for s in shards}
        mine = {"read": read, "sizes": sizes, "load": meta["load_s"], "rebuild": t_build - t_group, "group_wall": time.time() - (time.perf_counter() - t_group)}
        everyone = transport.all_gather_object(mine)
        if assignment["rank"] != 0:
            return
        now = time.time()
        stopped = meta["stopped_at"]
        moved = meta["written_bytes"] + sum(e["read"] for e in everyone)
        unique = sum({k: v for e in everyone for k, v in e["sizes"].items()}.values())
        record = {
            "generation": assignment["generation"], "method": "checkpoint", "old_config": meta["config"],
            "new_config": self.ctx.config.short(), "old_world_size": ParallelConfig.parse(meta["config"]).world_size,
            "new_world_size": assignment["world_size"], "devices": assignment["devices"][: assignment["world_size"]],
            "reason": assignment["reason"], "step": self.next_step, "bytes_moved": moved, "bytes_moved_intra_node": 0,
            "bytes_moved_inter_node": moved, "state_bytes": unique, "checkpoint_bytes": moved,
            "bytes_restored": sum(e["read"] for e in everyone), "restored_from": str(meta.get("path")) if meta.get("path") else None,
            "detect_s": round(max(stopped - assignment["published_at"], 0.0), 4),
            "agree_s": round(max(e["group_wall"] for e in everyone) - stopped - meta["save_s"], 4),
            "rebuild_s": round(max(e["rebuild"] for e in everyone), 4), "plan_s": 0.0,
            "transfer_s": round(meta["save_s"] + max(e["load"] for e in everyone), 4), "total_stall_s": round(now - stopped, 4),
        }
        self._publish(record)

    def _publish(self, record: dict) -> None:
        """Keep, log and hand one migration record to the agent (which stores it for `etc-agent status`)."""
        self.migrations.append(record)
        print(json.dumps({"event": "etc_migration", **record}), file=sys.stderr, flush=True)
        if self._link is not None:
            self._link.send({"op": "migration", "record": record})

    def _fatal(self, err: JobError) -> None:
        """Tell the agent the job cannot go on (it fails the job instead of restarting), then raise."""
        if self._link is not None:
            self._link.send({"op": "fatal", "reason": str(err)})
        raise err

    def _announcer(self, assignment: dict, step: int, live_step: int | None, restore_path: str | None):
        """What new rank 0 says once the plan is known and before anything moves, when state is lost."""
        if assignment["rank"] != 0:
            return None

        def announce(plan) -> None:
            if not plan.restores and (live_step is None or step >= live_step):
                return
            keys = plan.restored_keys
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            what = (f"{plan.bytes_restored} bytes of {len(keys)} tensors have no live copy ({shown}); reading only those from "
                    f"{restore_path}") if plan.restores else "the survivors' snapshots hold every shard"
            redo = f", training {live_step - step} steps again" if live_step is not None and step < live_step else ""
            print(f"[etc_agent] generation {assignment['generation']}: {what}; resuming at step {step}{redo}", file=sys.stderr, flush=True)

        return announce

    def _report(self, transport, assignment, source_config, result, lost, stopped_at, t0, t_group, t_build, t_migrated, failure,
                restored_from, redone) -> None:
        """Gather each process's phase times; new rank 0 sends one record to its agent and logs it."""
        now_wall, now = time.time(), time.perf_counter()
        mine = {
            "stop_wall": stopped_at[0] if stopped_at else None,
            "stall": (now - stopped_at[1]) if stopped_at else None,
            "agree": (t_group - stopped_at[1]) if stopped_at else None,
            "rebuild": t_build - t_group,
            "plan": result.metrics.plan_s if result else 0.0,
            "transfer": result.metrics.transfer_phase_s if result else 0.0,
            "kept": (result.metrics.bytes_reused + result.metrics.bytes_copied_locally) if result else 0,
        }
        everyone = transport.all_gather_object(mine)
        if result is None or assignment["rank"] != 0:
            return
        new_world = assignment["world_size"]
        stops = [e["stop_wall"] for e in everyone if e["stop_wall"] is not None]
        published = assignment["published_at"]
        detect = (max(stops) - published if not failure else published - min(stops)) if stops else 0.0
        plan = result.plan

        def worst(name: str) -> float:
            values = [e[name] for e in everyone if e[name] is not None]
            return max(values) if values else 0.0

        record = {
            "generation": assignment["generation"], "old_config": source_config, "new_config": self.ctx.config.short(),
            "old_world_size": ParallelConfig.parse(source_config).world_size, "new_world_size": new_world,
            "devices": assignment["devices"][:new_world], "senders": assignment["devices"][new_world:], "lost": lost,
            "reason": assignment["reason"], "step": self.next_step,
            "bytes_moved": plan.bytes_moved, "bytes_moved_intra_node": plan.bytes_moved - plan.bytes_moved_inter_node,
            "bytes_moved_inter_node": plan.bytes_moved_inter_node, "bytes_reused": sum(e["kept"] for e in everyone),
            "state_bytes": plan.state_bytes, "checkpoint_bytes": plan.checkpoint_bytes,
            "bytes_restored": plan.bytes_restored, "restored_from": restored_from, "redone_steps": redone,
            "detect_s": round(max(detect, 0.0), 4), "agree_s": round(worst("agree"), 4), "rebuild_s": round(worst("rebuild"), 4),
            "plan_s": round(worst("plan"), 4), "transfer_s": round(worst("transfer"), 4), "total_stall_s": round(worst("stall"), 4),
        }
        self._publish(record)


def _stages(config: ParallelConfig) -> dict[str, list[int]]:
    """The new ranks of each pipeline stage: they hold the same tensors (boxes of them), by construction."""
    return {f"pipeline stage {pp}": [config.rank(pp, dp, tp) for dp in range(config.dp) for tp in range(config.tp)]
            for pp in range(config.pp)}


def _candidates(statuses: list[dict]) -> tuple[list[tuple[tuple[int, str | None], dict[int, dict]]], dict[int, str]]:
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


_CURRENT: Job | None = None


def init(parallel: str | None = None, commit_barrier: bool = True) -> Job:
    """The job of this process (created on first call; later calls return the same live job).

    ``parallel``: the layout to use when ``etcrun --parallel`` does not say (e.g. ``tp=2,dp=auto``);
    by default every device is a data-parallel replica. ``commit_barrier``: see :attr:`Job.commit_barrier`.
    """
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Job(parallel, commit_barrier)
    return _CURRENT


def current() -> Job | None:
    return _CURRENT
