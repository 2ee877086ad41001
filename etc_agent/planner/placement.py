"""Placement of a live generation's ranks on its members' devices (what the leader publishes).

The leader knows the members (nodes and device counts), the generation's parallel configuration
and the previous generation's placement, but not the tensors: the cost of putting new rank ``j`` on
a device is the share of ``j``'s state that device's previous rank does not hold:

- Megatron layouts (no FSDP on either side): same pipeline stage and TP index (same tp and pp):
  the same parameter shards, so nothing moves (with ZeRO-1 the optimizer range also needs the same
  dp index); anything else: the rank's state moves;
- where either side shards with FSDP (``dp_shard > 1``), the geometry of a generic transformer:
  layers split into stages, and each matrix split by TP either on the dim FSDP shards (dim 0:
  column-parallel, FSDP's chunk inside the TP slice) or on the other one (row-parallel), in the
  proportion :data:`COLUMN_PARALLEL_SHARE`; e.g. ``tp=2,dp_shard=2 -> dp_shard=4`` puts new rank 1
  on old rank 2's device, which holds its rows of every column-parallel matrix.

The copies of a shard (DP replicas of a stage; HSDP's replicas of one FSDP shard) are the sets
whose failure domains count (:mod:`etc_agent.planner.domains`). Pure and deterministic: every agent
computes the same placement from the same record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from etc_agent.layout.config import ParallelConfig
from etc_agent.planner.assign import assign_ranks

if TYPE_CHECKING:
    from etc_agent.planner.residency import Residency

DENSE_LIVE_CELLS = 1 << 22
"""Above this many devices x ranks, a Megatron layout's ``"cost"`` placement takes the sparse path."""

KEEP_RANK = 1e-3
"""Discount for a device keeping its exact previous rank (ties go to a stable placement)."""

COLUMN_PARALLEL_SHARE = 0.6
"""Share of a block's matrix bytes that TP splits on dim 0, the dim FSDP shards: GPT's QKV and FC1
(7 of 12 h^2), Llama's wq/wk/wv/w1/w3 (about 2/3 with grouped-query attention); the rest (attention
out, FC2 / w2) TP splits on dim 1."""


def stage_replica_sets(config: ParallelConfig) -> list[tuple[tuple[int, ...], int]]:
    """The TP groups (rank // tp) holding the same data: per stage (and FSDP shard), its replicas;
    none where each shard is held once (dp_replicate = 1)."""
    replicas, shards = config.dp_replicate, config.dp_shard
    if replicas < 2:
        return []
    return [
        (tuple(p * config.dp + r * shards + s for r in range(replicas)), 1)
        for p in range(config.pp)
        for s in range(shards)
    ]


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def fsdp_overlap(old: ParallelConfig, old_rank: int, new: ParallelConfig, new_rank: int) -> float:
    """Fraction of new rank ``new_rank``'s parameters and optimizer state that old rank ``old_rank``
    holds, in the generic transformer geometry of the module docstring (replicated norms left out;
    a ZeRO-1 rank counted as holding its whole TP slice)."""
    a, b = old.coord(old_rank), new.coord(new_rank)

    def stage(cfg: ParallelConfig, pp: int) -> tuple[float, float]:
        return pp / cfg.pp, (pp + 1) / cfg.pp

    def tp_slice(cfg: ParallelConfig, tp: int) -> tuple[float, float]:
        return tp / cfg.tp, (tp + 1) / cfg.tp

    def shard(cfg: ParallelConfig, dp: int) -> tuple[float, float]:
        index = dp % cfg.dp_shard
        return index / cfg.dp_shard, (index + 1) / cfg.dp_shard

    def column(cfg: ParallelConfig, tp: int, dp: int) -> tuple[float, float]:
        lo, hi = shard(cfg, dp)
        return (tp + lo) / cfg.tp, (tp + hi) / cfg.tp  # FSDP's chunk of this rank's TP slice

    stage_share = _overlap(stage(old, a.pp), stage(new, b.pp)) * new.pp
    column_share = _overlap(column(old, a.tp, a.dp), column(new, b.tp, b.dp)) * new.tp * new.dp_shard
    row_share = (
        _overlap(tp_slice(old, a.tp), tp_slice(new, b.tp))
        * new.tp
        * _overlap(shard(old, a.dp), shard(new, b.dp))
        * new.dp_shard
    )
    return stage_share * (COLUMN_PARALLEL_SHARE * column_share + (1 - COLUMN_PARALLEL_SHARE) * row_share)


