"""The index space the planner's steps share: devices and nodes as integers, and shard overlaps.

:class:`Universe` numbers every device of the migration (new devices first, so that their ids index
the rows of the cost matrix) and records where each old rank's state lives; :class:`ShardOverlaps`
memoises how many elements each old shard shares with each new shard of a pair of geometries.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from etc_agent.layout.boxes import overlapping_pairs
from etc_agent.layout.devices import Device
from etc_agent.layout.shards import Geometry


class Universe:
    """Every device of the migration as an integer id, with its node and each old rank's device."""

    def __init__(
        self, new_devices: list[Device], old_devices: list[Device], old_assignment: list[Device], failed: set[Device]
    ) -> None:
        # New devices first (their ids index the cost matrix), then old-only ones.
        new_set = set(new_devices)
        self.devices: list[Device] = list(new_devices) + [d for d in old_devices if d not in new_set]
        self.dev_id = {d: i for i, d in enumerate(self.devices)}
        nodes = list(dict.fromkeys(d.node for d in self.devices))
        node_id = {n: i for i, n in enumerate(nodes)}
        self.node_of = np.array([node_id[d.node] for d in self.devices], dtype=np.int64)
        self.num_dev = len(new_devices)
        """New devices: ids ``0 .. num_dev - 1``."""
        self.num_new_nodes = len({d.node for d in new_devices})
        """Nodes of the new devices: node ids ``0 .. num_new_nodes - 1``."""
        self.old_rank_dev = np.array([self.dev_id[d] for d in old_assignment], dtype=np.int64)
        self.old_rank_alive = np.array([d not in failed for d in old_assignment], dtype=bool)

    def distance(self, src: int, dst: int) -> int:
        """0 on the same device, 1 within a node, 2 across nodes."""
        if src == dst:
            return 0
        return 1 if self.node_of[src] == self.node_of[dst] else 2


@dataclasses.dataclass(frozen=True)
class OverlapPairs:
    """The (old distinct shard, new distinct shard) pairs of two geometries that share elements, as
    columns ordered by ``(old, new)``: ``old[k]`` and ``new[k]`` share ``numel[k] > 0`` elements."""

    old: np.ndarray
    new: np.ndarray
    numel: np.ndarray
    num_old: int
    num_new: int

    def dense(self) -> np.ndarray:
        """``out[i, j]``: elements old shard ``i`` shares with new shard ``j`` (small geometries only)."""
        out = np.zeros((self.num_old, self.num_new), dtype=np.int64)
        out[self.old, self.new] = self.numel
        return out

    @functools.cached_property
    def old_of_new(self) -> list[frozenset[int]]:
        """For each new shard, the old shards it shares elements with."""
        by_new: list[set[int]] = [set() for _ in range(self.num_new)]
        for i, j in zip(self.old.tolist(), self.new.tolist()):
            by_new[j].add(i)
        return [frozenset(s) for s in by_new]


class ShardOverlaps:
    """Elements shared by every (old distinct shard, new distinct shard) pair, per pair of geometries."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], OverlapPairs] = {}
        self._dense: dict[tuple[str, str], np.ndarray] = {}

    def pairs(self, a: Geometry, b: Geometry) -> OverlapPairs:
        """The overlapping (old, new) shard pairs of ``a`` and ``b``: near-linear in the pieces and the
        pairs (:func:`etc_agent.layout.boxes.overlapping_pairs`)."""
        key = (a.fingerprint, b.fingerprint)
        if key not in self._pairs:
            pi, pj, volume = overlapping_pairs(a.piece_off, a.piece_len, b.piece_off, b.piece_len)
            si, sj = a.piece_shard[pi], b.piece_shard[pj]
            combined = si * b.num_shards + sj
            unique, inverse = np.unique(combined, return_inverse=True)
            numel = np.bincount(inverse, weights=volume, minlength=len(unique)).astype(np.int64)
            self._pairs[key] = OverlapPairs(
                unique // max(1, b.num_shards), unique % max(1, b.num_shards), numel, a.num_shards, b.num_shards
            )
        return self._pairs[key]

    def between(self, a: Geometry, b: Geometry) -> np.ndarray:
        """``out[i, j]``: elements old shard ``i`` of ``a`` shares with new shard ``j`` of ``b`` (dense:
        for the planner's exact placement on small layouts)."""
        key = (a.fingerprint, b.fingerprint)
        if key not in self._dense:
            self._dense[key] = self.pairs(a, b).dense()
        return self._dense[key]
