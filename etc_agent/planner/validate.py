"""Independent check of a ``MigrationPlan`` against the two layouts, run before anything moves.

It does not trust the router: it recomputes, from the layouts alone, what each device must end up
holding and what each source holds, and checks that

- every element of every new shard is covered exactly once (regions inside the shard's pieces,
  pairwise disjoint, volumes summing to the shard's size), by a local copy, one transfer or a
  restore from the checkpoint;
- every region is sent by a live device that holds it (or copied by the device that holds it);
- dtypes agree across the layouts, boxes lie inside the tensor, byte counts match the regions;
- per round, no device sends or receives more than the memory cap or the message limit, and each
  (src, dst) pair has at most one message.

Violations raise ``PlanValidationError`` naming the key and region.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from math import prod

import numpy as np

from etc_agent.layout.boxes import Box, box_contains, overlap_volumes
from etc_agent.layout.devices import Device
from etc_agent.layout.shards import StateLayout
from etc_agent.planner.plan import MigrationPlan, Region


class PlanValidationError(ValueError):
    """The plan would not produce exactly the new layout's state."""


def validate_plan(plan: MigrationPlan, old: StateLayout, new: StateLayout) -> None:
    """Raise :class:`PlanValidationError` unless ``plan`` turns ``old`` into exactly ``new``."""
    validator = _Validator(plan, old, new)
    validator.check_dtypes()
    validator.check_local_copies()
    validator.check_restores()
    validator.check_transfers()
    validator.check_coverage()


