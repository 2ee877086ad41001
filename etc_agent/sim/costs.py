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
    control_per_node_s: float = Field(
        0.0,
        ge=0,
        description="Live switch: added control time per node (agent) of the job: every agent reading the new "
        "generation from the store (--control-plane fits it from scripts/bench_control_plane.py) (s).",
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

    @staticmethod
    def from_control_plane(path: str | Path) -> dict[str, float]:
        """``control_s`` and ``control_per_node_s`` fitted (least squares, a line through the agent
        counts) to the JSON line of ``scripts/bench_control_plane.py``: each fleet's median time
        from an agent's SIGKILL to the generation without it seen by every agent. That time includes
        finding the agent gone, which the checkpoint way also pays and the estimates leave out; the
        fit over-counts the live control round by it (a conservative figure)."""
        try:
            data = json.loads(Path(path).read_text().strip().splitlines()[-1])
            points = [(float(r["agents"]), float(r["kill"]["seen_median_s"])) for r in data["results"]]
        except (OSError, ValueError, IndexError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not a bench_control_plane.py JSON line ({err})") from None
        return fit_line(points, "control_s", "control_per_node_s", str(path))

    def group_init_seconds(self, num_processes: int) -> float:
        return self.group_init_s + self.group_init_per_process_s * num_processes


def fit_line(points: list[tuple[float, float]], intercept: str, slope: str, source: str) -> dict[str, float]:
    """Least-squares ``y = a + b x`` over ``points`` as ``{intercept: a, slope: b}``, both kept >= 0
    (a negative slope from noise is no cost per node; one point is a cost with no slope)."""
    if not points:
        raise ValueError(f"{source}: no measurements to fit")
    if len({x for x, _ in points}) == 1:
        return {intercept: max(0.0, sum(y for _, y in points) / len(points)), slope: 0.0}
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    b = max(0.0, b)
    return {intercept: max(0.0, mean_y - b * mean_x), slope: b}
