"""Periodic checkpoints committed in the store, fenced on the generation they were made in.

Training rank 0 writes a checkpoint's data and its state file as ``etc_state.json.pending``
(:mod:`etc_agent.protocol.checkpoints`), then asks its agent to commit it
(:class:`~etc_agent.protocol.control.CommitCheckpoint`). The agent writes the ``checkpoint`` key in
one transaction that holds only while the ``generation`` key is still at the revision the
checkpoint's generation was published at (:meth:`MembershipStore.put_if_unchanged`), and only then
renames the state file to ``etc_state.json``, which is what every reader looks for. So:

- an agent cut off from the store (fenced) commits nothing; once the store answers, a commit made in
  a generation that was replaced meanwhile is refused, atomically, and its directory is removed: a
  cut-off group never overwrites the live job's checkpoint;
- through a store outage every node shares, checkpoints are written and wait: the newest one is
  committed when the store confirms its generation (an older one still waiting is left
  uncommitted, and pruned).

The agent keeps the one waiting commit and tries it again on every pass of its main loop
(:meth:`Commits.retry`), so it is committed (or refused) even if rank 0's process is gone.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from etc_agent.agent.node import Node
from etc_agent.protocol import keys
from etc_agent.protocol.checkpoints import PENDING_FILE, STATE_FILE, checkpoint_path, prune_checkpoints
from etc_agent.protocol.control import CommitCheckpoint, CommitReply
from etc_agent.rendezvous.records import CheckpointRecord
from etc_agent.rendezvous.store import StoreError


class Commits:
    """This node's checkpoint commits (see the module's docstring)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._waiting: tuple[CommitCheckpoint, float] | None = None
        """The newest commit not yet done, and when it was asked for."""
        self._said_waiting: tuple[int, int] | None = None

    def request(self, req: CommitCheckpoint) -> CommitReply:
        """Rank 0's request (control channel thread): tried now; kept if the store does not answer."""
        directory = self.node.config.checkpoint_dir
        if (
            directory is None
            or Path(req.path).resolve() != checkpoint_path(directory, req.step, req.generation).resolve()
        ):
            raise ValueError(
                f"checkpoint path {req.path!r} is not step {req.step} of generation {req.generation} "
                f"under --checkpoint-dir {directory}"
            )
        with self._lock:
            if self._waiting is not None and self._waiting[0] != req:
                self._leave_uncommitted(self._waiting[0], f"superseded by the checkpoint of step {req.step}")
            self._waiting = (req, time.monotonic())
            return self._attempt()

    def retry(self) -> None:
        """The main loop's pass: try the waiting commit again (no-op when none waits)."""
        with self._lock:
            if self._waiting is not None:
                self._attempt()

    def _attempt(self) -> CommitReply:
        assert self._waiting is not None
        req, asked_at = self._waiting
        node = self.node
        if node.fenced:
            return self._wait(req, "this node is fenced (it lost the store while its peers reach it)")
        served = node.generation
        if served is not None and served.number > req.generation:
            return self._refuse(req, f"generation {req.generation} was replaced by generation {served.number}")
        revision = node.revisions.get(req.generation)
        if revision is None:
            return self._wait(req, f"generation {req.generation}'s revision is not known yet")
        record = CheckpointRecord(
            step=req.step, generation=req.generation, revision=revision, path=req.path, committed_at=time.time()
        )
        try:
            committed = node.store.put_if_unchanged(keys.CHECKPOINT, record.dumps(), keys.GENERATION, revision)
        except StoreError as err:
            return self._wait(req, f"the store does not answer ({err})")
        if not committed:
            return self._refuse(
                req, f"generation {req.generation} (revision {revision}) is no longer the store's current one"
            )
        path = Path(req.path)
        try:
            os.replace(path / PENDING_FILE, path / STATE_FILE)
        except OSError as err:
            return self._refuse(req, f"its state file is gone ({err})", remove=False)
        assert node.config.checkpoint_dir is not None  # request() checked it
        prune_checkpoints(Path(node.config.checkpoint_dir), node.config.checkpoint_keep)
        self._waiting = None
        node.emit(
            "checkpoint_committed",
            {
                "step": req.step,
                "generation": req.generation,
                "revision": revision,
                "waited_s": round(time.monotonic() - asked_at, 3),
            },
        )
        return CommitReply(outcome="committed")

    def _wait(self, req: CommitCheckpoint, why: str) -> CommitReply:
        if self._said_waiting != (req.step, req.generation):
            self._said_waiting = (req.step, req.generation)
            self.node.emit("checkpoint_commit_waiting", {"step": req.step, "generation": req.generation, "why": why})
        return CommitReply(outcome="pending", reason=why)

    def _refuse(self, req: CommitCheckpoint, why: str, remove: bool = True) -> CommitReply:
        """``remove``: the uncommitted directory goes too (a commit of a replaced generation)."""
        self._waiting = None
        said = {"step": req.step, "generation": req.generation, "reason": why}
        if remove:
            shutil.rmtree(req.path, ignore_errors=True)
            said["action"] = f"removed {req.path}"
        self.node.emit("checkpoint_commit_refused", said)
        return CommitReply(outcome="refused", reason=why)

    def _leave_uncommitted(self, req: CommitCheckpoint, why: str) -> None:
        self.node.emit("checkpoint_commit_dropped", {"step": req.step, "generation": req.generation, "reason": why})


__all__ = ["Commits"]
