"""``etc-agent plan``: a migration between two parallel configurations, planned by the real planner
and shown as tables (:mod:`~etc_agent.cli.report`) or one JSON object, optionally with a heatmap;
``--to auto`` lets the policy choose the new configuration first."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from etc_agent.cli._entry import UserError, check_output
from etc_agent.cli.options import Cli, build_model, flags_command, model_options
from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.model import ModelSpec

if TYPE_CHECKING:
    from etc_agent.planner.core import PlannerOptions
    from etc_agent.planner.plan import MigrationPlan
    from etc_agent.planner.policy import PolicyDecision

GiB = 1 << 30


def parse_failed(text: str | None, old_devices: DeviceSet) -> list[Device]:
    """``n1`` (every old device of node n1) or ``n1:3`` items, comma separated."""
    if not text:
        return []
    out: list[Device] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if ":" in item:
            device = Device.parse(item)
            if device not in old_devices:
                raise ValueError(f"--failed {item}: not in the old device set {old_devices.short()}")
            out.append(device)
        else:
            devices = old_devices.node_devices(item)
            if not devices:
                raise ValueError(f"--failed {item}: no node of that name in the old device set {old_devices.short()}")
            out += devices
    return list(dict.fromkeys(out))


def _bandwidth_model() -> type[BaseModel]:
    from etc_agent.planner.bandwidth import BandwidthModel

    return BandwidthModel


class PlanFlags(BaseModel):
    """What ``etc-agent plan`` is asked, in the order ``--help`` lists it (:func:`flags_command`)."""

    model_config = ConfigDict(extra="forbid")

    model: Path = Field(description="Model spec YAML (configs/models/*.yaml).")
    from_: Annotated[str, Cli(names=("--from",))] = Field(
        description="Current parallel config, e.g. tp=4,pp=2,dp=2,zero=1."
    )
    old: str = Field(description="Current devices, e.g. n0:8,n1:8 (old rank r runs on the r-th).")
    to: str = Field(description="New parallel config, or 'auto' to let the policy choose.")
    new: str = Field(description="New devices, e.g. n0:8 or n0:[0-2,4-7].")
    failed: str | None = Field(None, description="Old devices or nodes whose state is lost (crash), e.g. n1 or n0:3.")
    json_out: Annotated[bool, Cli(names=("--json",))] = Field(
        False, description="Print one JSON object instead of tables."
    )
    plot: Path | None = Field(None, description="Write a PNG heatmap of bytes between nodes/devices.")
    mem_cap_gib: Annotated[float, Cli(names=("--mem-cap",))] = Field(
        2.0, description="GiB of send and of receive buffers per device and round."
    )
    max_messages: Annotated[int, Cli(names=("--max-messages-per-round",))] = Field(
        64, description="Messages a device sends (and receives) per round."
    )
    device_memory_gib: float = Field(80.0, description="Device memory, for --to auto.")
    seq_length: int = Field(2048, description="Sequence length, for --to auto.")
    micro_batch_size: int = Field(1, description="Micro-batch size, for --to auto.")
    global_batch_size: int = Field(512, description="Global batch size, for --to auto.")
    placement: str = Field(
        "fast",
        description="fast (the default, as etcrun's): fewest bytes moved, copies spread "
        "over nodes where that costs nothing (the report says what a node loss would lose and "
        "what the resilient placement would move to avoid it); resilient: spread the copies of "
        "every shard over nodes first, then move the fewest bytes.",
    )


@dataclass(frozen=True)
class PlanInputs:
    """The model and the old side of the migration, read and checked."""

    spec: ModelSpec
    old_config: ParallelConfig
    old_devices: DeviceSet
    new_devices: DeviceSet
    failed: list[Device]


@model_options(
    _bandwidth_model(), "bandwidth_flags", panel="Bandwidth model for the estimates (GB/s = 1e9 bytes/s per direction)"
)
@flags_command(PlanFlags, "flags")
def plan(flags: PlanFlags, bandwidth_flags: dict | None = None) -> None:
    """Plan a migration between two parallel configurations and show what it moves."""
    from etc_agent.cli.report import plot_heatmap, policy_table, print_plan

    if flags.plot is not None:
        check_output(flags.plot, "--plot")
    inputs = _read_inputs(flags)
    options = _planner_options(flags, bandwidth_flags or {})
    new_config, decision = _new_config(flags, inputs, options)
    result = _plan_with_advice(inputs, new_config, options)
    if flags.plot is not None:
        plot_heatmap(result, flags.plot)
    if flags.json_out:
        sys.stdout.write(json.dumps(_plan_json(result, decision)) + "\n")
        return
    console = Console(stderr=False)
    if decision is not None:
        console.print(policy_table(decision))
    print_plan(console, result)
    if flags.plot is not None:
        console.print(f"heatmap written to {flags.plot}")


def _read_inputs(flags: PlanFlags) -> PlanInputs:
    spec = ModelSpec.from_yaml(flags.model)
    old_config = ParallelConfig.parse(flags.from_)
    old_devices = DeviceSet.parse(flags.old)
    new_devices = DeviceSet.parse(flags.new)
    old_config.check_world_size(len(old_devices))
    spec.check_parallel(old_config)
    failed = parse_failed(flags.failed, old_devices)
    return PlanInputs(spec, old_config, old_devices, new_devices, failed)


def _planner_options(flags: PlanFlags, bandwidth_flags: dict[str, Any]) -> PlannerOptions:
    from etc_agent.planner.bandwidth import BandwidthModel
    from etc_agent.planner.core import PlannerOptions

    if flags.mem_cap_gib <= 0:
        raise UserError(f"--mem-cap must be positive, got {flags.mem_cap_gib}")
    bandwidth = build_model(BandwidthModel, bandwidth_flags)
    if flags.placement not in ("fast", "resilient"):
        raise UserError(f"--placement {flags.placement!r}: use fast or resilient")
    return PlannerOptions(
        mem_cap_bytes=int(flags.mem_cap_gib * GiB),
        max_messages_per_round=flags.max_messages,
        bandwidth=bandwidth,
        placement=flags.placement,
    )


def _new_config(
    flags: PlanFlags, inputs: PlanInputs, options: PlannerOptions
) -> tuple[ParallelConfig, PolicyDecision | None]:
    """``--to``, or with ``--to auto`` the policy's choice and its decision."""
    from etc_agent.planner.policy import PolicyOptions, choose_config

    if flags.to.strip() != "auto":
        new_config = ParallelConfig.parse(flags.to)
        new_config.check_world_size(len(inputs.new_devices))
        inputs.spec.check_parallel(new_config)
        return new_config, None
    policy = PolicyOptions(
        device_memory_gib=flags.device_memory_gib,
        seq_length=flags.seq_length,
        micro_batch_size=flags.micro_batch_size,
        global_batch_size=flags.global_batch_size,
        intra_node_gbps=options.bandwidth.intra_node_gbps,
        inter_node_gbps=options.bandwidth.inter_node_gbps,
    )
    decision = choose_config(
        inputs.spec,
        inputs.new_devices,
        policy,
        old_config=inputs.old_config,
        old_devices=inputs.old_devices,
        failed=inputs.failed,
        planner_options=options,
    )
    return decision.winner.config, decision


