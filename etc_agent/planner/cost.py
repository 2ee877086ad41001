"""Step 2 of the planner: the cost matrices over (new device, new rank) that placement minimises.

``need[r]``: bytes of new rank ``r``'s shards. ``not_on_device[d, r]``: those bytes not resident on
device ``d``. ``not_on_node[d, r]``: those bytes not resident anywhere on ``d``'s node (live old ranks
only), which placement uses to break ties towards intra-node traffic.
"""

from __future__ import annotations

import numpy as np

from etc_agent.layout.shards import Placement, StateLayout
from etc_agent.planner.plan import KeyGroup
from etc_agent.planner.universe import ShardOverlaps, Universe


def cost_matrices(
    old: StateLayout, new: StateLayout, groups: list[KeyGroup], universe: Universe, overlaps: ShardOverlaps
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(need, not_on_device, not_on_node)`` for placing ``new``'s ranks on the new devices."""
    n_dev, n_rank = universe.num_dev, new.num_ranks
    need = np.zeros(n_rank, dtype=np.int64)
    res_dev = np.zeros((n_dev, n_rank), dtype=np.int64)
    res_node = np.zeros((universe.num_new_nodes, n_rank), dtype=np.int64)
    for g in groups:
        pn = new.placements[g.new_placement]
        w = g.bytes_per_element
        new_rank, new_shard = pn.entry_rank, pn.entry_shard
        np.add.at(need, new_rank, pn.geometry.shard_numel[new_shard] * w)
        if g.old_placement < 0:
            continue  # held nowhere: the same cost on every device
        po = old.placements[g.old_placement]
        overlap = overlaps.between(po.geometry, pn.geometry)
        dev = universe.old_rank_dev[po.entry_rank]
        here = dev < n_dev
        if here.any():
            vals = overlap[np.ix_(po.entry_shard[here], new_shard)] * w
            _add_block(res_dev, dev[here], new_rank, vals)
        _add_node_residency(res_node, universe, po, pn, overlap, w)
    not_on_device = need[None, :] - res_dev
    node_of_new = universe.node_of[:n_dev]
    not_on_node = need[None, :] - res_node[node_of_new, :]
    return need, not_on_device, not_on_node


def _add_node_residency(
    res_node: np.ndarray, universe: Universe, po: Placement, pn: Placement, overlap: np.ndarray, w: int
) -> None:
    """Add to ``res_node[node, r]`` the bytes of new rank ``r``'s shards that live old ranks on ``node`` hold."""
    new_rank, new_shard = pn.entry_rank, pn.entry_shard
    dev = universe.old_rank_dev[po.entry_rank]
    alive = universe.old_rank_alive[po.entry_rank]
    node = universe.node_of[dev[alive]]
    shard = po.entry_shard[alive]
    keep = node < universe.num_new_nodes
    pairs = np.unique(np.stack([node[keep], shard[keep]], axis=1), axis=0)
    if not len(pairs):
        return
    vals = overlap[np.ix_(pairs[:, 1], new_shard)] * w
    if po.geometry.disjoint:
        _add_block(res_node, pairs[:, 0], new_rank, vals)
    else:
        # Overlapping old shards would be counted twice; the node term only breaks ties,
        # so an upper bound per group (never above the rank's need) is good enough.
        part = np.zeros_like(res_node)
        np.add.at(part, (pairs[:, 0][:, None], new_rank[None, :]), vals)
        group_need = np.zeros(res_node.shape[1], dtype=np.int64)
        np.add.at(group_need, new_rank, pn.geometry.shard_numel[new_shard] * w)
        res_node += np.minimum(part, group_need[None, :])


def _add_block(target: np.ndarray, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
    """``target[rows[i], cols[j]] += vals[i, j]``, also when indices repeat."""
    if len(np.unique(rows)) == len(rows) and len(np.unique(cols)) == len(cols):
        target[np.ix_(rows, cols)] += vals
    else:
        np.add.at(target, (rows[:, None], cols[None, :]), vals)
