"""The step boundary's votes: collectives over the training group that every rank of a generation
runs at the same step boundary (:meth:`etc_agent.worker.job.Job.steps`), so that all ranks switch,
checkpoint or go on together.

A vote is one small all-reduce and a host sync: on this project's 2-core CI machine 1.5-2 ms, on a
GPU job at thousands of ranks a latency every step would pay. So the ranks do not vote at every
boundary: each vote also names the next boundary that holds one (:class:`VoteSchedule`), about
``ETC_AGENT_VOTE_INTERVAL`` seconds of training ahead at the slowest rank's step time, and every
rank, having seen the same vote, stops at the same boundaries. A vote is held besides at the first
boundary of every generation (the first collective of a survivor, a joiner and a recovered process
alike), at every periodic-checkpoint boundary and at the last step. A new generation therefore
takes over up to one interval after the agents see it (the workers train meanwhile; the stall is
unchanged); a rank's failure surfaces in the step's own collectives as before."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from etc_agent.layout.config import ParallelConfig
from etc_agent.worker.logs import say

if TYPE_CHECKING:
    from etc_agent.worker.checkpoint import PeriodicCheckpointer


@dataclass(frozen=True)
class BoundaryVote:
    """What the ranks agreed at a step boundary (the maximum over every rank)."""

    pending: int
    """The newest generation any rank's agent has seen."""
    checkpoint_due: bool
    """Some rank lacks this step's snapshot: every rank takes a periodic checkpoint here."""
    writing: bool
    """Some rank's previous checkpoint write still runs."""
    fenced: bool = False
    """Some rank's agent is fenced (it lost the store while its peers reach it): no rank trains the
    next step of this generation; they hold here until a newer generation or the fence lifts."""
    slowest_step_s: float = 0.0
    """The longest step any rank trained since the previous vote (0: none yet in this generation)."""
    commit_barrier: bool = True
    """Some rank's state needs the commit barrier before every optimizer step (:func:`needs_commit_barrier`)."""
    preparing: bool = False
    """Some rank still prepares the pending generation (:meth:`~etc_agent.worker.prepare.Preparations.preparing`):
    every rank trains on and votes again at the next boundary."""


