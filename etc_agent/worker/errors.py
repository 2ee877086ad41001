"""What can stop a worker, grouped by whose fault it is.

- the user's script or ``build()``: :class:`BuildMismatch` (and the script's own exceptions);
- the planner (a bug: the plan broke one of its own invariants): :class:`PlannerBug`;
- a peer (a process that died or vanished): :func:`is_peer_failure` says which errors are that;
- the job's state: :class:`StateLost` (no live copy and no checkpoint of some shard).
"""

from __future__ import annotations

import torch.distributed as dist

from etc_agent.migrate.transport import MigrationError


class JobError(RuntimeError):
    """The job cannot go on (state lost, the agent unreachable, a switch that did not complete)."""


class StateLost(JobError):
    """Some training state has no live copy; the job cannot go on without a checkpoint."""


class BuildMismatch(JobError):
    """What ``build()`` returned does not fit the migrating state (names, shapes, dtypes): the
    script's fault, and a restart would repeat it."""


class PlannerBug(JobError):
    """A migration plan broke one of the planner's own invariants (coverage, bounds, dtypes): a bug
    in etc_agent, reported as such."""


class ArrivalTimeout(JobError):
    """Not every process of a generation reached its store in time (one may have died)."""


class JobFinished(Exception):
    """Training completed its last step before this process got into the job."""


_PEER_FAILURE_WORDS = (
    "gloo",
    "nccl",
    "connection",
    "timed out",
    "timeout",
    "peer",
    "process group",
    "processgroup",
    "socket",
)
"""Words of the errors torch raises without a type of their own when a peer dies (gloo's
``RuntimeError: [../gloo/transport/tcp/pair.cc] Connection closed by peer``, a collective's
``Timed out waiting ...``); one test per word checks a real message of that kind."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is what a failed or vanished peer causes (not a bug in the training script)."""
    if isinstance(err, (MigrationError, ArrivalTimeout)) or isinstance(err, getattr(dist, "DistError", MigrationError)):
        return True
    return isinstance(err, RuntimeError) and not isinstance(err, JobError) and names_peer_failure(str(err))


def names_peer_failure(text: str) -> bool:
    """The one place where an error's text decides: torch gives these failures no type of their own."""
    lowered = text.lower()
    return any(word in lowered for word in _PEER_FAILURE_WORDS)
