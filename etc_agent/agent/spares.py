"""The node's warm spare worker (``etcrun --spare-worker on``, the default): when one is kept, and
when it takes a crashed worker's place.

A spare is a process of the script that ran up to ``etc_agent.init()`` and waits there without a
rank (:mod:`etc_agent.worker.spare`). When a worker of a live job dies, the agent hands the spare
that worker's local rank instead of forking a new process (:meth:`SpareKeeper.take`); the spare
then says hello at once, and the node's rejoin and the survivors' wait in the next generation do
not include a process start and the script's top. One spare per node, whatever its number of
workers: a second crash before a new spare is ready is forked as before.

A spare is started (:meth:`SpareKeeper.maintain`, every pass of the agent's loop) only while the
node trains undisturbed: its workers use the worker API and said hello, the node is running in a
live job, not restarting, not leaving, and has been for ``SETTLE_S`` (so the spare's start never
competes with a switch for the node's cores). It holds what the script's top allocated and its
share of the fork server's pages (docs/faults.md gives the figure). A spare that exits before it
is adopted (a script that needs its rank before ``etc_agent.init()``) turns spares off for the
rest of the agent's run, with one line that says why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from etc_agent.agent.node import Node
from etc_agent.agent.worker_env import spare_env
from etc_agent.agent.workers import WorkerGroup
from etc_agent.protocol.phases import Phase

log = logging.getLogger("etc_agent.agent")

SETTLE_S = 2.0
"""Seconds the node must have trained undisturbed before its spare starts."""


class SpareKeeper:
    """Keeps one warm spare beside the node's workers (see the module docstring)."""

    def __init__(self, node: Node):
        self.node = node
        self.off_because: str | None = None if node.config.spare_worker == "on" else "--spare-worker off"
        """Why no spare is kept (None: one is, when the node trains undisturbed)."""
        self._steady_since: float | None = None

    def maintain(self, now: float | None = None) -> None:
        """Start a spare once the node trained undisturbed for ``SETTLE_S``; notice one that ended."""
        node = self.node
        workers = node.workers
        if not isinstance(workers, WorkerGroup):
            self._steady_since = None
            return
        code = workers.spare_exit_code()
        if code is not None:
            workers.stop_spare(0.0)
            self._turn_off(
                f"the spare exited with code {code} before it was needed: the script's code before "
                "etc_agent.init() may need a rank (LOCAL_RANK and RANK are unset in a spare)"
            )
            return
        spare = workers.spare
        if spare is not None and spare.ready_at is None and spare.poll_ready():
            assert spare.ready_at is not None  # set by poll_ready()
            node.emit("spare_worker_ready", {"seconds": round(spare.ready_at - spare.started_at, 2)})
        if spare is not None or self.off_because is not None:
            return
        now = time.monotonic() if now is None else now
        if not self._undisturbed():
            self._steady_since = None
            return
        self._steady_since = self._steady_since if self._steady_since is not None else now
        if now - self._steady_since < SETTLE_S:
            return
        generation = node.generation.number if node.generation is not None else 0
        workers.start_spare(spare_env(node, generation))
        node.emit("spare_worker_started", {"generation": generation})

    def take(self, local_rank: int, env: dict[str, str], attempt_dir: Path) -> bool:
        """The spare becomes ``local_rank``'s worker (which exited) with ``env``; False where there
        is no live spare (the caller forks a new process instead)."""
        workers = self.node.workers
        if not isinstance(workers, WorkerGroup) or workers.spare is None:
            return False
        waited_s = time.monotonic() - workers.spare.started_at
        if not workers.adopt_spare(local_rank, env, attempt_dir):
            return False
        self._steady_since = None
        self.node.emit("spare_worker_adopted", {"local_rank": local_rank, "spare_age_s": round(waited_s, 1)})
        return True

    def _undisturbed(self) -> bool:
        node = self.node
        state = node.state.state
        return (
            node.elastic
            and node.config.migration == "live"
            and not node.spec.no_python
            and state.phase == Phase.RUNNING
            and state.ready
            and not state.leaving
            and len(node.contacts.hellos) >= node.config.nproc_per_node
        )

    def _turn_off(self, why: str) -> None:
        self.off_because = why
        log.warning("no warm spare worker on %s from now on: %s", self.node.node_id, why)
        self.node.emit("spare_worker_off", {"reason": why})
