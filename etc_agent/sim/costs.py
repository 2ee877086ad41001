"""The simulator's cost model: every bandwidth and latency it uses, one documented field each.

Units: GB/s is 1e9 bytes per second per direction; seconds are wall seconds. The defaults describe
an H100/H200-class cluster (8 GPUs per node, NVLink inside a node, one 200 Gb/s NIC per GPU, a
parallel file system); ``scripts/calibrate_sim.py`` measures the same figures on a machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from etc_agent.planner.bandwidth import BandwidthModel


class CostModel(BandwidthModel):
    """Links and storage (inherited from the planner's :class:`BandwidthModel`) plus the fixed costs
    of a switch. Both ways pay the same communicator creation and state allocation; the checkpoint
    way adds storage and a process restart, the live way a control round and the transfers."""

    control_s: float = Field(
        0.3,
        ge=0,
        description="Live switch: stop at the step boundary, agree on the generation through the store, arrival barrier (s).",
    )
    control_per_process_s: float = Field(
        5e-4,
        ge=0,
        description="Live switch: added control time per process in the generation (store round trips, barrier) (s).",
    )
    join_s: float = Field(
        1.0,
        ge=0,
        description="Live switch: added when new processes join (their first switch: first collectives, first "
        "DTensor dispatch, caches warming) (s).",
    )
    leave_s: float = Field(
        0.2,
        ge=0,
        description="Live switch: added when processes leave (they join the migration group, send, then exit) (s).",
    )
    group_init_s: float = Field(
        1.0, ge=0, description="Creating one communicator for the new generation, fixed part (s)."
    )
    group_init_per_process_s: float = Field(
        2e-3,
        ge=0,
        description="Creating one communicator, per member process (NCCL bootstrap grows with the world) (s).",
    )
    live_groups: int = Field(
        2,
        ge=1,
        description="Communicators a live switch creates (training group and migration group; the checkpoint way: 1).",
    )
    alloc_gbps: float = Field(
        500.0, gt=0, description="GB/s a process allocates its new state at when it rebuilds (both ways)."
    )
    copy_gbps: float = Field(
        1000.0,
        gt=0,
        description="GB/s of a device-local copy: resident regions (live), unpacking what a load read (checkpoint).",
    )
    restart_per_process_s: float = Field(
        0.0,
        ge=0,
        description="Checkpoint way: added restart time per process started. 0 on a cluster (each node starts "
        "its own in parallel); on one machine standing in for several nodes its processes share the cores (s).",
    )
    storage_latency_s: float = Field(
        0.5,
        ge=0,
        description="Checkpoint way: fixed cost of one save or one load (metadata, file creation, sync, barriers) (s).",
    )

    @classmethod
    def from_file(cls, path: str | Path) -> dict:
        """The fields stored in a JSON file (as ``scripts/calibrate_sim.py`` writes: ``{"costs": {...}}``
        or the fields at the top level), to merge with flags."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a readable JSON file ({err})") from None
        values = data.get("costs", data) if isinstance(data, dict) else data
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object of cost fields")
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"{path}: unknown cost fields {', '.join(unknown)}")
        return values

    def group_init_seconds(self, num_processes: int) -> float:
        return self.group_init_s + self.group_init_per_process_s * num_processes
