"""Independent reference implementations used by the tests (numpy only, element by element).

- ``global_tensors``: every tensor of a layout filled with distinct values.
- ``simulate``: run a ``MigrationPlan`` on numpy arrays the slow, obvious way: each region is located
  in the sender's old shard and the receiver's new shard through explicit index arithmetic (no use of
  the planner's pieces), every element written is counted, and the result is compared with the global
  tensors. Coverage "exactly once" and "the source holds it" fail loudly here.
- ``cost_matrices``: bytes of each new rank's shards not on a device / not on its node, from boolean
  masks over the global tensors, independent of the planner's box arithmetic.
"""

from __future__ import annotations

from math import prod

import numpy as np

from etc_agent.layout import DTYPE_BYTES, Device, Shard, StateLayout
from etc_agent.planner import MigrationPlan


def global_tensors(layout: StateLayout) -> dict[str, np.ndarray]:
    out, base = {}, 0
    for key in sorted(layout.key_placement):
        shape = layout.placements[layout.key_placement[key]].geometry.global_shape
        out[key] = (np.arange(prod(shape), dtype=np.int64) + base).reshape(shape)
        base += prod(shape)
    return out


def local_storage(shard: Shard, full: np.ndarray) -> np.ndarray:
    box = full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.lengths))]
    if shard.flat_range is None:
        return box.copy()
    return box.reshape(-1)[shard.flat_range[0] : shard.flat_range[1]].copy()


def _local_index(shard: Shard, offsets, lengths) -> np.ndarray | tuple | None:
    """Index into ``shard``'s local storage for the region, or None when the shard lacks part of it."""
    rel = [o - so for o, so in zip(offsets, shard.offsets)]
    if any(r < 0 or r + n > sn for r, n, sn in zip(rel, lengths, shard.lengths)):
        return None
    if shard.flat_range is None:
        return tuple(slice(r, r + n) for r, n in zip(rel, lengths))
    grid = np.indices(lengths).reshape(len(lengths), -1) + np.array(rel)[:, None]
    flat = np.ravel_multi_index(tuple(grid), shard.lengths) if lengths else np.zeros(1, dtype=np.int64)
    local = flat - shard.flat_range[0]
    if (local < 0).any() or (local >= shard.flat_range[1] - shard.flat_range[0]).any():
        return None
    return local


def _find(shards: list[Shard], key: str, offsets, lengths):
    for shard in shards:
        if shard.key == key:
            idx = _local_index(shard, offsets, lengths)
            if idx is not None:
                return shard, idx
    return None, None


def simulate(plan: MigrationPlan, old: StateLayout, new: StateLayout) -> dict[str, int]:
    """Execute ``plan`` on numpy arrays; assert the new state is exactly the old one. Returns byte counts."""
    full = global_tensors(old)
    old_rank_of = {d: r for r, d in enumerate(plan.old_assignment)}
    new_rank_of = {d: j for j, d in enumerate(plan.assignment)}
    old_shards = {r: old.shards_of(r) for r in range(old.num_ranks)}
    old_data = {r: [local_storage(s, full[s.key]) for s in old_shards[r]] for r in old_shards}
    for r in old_data:  # a failed device's data must never be read
        if plan.old_assignment[r] in set(plan.failed):
            old_data[r] = [np.full_like(a, -999) for a in old_data[r]]
    new_shards = {j: new.shards_of(j) for j in range(new.num_ranks)}
    new_data = {
        j: [np.full(s.numel, -1, dtype=np.int64).reshape(-1 if s.flat_range else s.lengths) for s in new_shards[j]]
        for j in new_shards
    }
    writes = {
        j: [np.zeros(s.numel, dtype=np.int64).reshape(-1 if s.flat_range else s.lengths) for s in new_shards[j]]
        for j in new_shards
    }

    def move(src: Device, dst: Device, region) -> int:
        group = plan.groups[region.group]
        moved = 0
        for key in group.keys:
            r, j = old_rank_of[src], new_rank_of[dst]
            s_shard, s_idx = _find(old_shards[r], key, region.offsets, region.lengths)
            assert s_shard is not None, f"{src} does not hold {key} {region}"
            d_shard, d_idx = _find(new_shards[j], key, region.offsets, region.lengths)
            assert d_shard is not None, f"{dst} does not need {key} {region}"
            values = old_data[r][old_shards[r].index(s_shard)][s_idx]
            k = new_shards[j].index(d_shard)
            target = new_data[j][k]
            target[d_idx] = np.asarray(values).reshape(target[d_idx].shape)
            writes[j][k][d_idx] += 1
            moved += prod(region.lengths) * DTYPE_BYTES[old.key_dtype[key]]
        return moved

    local = sum(move(c.device, c.device, region) for c in plan.local_copies for region in c.regions)
    sent = 0
    for t in plan.transfers:
        assert t.src not in set(plan.failed)
        sent += sum(move(t.src, t.dst, region) for region in t.regions)
    for j, shards in new_shards.items():
        for k, shard in enumerate(shards):
            assert (writes[j][k] == 1).all(), (
                f"{shard.key} on new rank {j}: elements written {np.unique(writes[j][k])} times"
            )
            np.testing.assert_array_equal(new_data[j][k], local_storage(shard, full[shard.key]))
    return {"local": local, "sent": sent}


def cost_matrices(plan: MigrationPlan, old: StateLayout, new: StateLayout) -> tuple[np.ndarray, np.ndarray]:
    """``(U, V)`` over (new device index, new rank): bytes not on the device / not on its node."""
    devices = plan.devices_new
    failed = set(plan.failed)
    shapes = {k: old.placements[old.key_placement[k]].geometry.global_shape for k in old.key_placement}

    def mask_of(shards: list[Shard]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for s in shards:
            m = out.setdefault(s.key, np.zeros(shapes[s.key], dtype=bool))
            ids = np.zeros(shapes[s.key], dtype=bool)
            ids[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.lengths))] = True
            if s.flat_range is not None:
                box = np.zeros(prod(s.lengths), dtype=bool)
                box[s.flat_range[0] : s.flat_range[1]] = True
                ids[ids] = box
            m |= ids
        return out

    rank_on = {d: r for r, d in enumerate(plan.old_assignment)}
    dev_mask = {d: (mask_of(old.shards_of(rank_on[d])) if d in rank_on else {}) for d in devices}
    node_mask: dict[str, dict[str, np.ndarray]] = {}
    for d, r in rank_on.items():
        if d in failed:
            continue
        nm = node_mask.setdefault(d.node, {})
        for k, m in mask_of(old.shards_of(r)).items():
            nm[k] = nm.get(k, np.zeros_like(m)) | m
    U = np.zeros((len(devices), new.num_ranks), dtype=np.int64)
    V = np.zeros_like(U)
    for j in range(new.num_ranks):
        need = mask_of(new.shards_of(j))
        for i, d in enumerate(devices):
            for k, m in need.items():
                w = DTYPE_BYTES[new.key_dtype[k]]
                have = dev_mask[d].get(k)
                U[i, j] += w * int((m & ~have).sum() if have is not None else m.sum())
                have_n = node_mask.get(d.node, {}).get(k)
                V[i, j] += w * int((m & ~have_n).sum() if have_n is not None else m.sum())
    return U, V
