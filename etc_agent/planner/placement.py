"""Placement of a live generation's ranks on its members' devices (what the leader publishes).

The leader knows the members (nodes and device counts), the generation's parallel configuration
and the previous generation's placement, but not the tensors: the cost of putting new rank ``j`` on
a device is what that device's previous rank shares with ``j`` in Megatron's layout. Same pipeline
stage and TP index (same tp and pp): the same parameter shards, so nothing moves (with ZeRO-1 the
optimizer range also needs the same dp index); anything else: the rank's state moves. The DP
replicas of a stage are the sets whose failure domains count (:mod:`etc_agent.planner.domains`).
Pure and deterministic: every agent computes the same placement from the same record.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from etc_agent.layout.config import ParallelConfig
from etc_agent.planner.assign import assign_ranks

KEEP_RANK = 1e-3
"""Discount for a device keeping its exact previous rank (ties go to a stable placement)."""


def stage_replica_sets(config: ParallelConfig) -> list[tuple[tuple[int, ...], int]]:
    """The TP groups (rank // tp) holding the same stage: one set per stage when dp > 1."""
    if config.dp < 2:
        return []
    return [(tuple(p * config.dp + d for d in range(config.dp)), 1) for p in range(config.pp)]


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
    coords = [config.coord(r) for r in range(num_ranks)]
    cost = np.ones((len(devices), num_ranks))
    if previous and previous_config is not None:
        same_shape = (previous_config.tp, previous_config.pp) == (config.tp, config.pp)
        for i, device in enumerate(devices):
            old_rank = previous.get(device)
            if old_rank is None or old_rank >= previous_config.world_size:
                continue
            old = previous_config.coord(old_rank)
            for j, new in enumerate(coords):
                if same_shape and (old.pp, old.tp) == (new.pp, new.tp):
                    zero_moves = config.zero and (old.dp != new.dp or previous_config.dp != config.dp)
                    cost[i, j] = 0.5 if zero_moves else 0.0
                if old_rank == j:
                    cost[i, j] -= KEEP_RANK
    nodes = [d.rpartition(":")[0] for d in devices]
    node_index = {n: k for k, n in enumerate(dict.fromkeys(nodes))}
    node_of_device = np.array([node_index[n] for n in nodes], dtype=np.int64)
    assignment = assign_ranks(cost, node_of_device, config.tp, stage_replica_sets(config), prefer)
    return [devices[int(i)] for i in assignment]


def resilience_gaps(config: ParallelConfig, placement: Sequence[str]) -> list[str]:
    """Why losing one node of ``placement`` (device ``node:local`` of each rank) would lose state
    that no surviving device holds; empty when every shard has a copy on two nodes (or all ranks
    share one node, where no placement helps)."""
    nodes = [d.rpartition(":")[0] for d in placement[: config.world_size]]
    if len(set(nodes)) < 2:
        return []
    if config.dp < 2:
        return [f"dp={config.dp}: every shard is held once, so each node's loss loses its ranks' state"]
    gaps = []
    for stage, (groups, _) in enumerate(stage_replica_sets(config)):
        stage_nodes = {nodes[g * config.tp + t] for g in groups for t in range(config.tp)}
        if len(stage_nodes) == 1:
            gaps.append(f"stage {stage}: every DP replica on {stage_nodes.pop()}")
    if config.zero:
        gaps.append("ZeRO-1: each optimizer range is held by one rank")
    return gaps
