"""Estimate one membership change both ways: live migration and the checkpoint way.

The live estimate runs the real planner on the model spec and prices what the plan does (its
transfers round by round over intra- and inter-node links, its local copies) plus the fixed costs
of a switch. The checkpoint estimate prices what users do today: save the state, restart every
worker, create the communicator, rebuild, and load every new shard with resharding. Pure: no
process groups, no tensors.

Stall, both ways: from training stopped to training resumed. Detecting the change (a lease expiring,
a SIGTERM arriving) happens before and is the same for both; it is left out. A failure gives the
checkpoint way nothing to save (it loads the last periodic checkpoint) and costs it the steps since
that checkpoint, which is also left out: the ratios are its best case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.model import ModelSpec
from etc_agent.planner.core import PlannerOptions, plan_model_migration
from etc_agent.planner.plan import MigrationPlan
from etc_agent.sim.costs import CostModel

GB = 1e9


@dataclass(frozen=True)
class Scenario:
    """One membership change of one job."""

    name: str
    """Short label (``preempt 1 node``, ``tp-down``...)."""
    spec: ModelSpec
    old_config: ParallelConfig
    old_devices: DeviceSet
    new_config: ParallelConfig
    new_devices: DeviceSet
    failed: tuple[Device, ...] = ()
    """Old devices whose state is gone (a crash); empty for planned changes."""
    ordered: bool = False
    """New rank ``r`` on the ``r``-th new device (live workers' placement today) instead of the planner's."""

    @property
    def kind(self) -> Literal["planned", "failure"]:
        return "failure" if self.failed else "planned"


@dataclass
class SimResult:
    scenario: Scenario
    plan: MigrationPlan
    etc_phases: dict[str, float] = field(default_factory=dict)
    """control_s, group_init_s, rebuild_s, plan_s, transfer_s, local_copy_s."""
    ckpt_phases: dict[str, float] = field(default_factory=dict)
    """save_s, restart_s, group_init_s, rebuild_s, load_s."""
    checkpoint_bytes: int = 0
    """What the checkpoint way writes (nothing after a failure) and reads."""

    @property
    def etc_s(self) -> float:
        return sum(self.etc_phases.values())

    @property
    def ckpt_s(self) -> float:
        return sum(self.ckpt_phases.values())

    @property
    def ratio(self) -> float:
        return self.ckpt_s / self.etc_s if self.etc_s > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        s, p = self.scenario, self.plan
        return {
            "model": s.spec.name,
            "scenario": s.name,
            "kind": s.kind,
            "num_devices_old": len(s.old_devices),
            "num_devices_new": len(s.new_devices),
            "from": s.old_config.short(),
            "to": s.new_config.short(),
            "state_bytes": p.state_bytes,
            "bytes_moved": p.bytes_moved,
            "bytes_moved_inter_node": p.bytes_moved_inter_node,
            "checkpoint_bytes": self.checkpoint_bytes,
            "num_rounds": p.num_rounds,
            "num_messages": p.num_messages,
            "etc_s": round(self.etc_s, 4),
            "ckpt_s": round(self.ckpt_s, 4),
            "ratio": round(self.ratio, 3) if self.etc_s > 0 else None,
            "etc_phases_s": {k: round(v, 4) for k, v in self.etc_phases.items()},
            "ckpt_phases_s": {k: round(v, 4) for k, v in self.ckpt_phases.items()},
        }


def simulate(scenario: Scenario, costs: CostModel, options: PlannerOptions | None = None) -> SimResult:
    """Plan ``scenario`` with the real planner and price it both ways under ``costs``."""
    options = (options or PlannerOptions()).model_copy(update={"bandwidth": costs})
    s = scenario
    plan = plan_model_migration(
        s.spec,
        s.old_config,
        s.old_devices,
        s.new_config,
        s.new_devices,
        failed=s.failed,
        options=options,
        ordered=s.ordered,
    )
    result = SimResult(s, plan)
    result.etc_phases = _live_phases(s, plan, costs)
    result.ckpt_phases, result.checkpoint_bytes = _checkpoint_phases(s, plan, costs)
    return result


def _rebuild_seconds(plan: MigrationPlan, costs: CostModel) -> float:
    return max(plan.need_bytes.values(), default=0) / (costs.alloc_gbps * GB)


def _alive_old(s: Scenario, plan: MigrationPlan) -> set[Device]:
    """The old devices whose processes live on (not lost to the scenario's failure)."""
    failed = set(s.failed)
    return {d for d in plan.old_assignment if d not in failed}


def _live_phases(s: Scenario, plan: MigrationPlan, costs: CostModel) -> dict[str, float]:
    alive_old = _alive_old(s, plan)
    num_processes = len(alive_old | set(plan.assignment))
    num_nodes = len({d.node for d in alive_old | set(plan.assignment)})
    local_bytes: dict[Device, int] = {}
    for copy in plan.local_copies:
        local_bytes[copy.device] = local_bytes.get(copy.device, 0) + copy.num_bytes
    joining = set(plan.assignment) - set(plan.old_assignment)
    leaving = alive_old - set(plan.assignment)
    return {
        "control_s": costs.control_s
        + costs.control_per_process_s * num_processes
        + costs.control_per_node_s * num_nodes
        + (costs.join_s if joining else 0.0)
        + (costs.leave_s if leaving else 0.0),
        "group_init_s": costs.group_init_seconds(s.new_config.world_size)
        + (costs.live_groups - 1) * costs.group_init_seconds(num_processes),
        "rebuild_s": _rebuild_seconds(plan, costs),
        "plan_s": plan.plan_seconds,
        "transfer_s": costs.etc_seconds((t.src, t.dst, t.round, t.num_bytes) for t in plan.transfers),
        "local_copy_s": max(local_bytes.values(), default=0) / (costs.copy_gbps * GB),
    }


def _checkpoint_phases(s: Scenario, plan: MigrationPlan, costs: CostModel) -> tuple[dict[str, float], int]:
    """The checkpoint way's phases and the bytes it writes and reads."""
    alive_old = _alive_old(s, plan)
    new_world = s.new_config.world_size
    save_s, written = 0.0, 0
    if s.kind == "planned":
        written = plan.state_bytes
        writer_nodes = {d.node for d in alive_old}
        write_gbps = min(len(writer_nodes) * costs.storage_write_gbps_per_node, costs.storage_aggregate_gbps)
        save_s = costs.storage_latency_s + plan.state_bytes / (write_gbps * GB)
    read_by_node: dict[str, int] = {}
    for device, need in plan.need_bytes.items():
        read_by_node[device.node] = read_by_node.get(device.node, 0) + need
    total_read = sum(read_by_node.values())
    read_s = max(
        max(read_by_node.values(), default=0) / (costs.storage_read_gbps_per_node * GB),
        total_read / (costs.storage_aggregate_read_gbps * GB),
    )
    largest_need = max(plan.need_bytes.values(), default=0)
    phases = {
        "save_s": save_s,
        "restart_s": costs.restart_seconds + costs.restart_per_process_s * new_world,
        "group_init_s": costs.group_init_seconds(new_world),
        "rebuild_s": _rebuild_seconds(plan, costs),
        "load_s": costs.storage_latency_s + read_s + largest_need / (costs.copy_gbps * GB),
    }
    return phases, written + total_read