def live_placement(
    config: ParallelConfig,
    devices: Sequence[str],
    previous: dict[str, int] | None = None,
    previous_config: ParallelConfig | None = None,
    prefer: str = "resilience",
) -> list[str]:
    """Device (``node:local``) of each new rank of ``config`` on ``devices`` (member order).

    ``previous``: device -> its rank in the previous generation (``previous_config``). Every TP group
    stays inside one node; ``prefer``: ``"resilience"`` (DP replicas of a stage on different nodes
    first, then the least state moved) or ``"cost"``.
    """
    if config.world_size > len(devices):
        raise ValueError(f"{config.short()} needs {config.world_size} devices, the members have {len(devices)}")
    num_ranks = config.world_size
    if prefer == "cost" and len(devices) * num_ranks > DENSE_LIVE_CELLS:
        at_scale = _megatron_placement_at_scale(config, devices, previous, previous_config)
        if at_scale is not None:
            return at_scale
    coords = [config.coord(r) for r in range(num_ranks)]
    cost = np.ones((len(devices), num_ranks))
    if previous and previous_config is not None:
        same_shape = (previous_config.tp, previous_config.pp) == (config.tp, config.pp)
        fsdp = previous_config.dp_shard > 1 or config.dp_shard > 1
        for i, device in enumerate(devices):
            old_rank = previous.get(device)
            if old_rank is None or old_rank >= previous_config.world_size:
                continue
            old = previous_config.coord(old_rank)
            for j, new in enumerate(coords):
                if fsdp:
                    cost[i, j] = 1.0 - fsdp_overlap(previous_config, old_rank, config, j)
                elif same_shape and (old.pp, old.tp) == (new.pp, new.tp):
                    zero_moves = config.zero and (old.dp != new.dp or previous_config.dp != config.dp)
                    cost[i, j] = 0.5 if zero_moves else 0.0
                if old_rank == j:
                    cost[i, j] -= KEEP_RANK
    nodes = [d.rpartition(":")[0] for d in devices]
    node_index = {n: k for k, n in enumerate(dict.fromkeys(nodes))}
    node_of_device = np.array([node_index[n] for n in nodes], dtype=np.int64)
    assignment = assign_ranks(cost, node_of_device, config.tp, stage_replica_sets(config), prefer)
    return [devices[int(i)] for i in assignment]


def _megatron_placement_at_scale(
    config: ParallelConfig,
    devices: Sequence[str],
    previous: dict[str, int] | None,
    previous_config: ParallelConfig | None,
) -> list[str] | None:
    """:func:`live_placement`'s ``"cost"`` placement for Megatron layouts without a devices x ranks
    matrix: the same costs as a :class:`etc_agent.planner.residency.Residency` (in thousandths of a
    rank's state kept: 1000 for the same stage and TP index, 500 of it when ZeRO moves the optimizer
    range, 1 for the exact previous rank) placed by :func:`etc_agent.planner.matching.assign_sparse`.
    Failure domains do not break its ties. None where FSDP's geometry is needed (the dense path)."""
    from etc_agent.planner.matching import assign_sparse

    if previous_config is not None and (previous_config.dp_shard > 1 or config.dp_shard > 1):
        return None
    old_rank = np.full(len(devices), -1, dtype=np.int64)
    if previous and previous_config is not None:
        for i, device in enumerate(devices):
            rank = previous.get(device)
            if rank is not None and rank < previous_config.world_size:
                old_rank[i] = rank
    res = _live_residency(config, old_rank, previous_config)
    nodes = [d.rpartition(":")[0] for d in devices]
    node_index = {n: k for k, n in enumerate(dict.fromkeys(nodes))}
    node_of_device = np.array([node_index[n] for n in nodes], dtype=np.int64)
    assignment = assign_sparse(res, node_of_device, config.tp)
    return [devices[int(i)] for i in assignment]


