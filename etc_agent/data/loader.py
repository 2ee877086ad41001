"""Exactly-once data for an elastic job: a user's map-style dataset read in the global order, each
data-parallel rank its share of each step's global batch, prefetched by loader worker processes.

Put an :class:`ElasticData` in the app state ``build(ctx)`` returns, next to the model and the
optimizer, built for that context's data-parallel rank and degree; ask it for each step's batch::

    def build(ctx):
        model = ...
        data = ElasticData(dataset, global_batch=64, dp=ctx.config.dp, dp_rank=ctx.dp_rank)
        return {"model": model, "optim": optim, "data": data}

    for step in job.steps(num_steps):
        batch = job.state["data"].batch(step)

The job carries its position (:meth:`ElasticData.state_dict`: the samples consumed by the completed
steps) through every switch and into every periodic checkpoint, like the optimizer's plain state;
the position of a step follows from it, so a step trained again after a failure reads the same
samples, and a step's samples never depend on the layout. At a switch the old object and its
prefetched batches are dropped with the old app state; the new one starts its loader at the
position once, on its first :meth:`~ElasticData.batch`.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset, Sampler, default_collate

from etc_agent.data.order import DataPosition, SampleOrder, dp_share, share_weight

log = logging.getLogger("etc_agent.data")


class StepSampler(Sampler[list[int]]):
    """The batch sampler of one data-parallel rank: its share of each step's global batch, from
    ``first_step`` on, without end (the training loop decides when to stop asking)."""

    def __init__(self, order: SampleOrder, position: DataPosition, first_step: int, dp: int, dp_rank: int):
        self.order, self.position = order, position
        self.first_step, self.dp, self.dp_rank = first_step, dp, dp_rank

    def __iter__(self) -> Iterator[list[int]]:
        step = self.first_step
        while True:
            yield self.order.share(self.position.at(step), self.position.global_batch, self.dp, self.dp_rank)
            step += 1


_BOUND: weakref.WeakSet[ElasticData] = weakref.WeakSet()
"""The loaders a job bound (the one of the current generation, until the old one is collected)."""


def reported_position() -> int | None:
    """The samples the newest bound loader's job has consumed up to its next step (what a worker
    reports to its agent's metrics); None without one."""
    for data in sorted(_BOUND, key=lambda d: d.position.step, reverse=True):
        if data.step_now is not None:
            return data.position.at(data.step_now())
    return None


class ElasticData:
    """One data-parallel rank's exactly-once batches (see the module's docstring)."""

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        dp: int,
        dp_rank: int,
        seed: int = 0,
        num_workers: int = 2,
        prefetch_factor: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        first_step: int = 0,
    ):
        dp_share(global_batch, dp, dp_rank)  # a share this layout cannot have fails here, not mid-run
        self.dataset = dataset
        self.order = SampleOrder(len(dataset), seed)  # type: ignore[arg-type]
        self.dp, self.dp_rank = dp, dp_rank
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.collate_fn = collate_fn
        self.position = DataPosition(consumed=0, step=first_step, seed=seed, global_batch=global_batch)
        self.step_now: Callable[[], int] | None = None
        """The job's next step (the job binds it, :meth:`bind_step`): what :meth:`state_dict` counts to."""
        self._iterator: Iterator[Any] | None = None
        self._next_step: int | None = None
        self.num_loader_starts = 0
        self.last_start_s = 0.0
        """Seconds the last (re)start took: its first batch read in this process and the loader's
        worker processes started (not their first batch, which comes while that step trains)."""

    # ---- the job's side --------------------------------------------------------------------
    def bind_step(self, step_now: Callable[[], int]) -> None:
        """The job tells where it is (its next step); called by the job for every app state entry
        that has this method."""
        self.step_now = step_now
        _BOUND.add(self)

    def state_dict(self) -> dict[str, int]:
        """The position at the job's next step: what the completed steps consumed."""
        if self.step_now is not None:
            step = self.step_now()
        else:
            step = self._next_step if self._next_step is not None else self.position.step
        return {
            "consumed": self.position.at(step),
            "step": step,
            "seed": self.position.seed,
            "global_batch": self.position.global_batch,
            "num_samples": self.order.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The carried position; the loader (re)starts there on the next :meth:`batch`."""
        if state["num_samples"] != self.order.num_samples or state["seed"] != self.position.seed:
            raise ValueError(
                f"the carried data position is for {state['num_samples']} samples with seed {state['seed']}; "
                f"this dataset has {self.order.num_samples} samples and seed {self.position.seed}"
            )
        self.position = DataPosition(state["consumed"], state["step"], state["seed"], self.position.global_batch)
        self._close()

    # ---- the training loop's side ------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.position.global_batch

    @property
    def weight(self) -> float:
        """What this rank's mean loss is multiplied by (:func:`~etc_agent.data.order.share_weight`)."""
        return share_weight(self.global_batch, self.dp, self.dp_rank)

    def samples(self, step: int) -> list[int]:
        """The global sample indices of this rank's share of ``step``."""
        return self.order.share(self.position.at(step), self.global_batch, self.dp, self.dp_rank)

    def batch(self, step: int) -> Any:
        """This rank's share of ``step``'s global batch, collated (prefetched by the loader's workers).
        The first step after a (re)start, or a step other than the one after the last, is read here
        in this process while the loader's workers start on the steps after it: the switch does not
        wait for worker processes to come up."""
        if self._iterator is None or step != self._next_step:
            started = time.perf_counter()
            collate = self.collate_fn or default_collate
            inline = collate([self.dataset[i] for i in self.samples(step)])
            self._start(step + 1)
            self._next_step = step + 1
            self.last_start_s = time.perf_counter() - started
            return inline
        assert self._iterator is not None
        self._next_step = step + 1
        return next(self._iterator)

    def _start(self, step: int) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self._close()
        num_workers = self.num_workers
        if num_workers > 0 and multiprocessing.current_process().daemon:
            # A daemonic process (a multiprocessing pool's) may not start loader workers: read inline.
            log.warning("data loader workers off: this process is daemonic and may not have children")
            num_workers = self.num_workers = 0
        sampler = StepSampler(self.order, self.position, step, self.dp, self.dp_rank)
        loader = StatefulDataLoader(
            self.dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            prefetch_factor=self.prefetch_factor if num_workers > 0 else None,
            collate_fn=self.collate_fn,
        )
        self._iterator = iter(loader)
        self.num_loader_starts += 1

    def _close(self) -> None:
        """Drop the loader and its prefetched batches (its worker processes end)."""
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        self._close()

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - at interpreter exit the loader's modules may be gone
            pass


__all__ = ["ElasticData", "StepSampler"]
