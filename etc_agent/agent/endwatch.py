"""Says who the end of a job waits for, so that a job whose last workers never exit is not silent.

A job ends when every member's workers exited 0. Until then an agent whose workers are done waits
without a word, as torchrun's does; and a worker that finished its script but hangs as it exits (a
deadlock in a library's teardown, say) holds every node of the job. :class:`EndWatch` turns the
statuses the agents publish into two lines, each repeated every ``every_s``:

- ``waiting_for_nodes`` on a node whose workers succeeded: which members have not, for how long;
- ``workers_still_running`` on a node whose workers are the last ones running while every other
  member's succeeded: its local ranks and pids, and where to look.

Pure: the agent feeds it the generation, this node's state and the statuses it read; it returns
the event to emit, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from etc_agent.rendezvous.records import GenerationRecord

EVERY_S = 30.0
"""Seconds between two lines, and before the first."""


@dataclass
class EndWatch:
    node_id: str
    every_s: float = EVERY_S
    _since: tuple[int, str, float] | None = None
    """(generation, situation, monotonic time it began) of the wait being watched."""
    _last_said: float = 0.0

    def check(
        self,
        now: float,
        gen: GenerationRecord,
        workers_done: bool,
        succeeded: set[str],
        local_pids: dict[int, int],
    ) -> tuple[str, dict] | None:
        """The event to emit now, if any. ``workers_done``: this node's workers exited 0 in ``gen``;
        ``succeeded``: members whose workers did; ``local_pids``: this node's running workers."""
        others = [n for n in gen.members if n != self.node_id]
        if gen.status != "running" or self.node_id not in gen.members:
            self._since = None
            return None
        if workers_done:
            missing = [n for n in others if n not in succeeded]
            situation = "waiting" if missing else ""
        else:
            missing = []
            situation = "last" if others and all(n in succeeded for n in others) and local_pids else ""
        if not situation:
            self._since = None
            return None
        if self._since is None or self._since[:2] != (gen.number, situation):
            self._since, self._last_said = (gen.number, situation, now), now
            return None
        waited = now - self._since[2]
        if now - self._last_said < self.every_s:
            return None
        self._last_said = now
        if situation == "waiting":
            return "waiting_for_nodes", {
                "generation": gen.number,
                "seconds": round(waited),
                "nodes": ",".join(missing),
                "note": "this node's workers exited 0; the job ends when every member's have",
            }
        return "workers_still_running", {
            "generation": gen.number,
            "seconds": round(waited),
            "local_ranks": ",".join(str(r) for r in sorted(local_pids)),
            "pids": ",".join(str(local_pids[r]) for r in sorted(local_pids)),
            "note": "every other member's workers exited 0 and the job waits for these; a worker stuck "
            "as it exits shows where with `py-spy dump --pid PID`",
        }
