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
from dataclasses import dataclass, field

import numpy as np

from etc_agent.layout.boxes import overlapping_pairs
from etc_agent.layout.devices import Device
from etc_agent.layout.shards import StateLayout
from etc_agent.planner.plan import MigrationPlan, Region


class PlanValidationError(ValueError):
    """The plan would not produce exactly the new layout's state."""


def validate_plan(plan: MigrationPlan, old: StateLayout, new: StateLayout) -> None:
    """Raise :class:`PlanValidationError` unless ``plan`` turns ``old`` into exactly ``new``.

    The per-region checks run on arrays (every region of the plan as one row, boxes padded to the
    largest rank), so the cost grows with the regions, not with regions x pieces in Python."""
    validator = _Validator(plan, old, new)
    validator.check_dtypes()
    validator.check_messages()
    validator.check_regions()


@dataclass
class _Rows:
    """Every region of the plan as one row: what it is part of, where it comes from and goes to."""

    group: list[int] = field(default_factory=list)
    offsets: list[tuple[int, ...]] = field(default_factory=list)
    lengths: list[tuple[int, ...]] = field(default_factory=list)
    source: list[int] = field(default_factory=list)
    """The old rank that must hold it (-1: read from the checkpoint)."""
    target: list[int] = field(default_factory=list)
    """The new rank whose shard it fills (-1: its device has no new rank)."""
    action: list[int] = field(default_factory=list)
    """Index into :attr:`_Validator.actions` (what to name in an error)."""


