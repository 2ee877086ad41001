"""The index space the planner's steps share: devices and nodes as integers, and shard overlaps.

:class:`Universe` numbers every device of the migration (new devices first, so that their ids index
the rows of the cost matrix) and records where each old rank's state lives; :class:`ShardOverlaps`
memoises how many elements each old shard shares with each new shard of a pair of geometries.
"""

from __future__ import annotations

import numpy as np

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


class ShardOverlaps:
    """Elements shared by every (old distinct shard, new distinct shard) pair, per pair of geometries."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], np.ndarray] = {}

    def between(self, a: Geometry, b: Geometry) -> np.ndarray:
        """``out[i, j]``: elements old shard ``i`` of ``a`` shares with new shard ``j`` of ``b``."""
        key = (a.fingerprint, b.fingerprint)
        if key not in self._cache:
            out = np.zeros((a.num_shards, b.num_shards), dtype=np.int64)
            if len(a.piece_shard) and len(b.piece_shard):
                lo = np.maximum(a.piece_off[:, None, :], b.piece_off[None, :, :])
                hi = np.minimum((a.piece_off + a.piece_len)[:, None, :], (b.piece_off + b.piece_len)[None, :, :])
                ov = np.clip(hi - lo, 0, None).prod(axis=-1, dtype=np.int64)
                rows = _reduce_sorted(ov, a.piece_shard, a.num_shards, axis=0)
                out = _reduce_sorted(rows, b.piece_shard, b.num_shards, axis=1)
            self._cache[key] = out
        return self._cache[key]


def _reduce_sorted(values: np.ndarray, owner: np.ndarray, num: int, axis: int) -> np.ndarray:
    """Sum ``values`` along ``axis`` by ``owner`` (sorted ascending) into ``num`` buckets."""
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    summed = np.add.reduceat(values, starts, axis=axis)
    shape = list(values.shape)
    shape[axis] = num
    out = np.zeros(shape, dtype=np.int64)
    index: list[slice | np.ndarray] = [slice(None)] * values.ndim
    index[axis] = owner[starts]
    out[tuple(index)] = summed
    return out
