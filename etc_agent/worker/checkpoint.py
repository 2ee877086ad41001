"""Periodic asynchronous checkpoints: the source of last resort for state no live process holds.

Every ``interval`` steps, at a step boundary (every rank of the generation at the same step), each
rank copies its shards into host memory (a *snapshot*) and a background thread writes the snapshot
with DCP into ``<dir>/step<S>-g<generation>/``, coordinated over a gloo
group of its own (never the training group), then rank 0 writes ``etc_state.json`` (step, layout,
carried plain state): a checkpoint without that file is incomplete and never read.

A rank keeps two snapshots: the newest whose write completed and the one being written (a failure
during a write leaves that checkpoint incomplete, and the one before must still be whole on every
survivor), so periodic checkpoints cost twice the rank's state in host memory.

When a failure takes state that no live process holds, the job migrates from the snapshots of the
newest checkpointed step instead of the live state: the survivors' snapshots move device to device
like live state, only the regions that nobody holds are read from storage, and the steps since are
trained again. Without a complete checkpoint at that step the job stops naming the lost tensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from etc_agent.migrate.describe import BoxedTensor, describe_state
from etc_agent.migrate.storage import save_shards_on
from etc_agent.migrate.transport import GroupTransport
from etc_agent.protocol.checkpoints import (
    PENDING_FILE,
    STATE_FILE,
    checkpoint_path,
    complete_checkpoints,
    prune_checkpoints,
)
from etc_agent.protocol.control import CommitReply
from etc_agent.protocol.settings import WorkerSettings
from etc_agent.worker.connect import gloo_group
from etc_agent.worker.logs import say, write_json

log = logging.getLogger("etc_agent.worker")

FAILURE_SETTLE_S = 0.5
"""After a failure, how long a switch waits for a background checkpoint write to end."""


def _fault_commit_pause_s() -> float:
    """Fault injection for tests (``ETC_AGENT_FAULT_CHECKPOINT_COMMIT_PAUSE_S``): the first write of
    rank 0 pauses this long after every rank's data is written, before it marks the checkpoint
    complete (a slow storage, say)."""
    return WorkerSettings.from_env(os.environ).fault_checkpoint_commit_pause_s


@dataclass
class Snapshot:
    """This rank's state at a checkpointed step, in host memory."""

    step: int
    generation: int
    config: str
    rank: int
    boxed: dict[str, BoxedTensor]
    plain: dict[str, Any]
    """``{"app": carried plain values, "rng": RNG state}`` at that step."""
    written: bool = False
    """This rank's write of it completed (every rank wrote its part; rank 0 then marks it complete)."""
    reusable: bool = True
    """False once a write of it was abandoned: that thread may still read the buffers."""


RESUME_KEYS = ("step", "config", "world_size", "app", "rng")
"""What ``etc_state.json`` must hold for a job to resume from the checkpoint."""


def resumable_checkpoints(directory: str | Path) -> dict[int, str]:
    """Step -> directory of the newest usable complete checkpoint of each step under ``directory``
    (a full restart resumes from the newest). A complete one whose state file does not parse or
    whose DCP metadata is missing is skipped with a log line, so the one before it is used."""
    usable: dict[int, str] = {}
    root = Path(directory)
    if not root.is_dir():
        return usable
    for checkpoint in complete_checkpoints(root):
        try:
            state = checkpoint.state()
            missing = [k for k in RESUME_KEYS if k not in state]
            if missing:
                raise ValueError(f"{STATE_FILE} lacks {', '.join(missing)}")
            if not (checkpoint.path / ".metadata").is_file():
                raise ValueError("DCP's .metadata is missing")
            _check_data_files(checkpoint.path)
        except (OSError, ValueError) as err:
            say(
                f"checkpoint {checkpoint.path} is not usable ({err}); an older one is used instead",
            )
            continue
        usable[checkpoint.step] = str(checkpoint.path)
    return usable


