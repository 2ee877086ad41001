"""Step 2 of the planner at scale: the bytes of each new rank's shards already on each new device,
without a devices x ranks matrix.

The residency of device ``d`` for new rank ``r`` is the sum of two parts:

- **class blocks**: key groups whose shards have many holders and many needers (data-parallel
  copies; :data:`SPARSE_PER_ENTRY`). Ranks that hold the same shards of all these groups form an old class,
  ranks that need the same shards a new class; the residency is then a function of the two classes
  (``block_bytes[(old class, new class)]``), one entry per pair of classes that share data however
  many devices and ranks they hold.
- **sparse pairs**: the other key groups (ZeRO ranges, unreplicated shards), where each shard has
  few holders and few needers, as explicit ``(device, rank, bytes)`` entries.

Both come from the sparse shard overlaps (:class:`ShardOverlaps.pairs`) by joins of sorted arrays, so
the work grows with the data held and the pairs that share it, not with devices x ranks. The exact
placement (``cost.py``) builds the dense matrices instead; both say the same residency.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from etc_agent.layout.shards import Placement, StateLayout
from etc_agent.planner.plan import KeyGroup
from etc_agent.planner.universe import OverlapPairs, ShardOverlaps, Universe

SPARSE_PER_ENTRY = 16
"""A key group goes into the class blocks when its explicit (device, rank) pairs would outnumber its
entries (rank x shard, both layouts) this many times: data-parallel copies, whose every holder
meets every needer."""


@dataclasses.dataclass(frozen=True)
class Residency:
    """What each new device already holds of each new rank's shards, as class blocks + sparse pairs."""

    need: np.ndarray
    """Bytes of each new rank's shards."""
    dev_class: np.ndarray
    """Per new device, the old class of the live old rank on it (-1: it holds nothing)."""
    rank_class: np.ndarray
    """Per new rank, its new class."""
    num_rank_classes: int
    block_key: np.ndarray
    """Sorted ``old class * num_rank_classes + new class`` of the class blocks that share bytes."""
    block_bytes: np.ndarray
    pair_key: np.ndarray
    """Sorted ``device * num_ranks + rank`` of the sparse pairs."""
    pair_bytes: np.ndarray
    num_dev: int
    num_ranks: int

    def resident(self, dev: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Bytes of rank ``rank[k]``'s shards on device ``dev[k]`` (vectorised)."""
        dev, rank = np.asarray(dev, dtype=np.int64), np.asarray(rank, dtype=np.int64)
        pairs = _lookup(self.pair_key, self.pair_bytes, dev * self.num_ranks + rank)
        return np.asarray(self.block_resident(self.dev_class[dev], self.rank_class[rank]) + pairs, dtype=np.int64)

    def block_resident(self, dev_class: np.ndarray, rank_class: np.ndarray) -> np.ndarray:
        """The class blocks' part of the residency, by old and new class (old class -1: nothing)."""
        out = _lookup(self.block_key, self.block_bytes, dev_class * self.num_rank_classes + rank_class)
        out[dev_class < 0] = 0
        return out

    def candidates(
        self, per_block: int = 9, devices: np.ndarray | None = None, ranks: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(device, rank)`` pairs worth considering, each once: every sparse pair, and for each
        class block ``per_block`` devices of the old class per rank of the new class: the rank at
        position ``p`` of its class meets the devices at and around position ``p * n_old // n_new``
        of theirs (all ranks of a class are interchangeable for the block, so a
        placement that keeps each rank on such a device is among the candidates). ``devices`` and
        ``ranks`` (masks) narrow the class edges to those devices and ranks, and leave out the pairs."""
        restricted = devices is not None or ranks is not None
        devs = [self.pair_key[:0] if restricted else self.pair_key // self.num_ranks]
        rank_list = [self.pair_key[:0] if restricted else self.pair_key % self.num_ranks]
        if len(self.block_key):
            dev_class = self.dev_class if devices is None else np.where(devices, self.dev_class, -1)
            rank_class = self.rank_class if ranks is None else np.where(ranks, self.rank_class, -1)
            old_members = _members(dev_class, int(self.dev_class.max()) + 1)
            new_members = _members(rank_class, self.num_rank_classes)
            old_cls, new_cls = self.block_key // self.num_rank_classes, self.block_key % self.num_rank_classes
            n_old = old_members.count[old_cls]
            n_new = np.where(n_old > 0, new_members.count[new_cls], 0)
            per_rank = np.minimum(n_old, per_block)
            # One row per (block, rank of the new class): its position in the class.
            block_of_row = np.repeat(np.arange(len(old_cls)), n_new)
            position = np.arange(len(block_of_row)) - np.repeat(np.cumsum(n_new) - n_new, n_new)
            rank = new_members.members[new_members.start[new_cls[block_of_row]] + position]
            # Then ``per_rank`` devices for each row.
            k = per_rank[block_of_row]
            row = np.repeat(np.arange(len(block_of_row)), k)
            t = np.arange(len(row)) - np.repeat(np.cumsum(k) - k, k)
            b = block_of_row[row]
            # 0, +1, -1, +2, -2, ...: the aligned device and its neighbours, which a chain of ranks
            # shifting by one (ZeRO ranges re-cut after a leave) needs.
            offset = (t + 1) // 2 * np.where(t % 2 == 1, 1, -1)
            slot = (position[row] * n_old[b] // np.maximum(1, n_new[b]) + offset) % n_old[b]
            devs.append(old_members.members[old_members.start[old_cls[b]] + slot])
            rank_list.append(rank[row])
        dev, rank = np.concatenate(devs), np.concatenate(rank_list)
        unique = np.unique(dev * self.num_ranks + rank)
        return unique // self.num_ranks, unique % self.num_ranks

    def best_block_bytes(self) -> np.ndarray:
        """Per new rank, the most bytes any one class block gives it."""
        best = np.zeros(self.num_rank_classes, dtype=np.int64)
        np.maximum.at(best, self.block_key % max(1, self.num_rank_classes), self.block_bytes)
        return np.asarray(best[self.rank_class], dtype=np.int64)

    def best_bytes_bound(self) -> int:
        """No placement keeps more bytes in place than this (TP groups and nodes set aside): the class
        blocks as a transportation problem (each old class has as many devices as it has, each new
        class as many ranks), plus each rank's best sparse pair on top."""
        kept = 0
        if len(self.block_key):
            kept += self._block_transport()
        if len(self.pair_key):
            best_pair = np.zeros(self.num_ranks, dtype=np.int64)
            np.maximum.at(best_pair, self.pair_key % self.num_ranks, self.pair_bytes)
            kept += int(best_pair.sum())
        return min(kept, int(self.need.sum()))

    def _block_transport(self) -> int:
        """The most the class blocks can keep: each class alone takes the best blocks first, as many
        members from each as the other class has (both ways; the smaller sum). Where each new class
        shares its large blocks with one old class, as after a leave or a join, this is the optimum
        of the transportation problem the classes make."""
        num_old = int(self.dev_class.max()) + 1
        old_cls, new_cls = self.block_key // self.num_rank_classes, self.block_key % self.num_rank_classes
        n_old = np.bincount(self.dev_class[self.dev_class >= 0], minlength=num_old)
        n_new = np.bincount(self.rank_class, minlength=self.num_rank_classes)
        bounds = []
        for mine, theirs, n_mine, n_theirs in ((new_cls, old_cls, n_new, n_old), (old_cls, new_cls, n_old, n_new)):
            total = 0
            left = n_mine.copy()
            for k in np.lexsort((-self.block_bytes, mine)).tolist():
                take = min(int(left[mine[k]]), int(n_theirs[theirs[k]]))
                left[mine[k]] -= take
                total += take * int(self.block_bytes[k])
            bounds.append(total)
        return min(bounds)


@dataclasses.dataclass(frozen=True)
class _Members:
    """The members of each class in CSR form (sorted by class, then index)."""

    members: np.ndarray
    start: np.ndarray
    count: np.ndarray


def _members(class_of: np.ndarray, num: int) -> _Members:
    valid = np.flatnonzero(class_of >= 0)
    order = valid[np.argsort(class_of[valid], kind="stable")]
    count = np.bincount(class_of[valid], minlength=num).astype(np.int64)
    return _Members(order.astype(np.int64), np.cumsum(count) - count, count)


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    out = np.zeros(len(query), dtype=np.int64)
    if not len(keys):
        return out
    index = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    hit = keys[index] == query
    out[hit] = values[index[hit]]
    return out


def _join(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs ``(a, b)`` with ``left[a] == right[b]``, every match once."""
    order = np.argsort(right, kind="stable")
    ordered = right[order]
    lo = np.searchsorted(ordered, left, side="left")
    counts = np.searchsorted(ordered, left, side="right") - lo
    a = np.repeat(np.arange(len(left), dtype=np.int64), counts)
    within = np.arange(len(a), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return a, order[np.repeat(lo, counts) + within]


def _mix(salt: int, values: np.ndarray) -> np.ndarray:
    """A 64-bit hash of ``(salt, value)`` per value (splitmix64); sums of them name sets."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _classes(num: int, memberships: list[tuple[np.ndarray, np.ndarray, int]]) -> np.ndarray:
    """Class of each of ``num`` ranks: ranks with the same ``(placement, shard)`` memberships share one."""
    signature = np.zeros(num, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for ranks, shards, salt in memberships:
            np.add.at(signature, ranks, _mix(salt, shards))
    return np.unique(signature, return_inverse=True)[1].astype(np.int64)


def residency(
    old: StateLayout, new: StateLayout, groups: list[KeyGroup], universe: Universe, overlaps: ShardOverlaps
) -> Residency:
    """The :class:`Residency` of ``new``'s ranks on the universe's new devices."""
    num_dev, num_ranks = universe.num_dev, new.num_ranks
    # Which old entries count: a live old rank on a new device.
    old_dev = universe.old_rank_dev
    on_new = (old_dev < num_dev) & universe.old_rank_alive
    need, replicated, sparse = _split_groups(old, new, groups, overlaps)
    old_memberships = {
        g.old_placement: _live_entries(old.placements[g.old_placement], on_new, g.old_placement) for g in replicated
    }
    new_memberships = {
        g.new_placement: (pn.entry_rank, pn.entry_shard, g.new_placement)
        for g in replicated
        for pn in [new.placements[g.new_placement]]
    }
    old_class = _classes(old.num_ranks, list(old_memberships.values()))
    old_class[~on_new] = -1
    rank_class = _classes(num_ranks, list(new_memberships.values()))
    num_rank_classes = int(rank_class.max()) + 1 if num_ranks else 0
    dev_class = np.full(num_dev, -1, dtype=np.int64)
    dev_class[old_dev[on_new]] = old_class[on_new]
    block_keys, block_vals = [], []
    for g in replicated:
        po, pn = old.placements[g.old_placement], new.placements[g.new_placement]
        ranks, shards, _ = old_memberships[g.old_placement]
        old_pairs = np.unique(old_class[ranks] * po.geometry.num_shards + shards)
        new_pairs = np.unique(rank_class[pn.entry_rank] * pn.geometry.num_shards + pn.entry_shard)
        pairs = overlaps.pairs(po.geometry, pn.geometry)
        keys, vals = _join_through(old_pairs, po.geometry.num_shards, new_pairs, pn.geometry.num_shards, pairs)
        block_keys.append(keys[0] * num_rank_classes + keys[1])
        block_vals.append(vals * g.bytes_per_element)
    pair_keys, pair_vals = [], []
    for g in sparse:
        po, pn = old.placements[g.old_placement], new.placements[g.new_placement]
        live = on_new[po.entry_rank]
        old_entries = old_dev[po.entry_rank[live]] * po.geometry.num_shards + po.entry_shard[live]
        new_entries = pn.entry_rank * pn.geometry.num_shards + pn.entry_shard
        pairs = overlaps.pairs(po.geometry, pn.geometry)
        keys, vals = _join_through(old_entries, po.geometry.num_shards, new_entries, pn.geometry.num_shards, pairs)
        pair_keys.append(keys[0] * num_ranks + keys[1])
        pair_vals.append(vals * g.bytes_per_element)
    block_key, block_bytes = _sum_by_key(block_keys, block_vals)
    pair_key, pair_bytes = _sum_by_key(pair_keys, pair_vals)
    return Residency(
        need, dev_class, rank_class, num_rank_classes, block_key, block_bytes, pair_key, pair_bytes, num_dev, num_ranks
    )


def _split_groups(
    old: StateLayout, new: StateLayout, groups: list[KeyGroup], overlaps: ShardOverlaps
) -> tuple[np.ndarray, list[KeyGroup], list[KeyGroup]]:
    """The bytes each new rank needs, and the key groups held somewhere split into class blocks
    (data-parallel copies, :data:`SPARSE_PER_ENTRY`) and sparse pairs."""
    need = np.zeros(new.num_ranks, dtype=np.int64)
    replicated: list[KeyGroup] = []
    sparse: list[KeyGroup] = []
    for g in groups:
        pn = new.placements[g.new_placement]
        np.add.at(need, pn.entry_rank, pn.geometry.shard_numel[pn.entry_shard] * g.bytes_per_element)
        if g.old_placement < 0:
            continue
        po = old.placements[g.old_placement]
        pairs = overlaps.pairs(po.geometry, pn.geometry)
        holders = np.bincount(po.entry_shard, minlength=po.geometry.num_shards)
        needers = np.bincount(pn.entry_shard, minlength=pn.geometry.num_shards)
        num_triples = int((holders[pairs.old] * needers[pairs.new]).sum())
        many = num_triples > SPARSE_PER_ENTRY * (len(po.entry_rank) + len(pn.entry_rank))
        (replicated if many else sparse).append(g)
    return need, replicated, sparse


def _live_entries(placement: Placement, on_new: np.ndarray, salt: int) -> tuple[np.ndarray, np.ndarray, int]:
    live = on_new[placement.entry_rank]
    return placement.entry_rank[live], placement.entry_shard[live], salt


def _join_through(
    old_entries: np.ndarray, num_old_shards: int, new_entries: np.ndarray, num_new_shards: int, pairs: OverlapPairs
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """``(owner, shard)`` entries on each side (encoded ``owner * num_shards + shard``) joined through
    the shard overlaps: ``((old owner, new owner), elements)`` per matching triple."""
    old_owner, old_shard = old_entries // max(1, num_old_shards), old_entries % max(1, num_old_shards)
    new_owner, new_shard = new_entries // max(1, num_new_shards), new_entries % max(1, num_new_shards)
    a, k = _join(old_shard, pairs.old)
    c, b = _join(pairs.new[k], new_shard)
    return (old_owner[a[c]], new_owner[b]), pairs.numel[k[c]]


def _sum_by_key(keys: list[np.ndarray], vals: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if not keys:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    key, val = np.concatenate(keys), np.concatenate(vals)
    unique, inverse = np.unique(key, return_inverse=True)
    total = np.zeros(len(unique), dtype=np.int64)
    np.add.at(total, inverse, val)
    return unique, total