def _plan_with_advice(inputs: PlanInputs, new_config: ParallelConfig, options: PlannerOptions) -> MigrationPlan:
    """The plan; under the fast placement, with what the resilient one would move to keep every
    shard's copies off a single node where the fast one does not."""
    from etc_agent.planner.core import plan_model_migration, resilience_advice

    def plan_with(options: PlannerOptions) -> MigrationPlan:
        return plan_model_migration(
            inputs.spec,
            inputs.old_config,
            inputs.old_devices,
            new_config,
            inputs.new_devices,
            failed=inputs.failed,
            options=options,
        )

    result = plan_with(options)
    domains = result.failure_domains
    if (
        options.placement == "fast"
        and domains
        and domains["single_domain_bytes"] > domains["unavoidable_single_domain_bytes"]
    ):
        resilient = plan_with(options.model_copy(update={"placement": "resilient"}))
        result.resilient_alternative = resilience_advice(result, resilient)
    return result


def _plan_json(result: MigrationPlan, decision: PolicyDecision | None) -> dict[str, Any]:
    data = result.to_json()
    if decision is not None:
        data["policy"] = {
            "reason": decision.reason,
            "candidates": [
                {
                    "config": c.config.short(),
                    "memory_bytes": c.memory_bytes,
                    "step_seconds": c.step_seconds,
                    "fits": c.fits,
                    "bytes_moved": c.bytes_moved,
                    "migration_seconds": c.migration_seconds,
                }
                for c in decision.candidates
            ],
        }
    return data
