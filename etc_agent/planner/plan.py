"""``MigrationPlan``: plain data describing one migration. Geometry only; nothing here runs.

How a plan is executed (``etc_agent.migrate``): every process of old ∪ new devices computes the same
plan and checks :attr:`MigrationPlan.plan_hash` across ranks. Then, round by round, each device packs
the regions of its outgoing :class:`Transfer` into one contiguous buffer per peer (regions in list
order, within a region the keys of its :class:`KeyGroup` in order, each key's elements row-major), and
receives and unpacks likewise. :class:`LocalCopy` regions are copied from the device's old shards
without communication; :class:`Restore` regions (held by no live device) are read from a checkpoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from math import prod
from typing import Any

from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device
from etc_agent.layout.model import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class Region:
    """A box (global coordinates) of every tensor in key group ``group``."""

    group: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.lengths)


@dataclass(frozen=True)
class KeyGroup:
    """Keys whose shards sit in identical places in the old layout and in the new one."""

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    global_shape: tuple[int, ...]
    old_placement: int
    new_placement: int
    bytes_per_element: int = field(init=False)
    """Bytes one element position costs, summed over all keys of the group."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes_per_element", sum(DTYPE_BYTES[d] for d in self.dtypes))


@dataclass(frozen=True)
class Transfer:
    """One message: ``src`` packs ``regions`` and sends them to ``dst`` in round ``round``."""

    src: Device
    dst: Device
    round: int
    regions: tuple[Region, ...]
    num_bytes: int


@dataclass(frozen=True)
class LocalCopy:
    """Regions of the new shards that ``device`` already holds in its old shards."""

    device: Device
    regions: tuple[Region, ...]
    num_bytes: int


@dataclass(frozen=True)
class Restore:
    """Regions of the new shards that no live device holds: ``device`` reads them from a checkpoint."""

    device: Device
    regions: tuple[Region, ...]
    num_bytes: int


@dataclass
class MigrationPlan:
    """Everything a migration does, and what it costs."""

    old_config: ParallelConfig | None
    new_config: ParallelConfig | None
    devices_old: list[Device]
    """Old device set; ``old_assignment[r]`` is where old rank ``r`` ran."""
    devices_new: list[Device]
    old_assignment: list[Device]
    assignment: list[Device]
    """New rank -> device."""
    groups: list[KeyGroup]
    transfers: list[Transfer]
    local_copies: list[LocalCopy]
    restores: list[Restore]
    """Empty unless the planner ran with ``restore_lost``: what comes from the checkpoint, by device."""
    bytes_restored: int
    """Bytes of ``restores`` (read from storage, not moved between devices)."""
    failed: list[Device]
    """Old devices whose state is gone (unplanned loss); never used as sources."""
    dropped_keys: list[str]
    """Keys held in the old layout that the new layout does not have."""
    state_bytes: int
    need_bytes: dict[Device, int]
    resident_bytes: dict[Device, int]
    bytes_moved: int
    bytes_moved_inter_node: int
    lower_bound_bytes: int | None
    """No placement moves less (None: the placement was given, as in the workers' plans)."""
    naive_bytes_moved: int
    checkpoint_bytes: int
    num_rounds: int
    mem_cap_bytes: int
    max_messages_per_round: int
    estimated_seconds: float
    checkpoint_estimated_seconds: float
    plan_seconds: float = 0.0
    plan_hash: str = field(default="")
    failure_domains: dict[str, Any] | None = None
    """The new placement's single-domain shards and per-node loss (``planner.domains``), as JSON."""
    resilient_alternative: dict[str, Any] | None = None
    """Set on a fast plan whose placement leaves avoidable state in one node: what the resilient
    placement would move instead (:func:`etc_agent.planner.core.resilience_advice`)."""

    @property
    def num_messages(self) -> int:
        return len(self.transfers)

    @property
    def restored_keys(self) -> list[str]:
        """Keys with at least one element read from the checkpoint."""
        return sorted({k for r in self.restores for region in r.regions for k in self.groups[region.group].keys})

    def compute_hash(self) -> str:
        """A stable hash of what the plan does (placement, groups, every message and local copy)."""
        h = hashlib.sha256()
        h.update(repr((str(self.old_config), str(self.new_config))).encode())
        h.update(repr([str(d) for d in self.old_assignment]).encode())
        h.update(repr([str(d) for d in self.assignment]).encode())
        for g in self.groups:
            h.update(repr((g.keys, g.dtypes, g.global_shape)).encode())
        for t in self.transfers:
            h.update(repr((str(t.src), str(t.dst), t.round, t.num_bytes)).encode())
            h.update(repr([(r.group, r.offsets, r.lengths) for r in t.regions]).encode())
        for c in self.local_copies:
            h.update(repr((str(c.device), [(r.group, r.offsets, r.lengths) for r in c.regions])).encode())
        for restore in self.restores:
            regions = [(r.group, r.offsets, r.lengths) for r in restore.regions]
            h.update(repr(("restore", str(restore.device), regions)).encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """The JSON object printed by ``etc-agent plan --json`` (field names are a public contract)."""

        def cfg(c: ParallelConfig | None) -> dict[str, int] | None:
            return None if c is None else {"tp": c.tp, "pp": c.pp, "dp": c.dp, "zero": c.zero, "dp_shard": c.dp_shard}

        return {
            "from": cfg(self.old_config),
            "to": cfg(self.new_config),
            "devices_old": [str(d) for d in self.devices_old],
            "devices_new": [str(d) for d in self.devices_new],
            "old_assignment": {str(r): str(d) for r, d in enumerate(self.old_assignment)},
            "assignment": {str(r): str(d) for r, d in enumerate(self.assignment)},
            "failed": [str(d) for d in self.failed],
            "state_bytes": self.state_bytes,
            "need_bytes": {str(d): b for d, b in self.need_bytes.items()},
            "resident_bytes": {str(d): b for d, b in self.resident_bytes.items()},
            "bytes_moved": self.bytes_moved,
            "bytes_moved_intra_node": self.bytes_moved - self.bytes_moved_inter_node,
            "bytes_moved_inter_node": self.bytes_moved_inter_node,
            "lower_bound_bytes": self.lower_bound_bytes,
            "naive_bytes_moved": self.naive_bytes_moved,
            "checkpoint_bytes": self.checkpoint_bytes,
            "num_messages": self.num_messages,
            "num_rounds": self.num_rounds,
            "mem_cap_bytes": self.mem_cap_bytes,
            "transfers": [
                {
                    "src": str(t.src),
                    "dst": str(t.dst),
                    "bytes": t.num_bytes,
                    "round": t.round,
                    "num_regions": sum(len(self.groups[r.group].keys) for r in t.regions),
                }
                for t in self.transfers
            ],
            "bytes_restored": self.bytes_restored,
            "restored_keys": self.restored_keys,
            "restores": [
                {"device": str(r.device), "bytes": r.num_bytes, "num_regions": len(r.regions)} for r in self.restores
            ],
            "dropped_keys": self.dropped_keys,
            "plan_seconds": self.plan_seconds,
            "estimated_seconds": self.estimated_seconds,
            "checkpoint_estimated_seconds": self.checkpoint_estimated_seconds,
            "plan_hash": self.plan_hash,
            "failure_domains": self.failure_domains,
            "resilient_alternative": self.resilient_alternative,
        }