def boundary_vote(
    seen: int,
    checkpointer: PeriodicCheckpointer | None,
    step: int,
    fenced: bool = False,
    slowest_step_s: float = 0.0,
    commit_barrier: bool = True,
    preparing: bool = False,
) -> BoundaryVote:
    """All-reduce (MAX) the generation this rank has seen, its checkpoint flags at ``step``, whether
    its agent is fenced, its longest step since the previous vote, whether it needs the commit
    barrier and whether it still prepares the generation it has seen."""
    due = checkpointer is not None and checkpointer.due(step)
    busy = checkpointer is not None and checkpointer.writing()
    step_us = int(slowest_step_s * 1e6)
    flags = [seen, int(due), int(busy), int(fenced), step_us, int(commit_barrier), int(preparing)]
    flag = torch.tensor(flags, dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    pending, any_due, any_busy, any_fenced, slowest_us, barrier, any_preparing = (int(v) for v in flag.tolist())
    return BoundaryVote(
        pending, bool(any_due), bool(any_busy), bool(any_fenced), slowest_us / 1e6, bool(barrier), bool(any_preparing)
    )


def needs_commit_barrier(config: ParallelConfig, whole_tensors: Callable[[], bool]) -> bool:
    """Whether a generation's steps need the commit barrier before every optimizer step (a
    one-element all-reduce: a peer that died during the step then fails every rank before any
    optimizer steps). Not where the layout is plain replicas over every rank (tp = pp = 1, no ZeRO,
    no FSDP) and the state holds whole tensors only (``whole_tensors()``, asked only then): a survivor that stepped
    before the failure surfaced and one that did not each hold a whole copy, so the next layout
    has a step with every tensor (the newest), whatever the others did. With any shard, a group
    away from the failure could step while the shard's holders could not, and no step would then
    cover every shard. Every rank votes its answer (:func:`boundary_vote`): one with a shard turns
    the barrier on for all."""
    replicas = config.tp == 1 and config.pp == 1 and config.zero == 0 and config.dp_shard == 1
    return not (replicas and whole_tensors())


def hold_fenced(generation: int, step: int, rank: int, said_at: int) -> int:
    """A rank's agent is fenced: every rank waits at this boundary (voting again) for a newer
    generation or the fence to lift; none trains the next step in a generation that may be over.
    Rank 0 says so once per boundary; returns the boundary it was said at."""
    if said_at != step and rank == 0:
        say(
            f"generation {generation}: an agent lost the store while its peers reach it; "
            f"every rank holds before step {step}",
        )
    time.sleep(0.1)
    return step


@dataclass
class VoteSchedule:
    """Which step boundaries hold a vote. Every rank keeps one and feeds it the same votes, so all
    compute the same boundaries; plain data and arithmetic, no collectives.

    Call sequence, per rank: :meth:`restart` when a generation starts (its first boundary votes);
    :meth:`boundary` at every step boundary; where :meth:`due`, vote and pass the vote's
    ``slowest_step_s`` to :meth:`voted`."""

    interval_s: float
    """Seconds of training between votes at the slowest rank's pace (0: a vote at every boundary)."""
    max_gap: int = 64
    """At most this many steps between votes: a step that slows down sharply after a vote (an
    evaluation, a slower input) delays the next one by at most this many of its steps."""
    next_vote: int = 0
    """The boundary (step number) of the next vote."""
    last_step_s: float | None = None
    """The time between this rank's last two boundaries (None right after a restart)."""
    _last_boundary_s: float | None = field(default=None, repr=False)
    _slowest_s: float = field(default=0.0, repr=False)

    def restart(self, step: int) -> None:
        """A generation starts at ``step``: vote there, with no step time measured yet."""
        self.next_vote = step
        self._last_boundary_s = None
        self._slowest_s = 0.0
        self.last_step_s = None

    def boundary(self, now_s: float) -> None:
        """This rank reached a step boundary at ``now_s`` (a monotonic clock)."""
        if self._last_boundary_s is not None:
            self.last_step_s = now_s - self._last_boundary_s
            self._slowest_s = max(self._slowest_s, self.last_step_s)
        self._last_boundary_s = now_s

    @property
    def slowest_step_s(self) -> float:
        """This rank's longest step since the previous vote (what it brings to the next vote)."""
        return self._slowest_s

    def due(self, step: int, checkpoint_boundary: bool, last: bool) -> bool:
        """Whether the boundary before ``step`` holds a vote."""
        return step >= self.next_vote or checkpoint_boundary or last

    def voted(self, step: int, slowest_step_s: float) -> None:
        """The ranks voted at ``step`` and their slowest step since the previous vote took
        ``slowest_step_s``: the next vote comes ``interval_s`` of such steps later."""
        gap = 1
        if self.interval_s > 0 and slowest_step_s > 0:
            gap = max(1, min(self.max_gap, int(self.interval_s / slowest_step_s)))
        self.next_vote = step + gap
        self._slowest_s = 0.0


def agree_on_checkpoint(checkpointer: PeriodicCheckpointer, timeout_s: float, rank: int, step: int) -> bool:
    """A checkpoint is due and some rank's previous write still runs: every rank waits for its
    own (at most half the group timeout, so that the others' wait in the vote below cannot
    time out first), then all take the new one, or, where a write had to be abandoned, none does
    and the checkpoint group is formed anew (the abandoned write's collectives may still be
    pending on the old one). A rank that skipped alone would leave the others' new write
    waiting for it until its timeout."""
    settled = checkpointer.settle(failure=False, limit_s=timeout_s / 2)
    vote = torch.tensor([int(settled)], dtype=torch.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    if vote.item():
        return True
    checkpointer.drop_group()
    if rank == 0:
        say(
            f"checkpoint of step {step} skipped on every rank: a rank's previous "
            f"checkpoint was still being written after {timeout_s / 2:g} s",
        )
    return False
