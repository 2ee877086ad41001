"""The metadata steps of a migration, before any data moves: exchange every process's shard
descriptions, compute the same plan everywhere from them, and check that every process has it."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from etc_agent.layout.devices import Device
from etc_agent.layout.shards import Shard, StateLayout
from etc_agent.migrate.describe import LocalShard
from etc_agent.migrate.transport import MigrationError, Transport
from etc_agent.planner.core import PlannerOptions, plan_migration
from etc_agent.planner.plan import MigrationPlan


def _to_wire(shards: Sequence[LocalShard]) -> list[tuple]:
    return [
        (s.shard.key, s.shard.global_shape, s.shard.offsets, s.shard.lengths, s.shard.dtype, s.shard.flat_range)
        for s in shards
    ]


def _from_wire(items: list[list]) -> list[Shard]:
    return [
        Shard(key, tuple(shape), tuple(offsets), tuple(lengths), dtype, tuple(flat) if flat is not None else None)
        for key, shape, offsets, lengths, dtype, flat in items
    ]


def exchange_descriptions(
    transport: Transport,
    device: Device,
    old_rank: int | None,
    new_rank: int | None,
    old_local: Sequence[LocalShard],
    new_local: Sequence[LocalShard],
) -> list[dict[str, Any]]:
    """One ``all_gather_object`` of every process's device, ranks and shard boxes (no data)."""
    payload = {
        "device": str(device),
        "old_rank": old_rank,
        "new_rank": new_rank,
        "old": _to_wire(old_local),
        "new": _to_wire(new_local),
    }
    return transport.all_gather_object(payload)


def check_same_plan(transport: Transport, plan: MigrationPlan, names: dict[int, str], device: Device) -> None:
    """Compare the plan hashes of all processes; a mismatch names the processes that differ."""
    hashes = transport.all_gather_object(plan.plan_hash)
    if len(set(hashes)) != 1:
        differing = [names[r] for r, h in enumerate(hashes) if h != plan.plan_hash]
        raise MigrationError(
            f"plan hash mismatch: {plan.plan_hash} here on {device}, different on {', '.join(differing)}"
        )


def _check_same_keys(
    new_by_rank: dict[int, tuple[Device, list[Shard]]], same_keys: Mapping[str, Sequence[int]]
) -> None:
    for label, ranks in same_keys.items():
        boxes = {r: {s.key for s in new_by_rank[r][1] if s.flat_range is None} for r in ranks if r in new_by_rank}
        ranged = {s.key for r in ranks if r in new_by_rank for s in new_by_rank[r][1] if s.flat_range is not None}
        for key in sorted(set().union(*boxes.values()) - ranged):
            without = [r for r in boxes if key not in boxes[r]]
            if without:
                having = [r for r in boxes if key in boxes[r]]
                raise ValueError(
                    f"{key}: new rank {', '.join(map(str, having))} {'holds' if len(having) == 1 else 'hold'} it but rank "
                    f"{', '.join(map(str, without))} of the same {label} {'does' if len(without) == 1 else 'do'} not"
                )


def plan_from_descriptions(
    descriptions: list[dict[str, Any]],
    tp: int,
    options: PlannerOptions | None,
    failed: Sequence[Device],
    lost_old_ranks: Mapping[int, tuple[Device, list[Shard]]],
    same_keys: Mapping[str, Sequence[int]],
) -> tuple[MigrationPlan, dict[Device, int], dict[int, str]]:
    """The plan, the transport rank of each device and the device name of each transport rank."""
    names = {r: d["device"] for r, d in enumerate(descriptions)}
    peer_of: dict[Device, int] = {}
    old_by_rank: dict[int, tuple[Device, list[Shard]]] = {}
    new_by_rank: dict[int, tuple[Device, list[Shard]]] = {}
    for r, d in enumerate(descriptions):
        dev = Device.parse(d["device"])
        if dev in peer_of:
            raise MigrationError(f"device {dev} is claimed by transport ranks {peer_of[dev]} and {r}")
        peer_of[dev] = r
        if d["old_rank"] is not None:
            if d["old_rank"] in old_by_rank:
                raise MigrationError(f"old rank {d['old_rank']} claimed by {old_by_rank[d['old_rank']][0]} and {dev}")
            old_by_rank[d["old_rank"]] = (dev, _from_wire(d["old"]))
        if d["new_rank"] is not None:
            if d["new_rank"] in new_by_rank:
                raise MigrationError(f"new rank {d['new_rank']} claimed by {new_by_rank[d['new_rank']][0]} and {dev}")
            new_by_rank[d["new_rank"]] = (dev, _from_wire(d["new"]))
    for rank, (dev, shards) in lost_old_ranks.items():
        if rank in old_by_rank:
            raise MigrationError(f"old rank {rank} is described as lost but {old_by_rank[rank][0]} holds it")
        old_by_rank[rank] = (dev, shards)
    for what, by_rank in (("old", old_by_rank), ("new", new_by_rank)):
        missing = sorted(set(range(max(by_rank, default=-1) + 1)) - set(by_rank))
        if missing:
            raise MigrationError(f"{what} ranks {missing} are not held by any process of this migration")
    _check_same_keys(new_by_rank, same_keys)
    old_ranks = sorted(old_by_rank)
    new_ranks = sorted(new_by_rank)
    old_layout = StateLayout.from_shards([old_by_rank[r][1] for r in old_ranks])
    new_layout = StateLayout.from_shards([new_by_rank[r][1] for r in new_ranks])
    old_assignment = [old_by_rank[r][0] for r in old_ranks]
    assignment = [new_by_rank[r][0] for r in new_ranks]
    plan = plan_migration(
        old_layout, old_assignment, new_layout, assignment, tp=tp, failed=failed, options=options, assignment=assignment
    )
    return plan, peer_of, names


@functools.cache
def warm_planner() -> None:
    """Plan a toy migration once (one tensor from one process to another), so that this process's
    first real plan, inside a stall, pays none of the planner's first-use costs: lazy imports
    (``numpy.ma``), patterns compiled and classes made on first use (12-15 ms of a first plan here,
    against 3-4 ms for the same plan again). Idempotent; the worker calls it as the job starts and
    a warm spare before it is adopted."""
    box = ("warm", (4, 2), (0, 0), (4, 2), "float32", None)
    descriptions: list[dict[str, Any]] = [
        {"device": "warm0:0", "old_rank": 0, "new_rank": None, "old": [box], "new": []},
        {"device": "warm1:0", "old_rank": None, "new_rank": 0, "old": [], "new": [box]},
    ]
    plan_from_descriptions(descriptions, 1, None, (), {}, {})