class _Validator:
    """The checks of one plan; the regions are checked together (:meth:`check_regions`)."""

    def __init__(self, plan: MigrationPlan, old: StateLayout, new: StateLayout) -> None:
        self.plan, self.old, self.new = plan, old, new
        self.old_rank_of = {d: r for r, d in enumerate(plan.old_assignment)}
        self.new_rank_of = {d: r for r, d in enumerate(plan.assignment)}
        self.failed = set(plan.failed)
        self.actions: list[tuple[str, Device]] = []
        """(what, device) of each local copy, transfer and restore, for error messages."""

    def _name(self, region: Region) -> str:
        g = self.plan.groups[region.group]
        return f"{g.keys[0]}{f' (+{len(g.keys) - 1} keys)' if len(g.keys) > 1 else ''} region offsets={region.offsets} lengths={region.lengths}"

    def _num_bytes(self, regions: tuple[Region, ...]) -> int:
        return sum(r.numel * self.plan.groups[r.group].bytes_per_element for r in regions)

    def check_dtypes(self) -> None:
        old, new = self.old, self.new
        for g in self.plan.groups:
            for key, dtype in zip(g.keys, g.dtypes):
                if (g.old_placement >= 0 and old.key_dtype[key] != dtype) or new.key_dtype[key] != dtype:
                    raise PlanValidationError(
                        f"{key}: dtype differs between layouts ({old.key_dtype[key]} -> {new.key_dtype[key]})"
                    )

    def check_messages(self) -> None:
        """Byte counts, failed senders, one message per (src, dst) and round, the per-round caps."""
        for copy in self.plan.local_copies:
            if copy.num_bytes != self._num_bytes(copy.regions):
                raise PlanValidationError(f"local copy on {copy.device}: byte count does not match its regions")
        for restore in self.plan.restores:
            if restore.num_bytes != self._num_bytes(restore.regions):
                raise PlanValidationError(f"restore on {restore.device}: byte count does not match its regions")
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

    def _rows(self) -> _Rows:
        rows = _Rows()

        def add(regions: tuple[Region, ...], source: int, target: int) -> None:
            index = len(self.actions) - 1
            for region in regions:
                rows.group.append(region.group)
                rows.offsets.append(region.offsets)
                rows.lengths.append(region.lengths)
                rows.source.append(source)
                rows.target.append(target)
                rows.action.append(index)

        for copy in self.plan.local_copies:
            self.actions.append(("local copy: device", copy.device))
            add(copy.regions, self.old_rank_of.get(copy.device, -2), self.new_rank_of.get(copy.device, -1))
        for t in self.plan.transfers:
            self.actions.append(("sender", t.src))
            add(t.regions, self.old_rank_of.get(t.src, -2), self.new_rank_of.get(t.dst, -1))
        for restore in self.plan.restores:
            self.actions.append(("restore on", restore.device))
            add(restore.regions, -1, self.new_rank_of.get(restore.device, -1))
        return rows

    def check_regions(self) -> None:
        """Every region inside its tensor and held by its source (the old rank of its sender, or of
        the device copying it); each new rank's regions inside its shards, pairwise disjoint, and
        as many elements as its shards have: every element covered exactly once."""
        rows = self._rows()
        groups = self.plan.groups
        ndim = max([len(g.global_shape) for g in groups] + [1])
        group = np.array(rows.group, dtype=np.int64)
        off = _padded(rows.offsets, ndim, 0)
        length = _padded(rows.lengths, ndim, 1)
        source, target = np.array(rows.source, dtype=np.int64), np.array(rows.target, dtype=np.int64)
        shape = _padded([g.global_shape for g in groups], ndim, 1)
        if len(group):
            outside = ((off < 0) | (off + length > shape[group])).any(axis=1)
            if outside.any():
                k = int(np.flatnonzero(outside)[0])
                raise PlanValidationError(
                    f"{self._region_name(rows, k)}: outside the tensor's shape {groups[rows.group[k]].global_shape}"
                )
        old_placement = np.array([g.old_placement for g in groups], dtype=np.int64)
        new_placement = np.array([g.new_placement for g in groups], dtype=np.int64)
        sent = np.flatnonzero(source != -1)
        if len(sent):
            no_key = old_placement[group[sent]] < 0
            if no_key.any():
                k = int(sent[np.flatnonzero(no_key)[0]])
                what, device = self.actions[rows.action[k]]
                raise PlanValidationError(
                    f"{self._region_name(rows, k)}: {what} {device} cannot hold it (no old rank has the key)"
                )
            held = _contained(self.old, old_placement[group[sent]], source[sent], off[sent], length[sent], ndim)
            if not held.all():
                k = int(sent[np.flatnonzero(~held)[0]])
                what, device = self.actions[rows.action[k]]
                raise PlanValidationError(f"{self._region_name(rows, k)}: {what} {device} does not hold it")
        self._check_cover(rows, group, off, length, target, new_placement, ndim)

    def _check_cover(
        self,
        rows: _Rows,
        group: np.ndarray,
        off: np.ndarray,
        length: np.ndarray,
        target: np.ndarray,
        new_placement: np.ndarray,
        ndim: int,
    ) -> None:
        plan, groups = self.plan, self.plan.groups
        inside = _contained(self.new, new_placement[group], target, off, length, ndim) & (target >= 0)
        if not inside.all():
            k = int(np.flatnonzero(~inside)[0])
            g = groups[rows.group[k]]
            if target[k] < 0 or not self.new.placements[g.new_placement].shards_held_by(int(target[k])):
                _, device = self.actions[rows.action[k]]
                device = plan.assignment[int(target[k])] if target[k] >= 0 else device
                raise PlanValidationError(f"{g.keys[0]}: regions sent to {device}, which does not need them")
            raise PlanValidationError(f"{self._cover_name(rows, k, target)}: region outside the shard")
        # Regions of one (group, new rank) pairwise disjoint: a leading coordinate, the owner, keeps
        # the regions of different owners apart.
        num_ranks = max(1, len(plan.assignment))
        owner = (group * num_ranks + target)[:, None]
        boxes_off = np.concatenate([owner, off], axis=1)
        boxes_len = np.concatenate([np.ones_like(owner), length], axis=1)
        i, j, _ = overlapping_pairs(boxes_off, boxes_len, boxes_off, boxes_len)
        twice = np.flatnonzero(i != j)
        if len(twice):
            k, other = int(i[twice[0]]), int(j[twice[0]])
            raise PlanValidationError(
                f"{self._cover_name(rows, k, target)}: covered twice (also by {(rows.offsets[other], rows.lengths[other])})"
            )
        # As many elements as the shards: with the two checks above, every element exactly once.
        got_key, got_inverse = np.unique(owner.ravel(), return_inverse=True)
        got = np.bincount(got_inverse, weights=length.prod(axis=1), minlength=len(got_key)).astype(np.int64)
        need_keys, need_vals = [], []
        for gi, g in enumerate(groups):
            pn = self.new.placements[g.new_placement]
            need_keys.append(gi * num_ranks + pn.entry_rank)
            need_vals.append(pn.geometry.shard_numel[pn.entry_shard])
        need_key, need_inverse = np.unique(np.concatenate(need_keys), return_inverse=True)
        need = np.bincount(need_inverse, weights=np.concatenate(need_vals), minlength=len(need_key)).astype(np.int64)
        have = np.zeros(len(need_key), dtype=np.int64)
        index = np.searchsorted(got_key, need_key)
        found = index < len(got_key)
        found[found] = got_key[index[found]] == need_key[found]
        have[found] = got[index[found]]
        short = np.flatnonzero(have != need)
        if len(short):
            k = int(short[0])
            gi, rank = divmod(int(need_key[k]), num_ranks)
            raise PlanValidationError(
                f"{groups[gi].keys[0]} on {plan.assignment[rank]} (new rank {rank}): {need[k] - have[k]} of "
                f"{need[k]} elements not covered"
            )

    def _region_name(self, rows: _Rows, k: int) -> str:
        return self._name(Region(rows.group[k], rows.offsets[k], rows.lengths[k]))

    def _cover_name(self, rows: _Rows, k: int, target: np.ndarray) -> str:
        g = self.plan.groups[rows.group[k]]
        rank = int(target[k])
        return f"{g.keys[0]} on {self.plan.assignment[rank]} (new rank {rank}) {(rows.offsets[k], rows.lengths[k])}"