def _check_data_files(path: Path) -> None:
    """ValueError naming the first data file that DCP's metadata refers to and that is missing or
    shorter than the bytes it should hold (a copy cut short, a file lost), from the metadata alone:
    nothing of the data is read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # whatever stops torch reading it makes the checkpoint unusable
        raise ValueError(f"DCP's .metadata does not load: {type(err).__name__}: {err}") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        data = path / relative
        if not data.is_file():
            raise ValueError(f"its data file {relative} is missing")
        if data.stat().st_size < size:
            raise ValueError(f"its data file {relative} holds {data.stat().st_size} bytes of {size}")


@dataclass
class _Write:
    thread: threading.Thread
    step: int
    started: float
    snapshot: Snapshot
    error: str | None = None
    done: bool = False
    abandoned: bool = False
    """Set when the job stopped waiting for it: it must not mark the checkpoint complete any more
    (its snapshot buffers may be reused)."""
    stats: dict[str, float] = field(default_factory=dict)


class PeriodicCheckpointer:
    """One rank's periodic checkpoints (see the module docstring for the call sequence)."""

    @classmethod
    def from_settings(
        cls, settings: WorkerSettings, commit: Callable[[int, int, str], CommitReply | None] | None
    ) -> PeriodicCheckpointer:
        """The checkpointer ``etcrun --checkpoint-dir/--checkpoint-interval/--checkpoint-keep`` ask for."""
        assert settings.checkpoint_dir is not None  # the job makes one only with a directory
        return cls(
            settings.checkpoint_dir,
            settings.checkpoint_interval,
            settings.checkpoint_keep,
            settings.timeout_s,
            commit,
        )

    def __init__(
        self,
        directory: str | Path,
        interval: int,
        keep: int,
        timeout_s: float,
        commit: Callable[[int, int, str], CommitReply | None] | None = None,
    ):
        """``commit(step, generation, path)``: rank 0's request to its agent to commit a written
        checkpoint (None: no agent; rank 0 commits it itself)."""
        if interval <= 0:
            raise ValueError(f"checkpoint interval must be a positive number of steps, got {interval}")
        self.directory = Path(directory)
        self.interval = interval
        self.keep = max(keep, 1)
        self.timeout_s = timeout_s
        self.commit = commit
        self._committing: threading.Thread | None = None
        self.snapshots: list[Snapshot] = []
        """At most two, oldest first: the newest written one and the one being written."""
        self._write: _Write | None = None
        self._group: tuple[int, Any] | None = None  # (generation, group of that generation's ranks)
        self._fault_paused = False
        self._groups_dropped = 0
        """Groups given up on (every rank at once, see :meth:`drop_group`): part of the next one's store prefix."""

    def is_boundary(self, step: int) -> bool:
        """Whether this step boundary is one where checkpoints are taken."""
        return step > 0 and step % self.interval == 0

    def due(self, step: int) -> bool:
        """Whether this rank would take a checkpoint at this step boundary (it has no snapshot of it
        yet). Ranks may differ after a switch: the job takes one wherever any rank says so."""
        return self.is_boundary(step) and all(s.step != step for s in self.snapshots)

    def writing(self) -> bool:
        """Whether this rank's background write still runs (asked at every step boundary, so that a
        checkpoint is skipped by every rank or by none)."""
        return self._write is not None and self._write.thread.is_alive()

    def drop_group(self) -> None:
        """Every rank gives the checkpoint group up at once (a write was abandoned somewhere: its
        collectives may still be pending on it); the next checkpoint forms a new one."""
        self._group = None
        self._groups_dropped += 1

    def drop(self, which) -> None:
        """Forget the snapshots ``which(snapshot)`` selects (used as a migration's source, or of steps
        that are trained again)."""
        self.snapshots = [s for s in self.snapshots if not which(s)]

    def save(
        self,
        state_tensors: dict[str, Any],
        plain: dict[str, Any],
        step: int,
        generation: int,
        config: str,
        rank: int,
        world_size: int,
        store,
    ) -> None:
        """Snapshot this rank's shards now and write them in the background. Every rank calls it."""
        in_flight = self._write.step if self._write is not None else None
        if not self.settle(failure=False):  # it also forgets the write it gave up on
            say(
                f"rank {rank}: the checkpoint of step {in_flight} is still being written; "
                f"skipping the one of step {step}",
            )
            return
        started = time.perf_counter()
        # Keep the newest written snapshot as the fallback while this one is written; the buffers of
        # an older one (same boxes: the same layout) are reused.
        written = [s for s in self.snapshots if s.written]
        fallback = written[-1] if written else None
        spare = [s for s in self.snapshots if s is not fallback and s.reusable]
        boxed = _stage(state_tensors, spare[-1].boxed if spare else {})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        snapshot = Snapshot(step, generation, config, rank, boxed, plain)
        self.snapshots = ([fallback] if fallback is not None else []) + [snapshot]
        staged_s = time.perf_counter() - started
        if self._group is None or self._group[0] != generation:
            group = gloo_group(
                dist.PrefixStore(f"gen{generation}/ckpt{self._groups_dropped or ''}/", store),
                rank,
                world_size,
                timedelta(seconds=self.timeout_s),
            )
            self._group = (generation, group)
        path = checkpoint_path(self.directory, step, generation)
        write = _Write(thread=None, step=step, started=time.time(), snapshot=snapshot)  # type: ignore[arg-type]
        write.stats["staged_s"] = staged_s
        # GroupTransport's hint says ProcessGroup; it uses only rank/size/allgather/send/recv, which gloo has.
        transport = GroupTransport(self._group[1], "gloo")  # type: ignore[arg-type]
        write.thread = threading.Thread(
            target=self._run, args=(write, snapshot, path, transport), name="etc-agent-checkpoint", daemon=True
        )
        self._write = write
        write.thread.start()

    def _run(self, write: _Write, snapshot: Snapshot, path: Path, transport: GroupTransport) -> None:
        try:
            t0 = time.perf_counter()
            written = save_shards_on(describe_state(snapshot.boxed), path, transport)
            sizes = transport.all_gather_object(written)
            pause_s = _fault_commit_pause_s()
            if pause_s > 0 and transport.rank == 0 and not self._fault_paused:
                self._fault_paused = True
                say(
                    f"fault injection: the commit of checkpoint step {snapshot.step} pauses {pause_s:g} s",
                )
                time.sleep(pause_s)
            write.stats["write_s"] = time.perf_counter() - t0
            snapshot.written = not write.abandoned
            if transport.rank == 0 and not write.abandoned:
                state = {
                    "step": snapshot.step,
                    "generation": snapshot.generation,
                    "config": snapshot.config,
                    "world_size": transport.world_size,
                    "bytes": sum(sizes),
                    **snapshot.plain,
                }
                tmp = path / f"{STATE_FILE}.tmp"
                tmp.write_text(json.dumps(state))
                os.replace(tmp, path / PENDING_FILE)
                said = {
                    "event": "etc_checkpoint",
                    "step": snapshot.step,
                    "generation": snapshot.generation,
                    "path": str(path),
                    "bytes": sum(sizes),
                    "staged_s": round(write.stats["staged_s"], 4),
                    "write_s": round(write.stats["write_s"], 4),
                }
                # In a thread of its own: a commit waits for the store, the next checkpoint must not.
                self._committing = threading.Thread(
                    target=self._commit, args=(snapshot, path, said), name="etc-agent-commit", daemon=True
                )
                self._committing.start()
            write.done = True
        except Exception as err:  # noqa: BLE001 - a peer failed or storage did: this checkpoint stays incomplete
            write.error = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            say(
                f"checkpoint of step {snapshot.step} not completed: {write.error}",
            )

    def _commit(self, snapshot: Snapshot, path: Path, said: dict[str, Any]) -> None:
        """Rank 0: the written checkpoint committed by the agent, fenced on its generation
        (:mod:`etc_agent.agent.commits`), or here where no agent runs the job; said on stderr."""
        reply = None
        if self.commit is None:
            os.replace(path / PENDING_FILE, path / STATE_FILE)
            prune_checkpoints(self.directory, self.keep)
            outcome = "committed"
        else:
            reply = self.commit(snapshot.step, snapshot.generation, str(path))
            outcome = reply.outcome if reply is not None else "unanswered"
        write_json({**said, "commit": outcome})
        if reply is not None and reply.outcome != "committed":
            say(
                f"checkpoint of step {snapshot.step} (generation {snapshot.generation}) written, "
                f"{'commit refused' if reply.outcome == 'refused' else 'its commit waits'}: {reply.reason}",
            )

    def wait_commit(self, limit_s: float) -> None:
        """Wait (bounded) for rank 0's last commit request to be answered (the job's end: a
        daemon thread dies with the process)."""
        if self._committing is not None:
            self._committing.join(timeout=limit_s)

    def settle(self, failure: bool, limit_s: float | None = None) -> bool:
        """Wait for the background write (bounded: ``limit_s``, by default the group timeout). True
        when none is running any more.

        At a planned switch every rank waits (they all write); after a failure the write's group is
        broken and the wait is short: the write is abandoned, its directory stays incomplete.
        """
        write = self._write
        if write is None or not write.thread.is_alive():
            return True
        # After a failure every second here is a second of this process's stall (and its peers'):
        # a write that is not about to end is given up; its directory stays incomplete.
        if limit_s is None:
            limit_s = FAILURE_SETTLE_S if failure else self.timeout_s
        write.thread.join(timeout=limit_s)
        if write.thread.is_alive():
            say(
                f"checkpoint of step {write.step} abandoned (still writing after {limit_s:g} s)",
            )
            write.abandoned = True
            write.snapshot.reusable = False  # the next snapshot gets fresh buffers: the thread may still read these
            self._write = None
            return False
        return True

    def storage_steps(self) -> dict[int, str]:
        """Step -> directory of the newest complete checkpoint of each step visible here."""
        if not self.directory.exists():
            return {}
        return {c.step: str(c.path) for c in complete_checkpoints(self.directory)}

    def discard_after(self, step: int) -> None:
        """Training went back to ``step``: checkpoints of later steps belong to steps that will be
        trained again; they must never be mixed with the new ones (rank 0 calls it)."""
        for c in complete_checkpoints(self.directory):
            if c.step > step:
                (c.path / STATE_FILE).unlink(missing_ok=True)
                shutil.rmtree(c.path, ignore_errors=True)


def _stage(state_tensors: dict[str, Any], previous: dict[str, BoxedTensor]) -> dict[str, BoxedTensor]:
    """A host copy of every shard, into ``previous``'s buffers where a shard has the same box."""
    boxed = {}
    for local in describe_state(state_tensors):
        s = local.shard
        old = previous.get(s.key)
        if old is not None and (old.tensor.shape, old.tensor.dtype, old.offsets, old.lengths, old.flat_range) == (
            local.tensor.shape,
            local.tensor.dtype,
            s.offsets,
            s.lengths,
            s.flat_range,
        ):
            copy = old.tensor
        else:
            copy = torch.empty(
                local.tensor.shape, dtype=local.tensor.dtype, device="cpu", pin_memory=local.tensor.is_cuda
            )
        copy.copy_(local.tensor.detach(), non_blocking=local.tensor.is_cuda)
        boxed[s.key] = BoxedTensor(copy, s.global_shape, s.offsets, s.lengths, s.flat_range)
    return boxed
