"""The step boundary's votes: collectives over the training group that every rank of a generation
runs at the same step boundary (:meth:`etc_agent.worker.job.Job.steps`), so that all ranks switch,
checkpoint or go on together."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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


def boundary_vote(
    seen: int, checkpointer: PeriodicCheckpointer | None, step: int, fenced: bool = False
) -> BoundaryVote:
    """All-reduce (MAX) the generation this rank has seen, its checkpoint flags at ``step`` and
    whether its agent is fenced."""
    due = checkpointer is not None and checkpointer.due(step)
    busy = checkpointer is not None and checkpointer.writing()
    flag = torch.tensor([seen, int(due), int(busy), int(fenced)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return BoundaryVote(int(flag[0].item()), bool(flag[1].item()), bool(flag[2].item()), bool(flag[3].item()))


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
        print(
            f"[etc_agent] checkpoint of step {step} skipped on every rank: a rank's previous "
            f"checkpoint was still being written after {timeout_s / 2:g} s",
            file=sys.stderr,
            flush=True,
        )
    return False
