"""Who may say what on an agent's control channel.

Every request is signed with the key of one local rank (:mod:`etc_agent.utils.auth`): the agent gives
worker ``local_rank`` only its own key (``ETC_AGENT_TOKEN``), so a request proves which worker slot it
comes from. On top of that, what a request claims must fit what the agent knows:

- a request naming a ``local_rank`` names the rank of its key;
- ``hello`` names a pid the agent started for that rank, or a descendant of it (a script started
  through a wrapper); a sidecar's workers are started by another launcher, so there any pid goes;
- ``finished``, ``trained`` and ``migration`` are the reports of training rank 0: accepted only from
  the local rank that was training rank 0 of the generation they name (``trained`` names none: the
  rank 0 of the generation this node serves);
- ``leave`` (a planned departure of the node) only where workers come from another launcher (a
  sidecar): etcrun's own workers leave when their agent does, never on their own say.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from etc_agent.protocol.control import CommitCheckpoint, Finished, Hello, Leave, Migration, Trained
from etc_agent.utils import auth
from etc_agent.utils.auth import Key

MAX_REMEMBERED_GENERATIONS = 64


class NotAllowed(ValueError):
    """A signed request that does not fit what the agent knows (answered with an error, logged)."""


def is_descendant(pid: int, ancestor: int, max_depth: int = 16) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (Linux ``/proc``)."""
    for _ in range(max_depth):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        # The command may hold spaces and parentheses: the fields after the last ')' are fixed.
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


class ControlKeys:
    """The control channel's keys and rules for one agent (thread-safe)."""

    def __init__(self, nproc_per_node: int, sidecar: bool, master: bytes | None = None):
        self.nproc_per_node, self.sidecar = nproc_per_node, sidecar
        self.master = master if master is not None else auth.control_master(auth.configured_secret())
        self._lock = threading.Lock()
        self._rank0: OrderedDict[int, int] = OrderedDict()
        """Generation -> the local rank that was its training rank 0 (generations where it was here)."""
        self._serving: int | None = None

    def lookup(self, key_id: str) -> Key | None:
        local_rank = auth.worker_rank_of(key_id)
        if local_rank is None or local_rank >= self.nproc_per_node:
            return None
        return auth.derive(self.master, key_id)

    def token(self, local_rank: int) -> str:
        """``ETC_AGENT_TOKEN`` of the worker of ``local_rank``."""
        return auth.derive(self.master, auth.worker_key_id(local_rank)).token()

    def serving(self, generation: int, rank0_local: int | None) -> None:
        """The node now serves ``generation``; ``rank0_local`` is its local training rank 0, if any."""
        with self._lock:
            self._serving = generation
            if rank0_local is not None:
                self._rank0[generation] = rank0_local
                while len(self._rank0) > MAX_REMEMBERED_GENERATIONS:
                    self._rank0.popitem(last=False)

    def check(self, req: object, key_id: str, started_pid: Callable[[int], int | None]) -> None:
        """Raise :class:`NotAllowed` unless ``req``, signed with ``key_id``'s key, may be acted on.
        ``started_pid(local_rank)``: the pid this agent started for the rank (None: none known)."""
        local_rank = auth.worker_rank_of(key_id)
        assert local_rank is not None, key_id  # lookup() knows no other keys
        claimed = getattr(req, "local_rank", local_rank)
        if claimed != local_rank:
            raise NotAllowed(f"signed by local rank {local_rank}'s key but names local rank {claimed}")
        if isinstance(req, Leave) and not self.sidecar:
            raise NotAllowed("leave comes from a sidecar's worker launcher; this agent started its workers itself")
        if isinstance(req, Hello) and req.pid is not None and not self.sidecar:
            started = started_pid(local_rank)
            if started is not None and not is_descendant(req.pid, started):
                raise NotAllowed(f"pid {req.pid} is not the worker this agent started for local rank {local_rank}")
        if isinstance(req, Finished | Migration | Trained | CommitCheckpoint):
            with self._lock:
                if isinstance(req, Trained):
                    # Rank 0 may commit its first step just as the node prepares the next generation.
                    serving = self._serving
                    generation = next(
                        (
                            g
                            for g in (serving, (serving or 0) - 1)
                            if g is not None and self._rank0.get(g) == local_rank
                        ),
                        serving,
                    )
                elif isinstance(req, Finished | CommitCheckpoint):
                    generation = req.generation
                else:
                    generation = req.record.generation
                rank0 = self._rank0.get(generation) if generation is not None else None
            if rank0 != local_rank:
                raise NotAllowed(
                    f"{req.op} is training rank 0's report; local rank {local_rank} was not rank 0 of generation "
                    f"{generation}"
                )
