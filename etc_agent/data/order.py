"""The global sample order, the data position and each data-parallel rank's share: plain arithmetic.

The order depends only on ``(seed, epoch)``: epoch ``e`` is a permutation of ``range(num_samples)``
drawn from a generator seeded with ``seed`` and ``e``. The epochs laid end to end make one stream;
the job's **position** is how many samples of that stream the completed steps consumed. A global
batch is the next ``global_batch`` samples of the stream (it may straddle two epochs), whatever the
layout; so a run through any change of layout consumes each sample of an epoch exactly once.

A global batch is cut into contiguous **shares**, one per data-parallel rank, as even as they can
be (the first ``global_batch % dp`` ranks take one more). Tensor- and pipeline-parallel ranks of
one replica read the same share. Where ``dp`` does not divide the global batch, a rank's mean loss
weighs ``share * dp / global_batch`` (:func:`share_weight`), so that data parallelism's mean of the
ranks' gradients is the gradient of the whole global batch's mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Share:
    """One data-parallel rank's part of a global batch: ``[start, start + count)`` of it."""

    start: int
    count: int


def dp_share(global_batch: int, dp: int, dp_rank: int) -> Share:
    """The ``dp_rank``-th of ``dp`` contiguous, as-even-as-possible parts of ``global_batch``."""
    if global_batch < 1:
        raise ValueError(f"the global batch must hold at least one sample, got {global_batch}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"data-parallel rank {dp_rank} is not one of {dp}")
    if dp > global_batch:
        raise ValueError(f"{dp} data-parallel ranks cannot share a global batch of {global_batch} samples")
    base, extra = divmod(global_batch, dp)
    return Share(dp_rank * base + min(dp_rank, extra), base + (1 if dp_rank < extra else 0))


def share_weight(global_batch: int, dp: int, dp_rank: int) -> float:
    """What a rank's mean loss is multiplied by so that the data-parallel mean of the gradients is
    the global batch's (1.0 wherever ``dp`` divides ``global_batch``)."""
    return dp_share(global_batch, dp, dp_rank).count * dp / global_batch


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """Epoch ``epoch``'s permutation of ``range(num_samples)`` (the same on every process)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=generator).tolist())


@dataclass(frozen=True)
class SampleOrder:
    """The stream of sample indices: epoch permutations of ``num_samples``, end to end."""

    num_samples: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"a dataset of {self.num_samples} samples has nothing to train on")

    def epoch_of(self, position: int) -> int:
        return position // self.num_samples

    def span(self, position: int, count: int) -> list[int]:
        """The ``count`` sample indices of the stream from ``position`` on."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(position + len(out), self.num_samples)
            order = epoch_order(self.num_samples, self.seed, epoch)
            out.extend(order[offset : offset + count - len(out)])
        return out

    def global_batch(self, position: int, global_batch: int) -> list[int]:
        return self.span(position, global_batch)

    def share(self, position: int, global_batch: int, dp: int, dp_rank: int) -> list[int]:
        """``dp_rank``'s samples of the global batch that starts at ``position``."""
        part = dp_share(global_batch, dp, dp_rank)
        return self.span(position + part.start, part.count)


@dataclass(frozen=True)
class DataPosition:
    """Where the job is in the stream: the samples its completed steps consumed, and at which step
    that count holds (the position of any later step follows from the global batch)."""

    consumed: int
    step: int
    seed: int
    global_batch: int

    def at(self, step: int) -> int:
        """The position at the start of ``step``."""
        if step < self.step:
            raise ValueError(f"step {step} comes before the position's step {self.step}")
        return self.consumed + (step - self.step) * self.global_batch


__all__ = ["DataPosition", "SampleOrder", "Share", "dp_share", "epoch_order", "share_weight"]