def _padded(boxes: list[tuple[int, ...]], ndim: int, fill: int) -> np.ndarray:
    """Tuples of up to ``ndim`` ints as rows, padded with ``fill``."""
    widths = {len(b) for b in boxes}
    if len(widths) == 1:
        (width,) = widths
        rows = np.array(boxes, dtype=np.int64).reshape(len(boxes), width)
        return np.pad(rows, ((0, 0), (0, ndim - width)), constant_values=fill)
    out = np.full((len(boxes), ndim), fill, dtype=np.int64)
    for width in widths:
        which = [k for k, b in enumerate(boxes) if len(b) == width]
        if width:
            out[which, :width] = np.array([boxes[k] for k in which], dtype=np.int64)
    return out


def _contained(
    layout: StateLayout, placement: np.ndarray, rank: np.ndarray, off: np.ndarray, length: np.ndarray, ndim: int
) -> np.ndarray:
    """Whether each box lies inside one piece of a shard ``rank`` holds in ``placement`` (-1: none)."""
    result = np.zeros(len(placement), dtype=bool)
    for p in np.unique(placement[placement >= 0]).tolist():
        rows = np.flatnonzero((placement == p) & (rank >= 0))
        if not len(rows):
            continue
        pl = layout.placements[p]
        geo = pl.geometry
        # The pieces each rank holds: entries (rank, shard) joined with the pieces of each shard.
        piece_order = np.argsort(geo.piece_shard, kind="stable")
        sorted_shard = geo.piece_shard[piece_order]
        lo = np.searchsorted(sorted_shard, pl.entry_shard, side="left")
        counts = np.searchsorted(sorted_shard, pl.entry_shard, side="right") - lo
        held_rank = np.repeat(pl.entry_rank, counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        held_piece = piece_order[np.repeat(lo, counts) + within]
        # Each box against the pieces of its rank.
        order = np.argsort(held_rank, kind="stable")
        by_rank = held_rank[order]
        first = np.searchsorted(by_rank, rank[rows], side="left")
        num = np.searchsorted(by_rank, rank[rows], side="right") - first
        box = np.repeat(rows, num)
        k = np.arange(num.sum()) - np.repeat(np.cumsum(num) - num, num)
        piece = held_piece[order[np.repeat(first, num) + k]]
        width = geo.piece_off.shape[1]
        p_off = np.zeros((len(piece), ndim), dtype=np.int64)
        p_end = np.ones((len(piece), ndim), dtype=np.int64)
        p_off[:, :width] = geo.piece_off[piece]
        p_end[:, :width] = geo.piece_off[piece] + geo.piece_len[piece]
        inside = ((p_off <= off[box]) & (off[box] + length[box] <= p_end)).all(axis=1)
        hit = np.zeros(len(placement), dtype=bool)
        np.logical_or.at(hit, box[inside], True)
        result |= hit
    return result