class _Validator:
    """The checks of one plan, in order; collects what each device receives for the coverage check."""

    def __init__(self, plan: MigrationPlan, old: StateLayout, new: StateLayout) -> None:
        self.plan, self.old, self.new = plan, old, new
        self.old_rank_of = {d: r for r, d in enumerate(plan.old_assignment)}
        self.failed = set(plan.failed)
        self.held_cache: dict[tuple[str, int, int], list[Box]] = {}
        self.incoming: dict[tuple[int, Device], list[Box]] = defaultdict(list)
        """(group, device) -> boxes it receives, by local copy, transfer or restore."""

    def _pieces(self, layout: StateLayout, tag: str, placement: int, rank: int) -> list[Box]:
        key = (tag, placement, rank)
        if key not in self.held_cache:
            p = layout.placements[placement]
            self.held_cache[key] = [box for s in p.shards_held_by(rank) for box in p.geometry.pieces_of(s)]
        return self.held_cache[key]

    def _name(self, region: Region) -> str:
        g = self.plan.groups[region.group]
        return f"{g.keys[0]}{f' (+{len(g.keys) - 1} keys)' if len(g.keys) > 1 else ''} region offsets={region.offsets} lengths={region.lengths}"

    def _num_bytes(self, regions: tuple[Region, ...]) -> int:
        return sum(r.numel * self.plan.groups[r.group].bytes_per_element for r in regions)

    def _check_bounds(self, region: Region) -> None:
        g = self.plan.groups[region.group]
        if any(o < 0 or o + n > s for o, n, s in zip(region.offsets, region.lengths, g.global_shape)):
            raise PlanValidationError(f"{self._name(region)}: outside the tensor's shape {g.global_shape}")

    def _check_source(self, region: Region, device: Device, what: str) -> None:
        g = self.plan.groups[region.group]
        self._check_bounds(region)
        if g.old_placement < 0:
            raise PlanValidationError(f"{self._name(region)}: {what} {device} cannot hold it (no old rank has the key)")
        rank = self.old_rank_of.get(device)
        box = (region.offsets, region.lengths)
        if rank is None or not any(box_contains(p, box) for p in self._pieces(self.old, "old", g.old_placement, rank)):
            raise PlanValidationError(f"{self._name(region)}: {what} {device} does not hold it")

    def check_dtypes(self) -> None:
        old, new = self.old, self.new
        for g in self.plan.groups:
            for key, dtype in zip(g.keys, g.dtypes):
                if (g.old_placement >= 0 and old.key_dtype[key] != dtype) or new.key_dtype[key] != dtype:
                    raise PlanValidationError(
                        f"{key}: dtype differs between layouts ({old.key_dtype[key]} -> {new.key_dtype[key]})"
                    )

    def check_local_copies(self) -> None:
        for copy in self.plan.local_copies:
            if copy.num_bytes != self._num_bytes(copy.regions):
                raise PlanValidationError(f"local copy on {copy.device}: byte count does not match its regions")
            for region in copy.regions:
                self._check_source(region, copy.device, "local copy: device")
                self.incoming[(region.group, copy.device)].append((region.offsets, region.lengths))

    def check_restores(self) -> None:
        for restore in self.plan.restores:
            if restore.num_bytes != self._num_bytes(restore.regions):
                raise PlanValidationError(f"restore on {restore.device}: byte count does not match its regions")
            for region in restore.regions:
                self._check_bounds(region)
                self.incoming[(region.group, restore.device)].append((region.offsets, region.lengths))

    def check_transfers(self) -> None:
        per_round: dict[tuple[int, Device, str], list[int]] = defaultdict(lambda: [0, 0])
        pairs: set[tuple[int, Device, Device]] = set()
        for t in self.plan.transfers:
            if t.src in self.failed:
                raise PlanValidationError(f"transfer {t.src} -> {t.dst} in round {t.round}: source failed")
            if (t.round, t.src, t.dst) in pairs:
                raise PlanValidationError(f"two messages {t.src} -> {t.dst} in round {t.round}")
            pairs.add((t.round, t.src, t.dst))
            if t.num_bytes != self._num_bytes(t.regions):
                raise PlanValidationError(
                    f"transfer {t.src} -> {t.dst} in round {t.round}: byte count does not match its regions"
                )
            for end, dev in (("send", t.src), ("recv", t.dst)):
                self._count_in_round(per_round[(t.round, dev, end)], t.num_bytes, dev, end, t.round)
            for region in t.regions:
                self._check_source(region, t.src, "sender")
                self.incoming[(region.group, t.dst)].append((region.offsets, region.lengths))

    def _count_in_round(self, slot: list[int], num_bytes: int, dev: Device, end: str, rnd: int) -> None:
        """Count one more message of ``num_bytes`` in ``slot``: ``dev``'s (bytes, messages) at ``end`` in round ``rnd``."""
        cap, limit = self.plan.mem_cap_bytes, self.plan.max_messages_per_round
        slot[0] += num_bytes
        slot[1] += 1
        if slot[0] > cap:
            raise PlanValidationError(f"{dev} would {end} {slot[0]} bytes in round {rnd}, above the cap of {cap}")
        if slot[1] > limit:
            raise PlanValidationError(
                f"{dev} would {end} {slot[1]} messages in round {rnd}, above the limit of {limit}"
            )

    def check_coverage(self) -> None:
        plan, incoming = self.plan, self.incoming
        for gi, g in enumerate(plan.groups):
            pn = self.new.placements[g.new_placement]
            for rank in np.unique(pn.entry_rank).tolist():
                device = plan.assignment[rank]
                need = self._pieces(self.new, "new", g.new_placement, rank)
                got = incoming.pop((gi, device), [])
                _check_cover(need, got, lambda box: f"{g.keys[0]} on {device} (new rank {rank}) {box}")  # noqa: B023 - called at once
        for (gi, device), boxes in incoming.items():
            raise PlanValidationError(
                f"{plan.groups[gi].keys[0]}: {len(boxes)} regions sent to {device}, which does not need them"
            )


def _check_cover(need: list[Box], got: list[Box], where: Callable[[object], str]) -> None:
    need_volume = sum(prod(n[1]) for n in need)
    if len(need) == len(got) and sorted(need) == sorted(got):
        return
    for box in got:
        if not any(box_contains(n, box) for n in need):
            raise PlanValidationError(f"{where(box)}: region outside the shard")
    got_volume = sum(prod(b[1]) for b in got)
    if len(got) > 1:
        off = np.array([b[0] for b in got], dtype=np.int64)
        ln = np.array([b[1] for b in got], dtype=np.int64)
        ov = overlap_volumes(off, ln, off, ln)
        np.fill_diagonal(ov, 0)
        if ov.any():
            i, j = np.argwhere(ov)[0]
            raise PlanValidationError(f"{where(got[i])}: covered twice (also by {got[j]})")
    if got_volume != need_volume:
        raise PlanValidationError(
            f"{where(need[0] if need else ())}: {need_volume - got_volume} of {need_volume} elements not covered"
        )
