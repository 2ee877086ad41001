"""The metadata steps of a migration, before any data moves: exchange every process's shard
descriptions, compute the same plan everywhere from them, and check that every process has it."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from etc_agent.layout.devices import Device
from etc_agent.layout.shards import Shard, StateLayout
from etc_agent.migrate.describe import LocalShard
from etc_agent.migrate.transport import MigrationError, Transport
from etc_agent.planner.core import PlannerOptions, plan_migration
from etc_agent.planner.plan import MigrationPlan


def _to_wire(shards: Sequence[LocalShard]) -> list[tuple]:
    return [_shard_to_wire(s.shard) for s in shards]


def _from_wire(items: list[list]) -> list[Shard]:
    return [
        Shard(key, tuple(shape), tuple(offsets), tuple(lengths), dtype, tuple(flat) if flat is not None else None)
        for key, shape, offsets, lengths, dtype, flat in items
    ]


def description(
    device: Device,
    old_rank: int | None,
    new_rank: int | None,
    old_local: Sequence[LocalShard],
    new_local: Sequence[LocalShard],
) -> dict[str, Any]:
    """This process's part of a migration's descriptions: device, ranks and shard boxes (no data),
    what :func:`exchange_descriptions` gathers and a plan ahead publishes. Its boxes are tuples
    where the gathered or published copies have lists: :func:`digest` reads them alike."""
    return {
        "device": str(device),
        "old_rank": old_rank,
        "new_rank": new_rank,
        "old": _to_wire(old_local),
        "new": _to_wire(new_local),
    }


def exchange_descriptions(transport: Transport, mine: dict[str, Any], vote: str | None = None) -> list[dict[str, Any]]:
    """One ``all_gather_object`` of every process's :func:`description`, each with its ``vote`` for a
    plan made ahead (:class:`PlanAhead`; None: none, or not valid any more)."""
    return transport.all_gather_object({**mine, "ahead": vote})


def digest(value: Any) -> str:
    """A short hash of a JSON value (keys sorted), the same on every process."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PlanInputs:
    """Everything a migration's plan depends on besides the descriptions."""

    tp: int = 1
    """The new layout's TP size (a sender, which has no new layout, passes 1)."""
    options: PlannerOptions | None = None
    failed: tuple[Device, ...] = ()
    """Devices of old ranks whose process is gone."""
    lost_old_ranks: Mapping[int, tuple[Device, list[Shard]]] = field(default_factory=dict)
    """Old ranks no process holds: their device (in ``failed``) and shards."""
    same_keys: Mapping[str, Sequence[int]] = field(default_factory=dict)
    """Named groups of new ranks that must hold the same tensors (a pipeline stage)."""

    def digest(self) -> str:
        """:func:`digest` of all of it, the same on every process that has the same inputs."""
        lost = [
            (r, str(d), [list(_shard_to_wire(s)) for s in shards]) for r, (d, shards) in self.lost_old_ranks.items()
        ]
        return digest(
            {
                "tp": self.tp,
                "options": self.options.model_dump(mode="json") if self.options is not None else None,
                "failed": sorted(str(d) for d in self.failed),
                "lost": sorted(lost),
                "same_keys": {label: list(ranks) for label, ranks in self.same_keys.items()},
            }
        )


def _shard_to_wire(s: Shard) -> tuple:
    return (s.key, s.global_shape, s.offsets, s.lengths, s.dtype, s.flat_range)


@dataclass(frozen=True)
class PlanAhead:
    """A plan made before the stall from every process's :func:`description` (the worker publishes
    them on the generation's store while it still trains).

    It holds inside the stall when every process of the migration finds its own description and
    the other inputs unchanged and they all name the same plan (the vote, gathered with the
    descriptions): the plan, its hash check and their collective are then skipped. Any difference
    anywhere, and every process plans from the gathered descriptions as without it.
    """

    mine: str
    """:func:`digest` of this process's description when the plan was made."""
    inputs: str
    """:meth:`PlanInputs.digest` of what it was made with."""
    plan: MigrationPlan
    peer_of: dict[Device, int]
    names: dict[int, str]
    everyone: str
    """:func:`digest` of every process's description, in transport rank order."""

    @property
    def vote(self) -> str:
        # The other inputs are checked by each process on its own (a sender plans with tp=1).
        return f"{self.everyone}:{self.plan.plan_hash}"

    def vote_for(self, mine: dict[str, Any], inputs: str) -> str | None:
        """This process's vote inside the stall: the plan's, when nothing it was made from changed here."""
        return self.vote if digest(mine) == self.mine and inputs == self.inputs else None


def plan_ahead(descriptions: list[dict[str, Any]], index: int, inputs: PlanInputs) -> PlanAhead:
    """The plan from every process's :func:`description` (``index``: this process's transport
    rank) and ``inputs``; raises as planning does."""
    plan, peer_of, names = plan_from_descriptions(descriptions, inputs)
    return PlanAhead(
        mine=digest(descriptions[index]),
        inputs=inputs.digest(),
        plan=plan,
        peer_of=peer_of,
        names=names,
        everyone=digest(descriptions),
    )


def agreed(descriptions: list[dict[str, Any]], ahead: PlanAhead | None) -> PlanAhead | None:
    """``ahead`` when every process voted for it (gathered by :func:`exchange_descriptions`), else None."""
    if ahead is None:
        return None
    return ahead if all(d.get("ahead") == ahead.vote for d in descriptions) else None


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
    descriptions: list[dict[str, Any]], inputs: PlanInputs
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
    for rank, (dev, shards) in inputs.lost_old_ranks.items():
        if rank in old_by_rank:
            raise MigrationError(f"old rank {rank} is described as lost but {old_by_rank[rank][0]} holds it")
        old_by_rank[rank] = (dev, shards)
    for what, by_rank in (("old", old_by_rank), ("new", new_by_rank)):
        missing = sorted(set(range(max(by_rank, default=-1) + 1)) - set(by_rank))
        if missing:
            raise MigrationError(f"{what} ranks {missing} are not held by any process of this migration")
    _check_same_keys(new_by_rank, inputs.same_keys)
    old_ranks = sorted(old_by_rank)
    new_ranks = sorted(new_by_rank)
    old_layout = StateLayout.from_shards([old_by_rank[r][1] for r in old_ranks])
    new_layout = StateLayout.from_shards([new_by_rank[r][1] for r in new_ranks])
    old_assignment = [old_by_rank[r][0] for r in old_ranks]
    assignment = [new_by_rank[r][0] for r in new_ranks]
    plan = plan_migration(
        old_layout,
        old_assignment,
        new_layout,
        assignment,
        tp=inputs.tp,
        failed=list(inputs.failed),
        options=inputs.options,
        assignment=assignment,
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
    plan_from_descriptions(descriptions, PlanInputs())