def _live_residency(config: ParallelConfig, old_rank: np.ndarray, previous_config: ParallelConfig | None) -> Residency:
    """The live placement's costs as kept thousandths (see :func:`_megatron_placement_at_scale`);
    ``old_rank``: each device's previous rank (-1: none)."""
    from etc_agent.planner.residency import Residency

    num_dev, num_ranks = len(old_rank), config.world_size
    ranks = np.arange(num_ranks)
    new_pp, new_tp, new_dp = _coords(config, ranks)
    dev_class = np.full(num_dev, -1, dtype=np.int64)
    held = np.flatnonzero(old_rank >= 0)
    keep_rank = held[old_rank[held] < num_ranks]
    pair_dev, pair_rank = [keep_rank], [old_rank[keep_rank]]
    pair_gain = [np.full(len(keep_rank), 1, dtype=np.int64)]  # KEEP_RANK
    block_key = block_bytes = np.empty(0, dtype=np.int64)
    if len(held) and previous_config is not None and (previous_config.tp, previous_config.pp) == (config.tp, config.pp):
        old_pp, old_tp, old_dp = _coords(previous_config, old_rank[held])
        dev_class[held] = old_pp * config.tp + old_tp
        classes = np.unique(dev_class[held])
        block_key = classes * (config.tp * config.pp) + classes
        block_bytes = np.full(len(classes), 500 if config.zero else 1000, dtype=np.int64)
        if config.zero and previous_config.dp == config.dp:
            # The same dp index keeps the optimizer range too: the rank at the same coordinates.
            pair_dev.append(held)
            pair_rank.append(old_pp * config.tp * config.dp + old_dp * config.tp + old_tp)
            pair_gain.append(np.full(len(held), 500, dtype=np.int64))
    keys = np.concatenate([d * num_ranks + r for d, r in zip(pair_dev, pair_rank)])
    unique, inverse = np.unique(keys, return_inverse=True)
    gains = np.zeros(len(unique), dtype=np.int64)
    np.add.at(gains, inverse, np.concatenate(pair_gain))
    need = np.full(num_ranks, 1001, dtype=np.int64)
    rank_class = new_pp * config.tp + new_tp
    num_classes = config.tp * config.pp
    return Residency(
        need, dev_class, rank_class, num_classes, block_key, block_bytes, unique, gains, num_dev, num_ranks
    )


def _coords(config: ParallelConfig, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pp, tp, dp)`` index of each rank: Megatron's order, rank = pp*(dp*tp) + dp*tp + tp."""
    per_stage = config.dp * config.tp
    return ranks // per_stage, ranks % config.tp, (ranks % per_stage) // config.tp


def resilience_gaps(config: ParallelConfig, placement: Sequence[str]) -> list[str]:
    """Why losing one node of ``placement`` (device ``node:local`` of each rank) would lose state
    that no surviving device holds; empty when every shard has a copy on two nodes (or all ranks
    share one node, where no placement helps)."""
    nodes = [d.rpartition(":")[0] for d in placement[: config.world_size]]
    if len(set(nodes)) < 2:
        return []
    if config.dp_replicate < 2:
        if config.dp_shard > 1:
            return ["dp_replicate=1: every FSDP shard is held once, so each node's loss loses its ranks' state"]
        return [f"dp={config.dp}: every shard is held once, so each node's loss loses its ranks' state"]
    gaps = []
    for index, (groups, _) in enumerate(stage_replica_sets(config)):
        stage, shard = divmod(index, config.dp_shard)
        where = f"stage {stage}" + (f", FSDP shard {shard}" if config.dp_shard > 1 else "")
        copies = "HSDP replica" if config.dp_shard > 1 else "DP replica"
        holders = {nodes[g * config.tp + t] for g in groups for t in range(config.tp)}
        if len(holders) == 1:
            gaps.append(f"{where}: every {copies} on {holders.pop()}")
    if config.zero:
        gaps.append("ZeRO-1: each optimizer range is held by one rank")
    return gaps
