"""The migration record: each process's phase times gathered, new rank 0 builds one
:class:`~etc_agent.rendezvous.records.MigrationRecord` (validated here, before it is sent).

Call sequence: every process of the generation (members and senders) calls :func:`live_record` or
:func:`checkpoint_record` after its part of the switch (one ``all_gather_object`` over the
migration group); only new rank 0 gets a record back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import prod

from etc_agent.layout.config import ParallelConfig
from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.executor import MigrationResult
from etc_agent.migrate.transport import Transport
from etc_agent.protocol.control import Assignment
from etc_agent.rendezvous.records import MigrationRecord, StallParts


@dataclass(frozen=True)
class Stopped:
    """When this process stopped training (both clocks: wall for across processes, perf for durations)."""

    wall: float
    perf: float

    @classmethod
    def now(cls) -> Stopped:
        return cls(time.time(), time.perf_counter())


@dataclass(frozen=True)
class MigrationTimes:
    """The named parts of the migration step of one process's switch (the executor's metrics)."""

    describe_s: float = 0.0
    """Describing the state and exchanging the descriptions."""
    plan_s: float = 0.0
    transfer_s: float = 0.0
    """This process's data phase: pack, send/receive, unpack (the local copies made meanwhile not included)."""
    local_copy_s: float = 0.0
    plan_check_s: float = 0.0
    setup_s: float = 0.0
    peer_wait_s: float = 0.0

    @classmethod
    def of(cls, result: MigrationResult | None) -> MigrationTimes:
        if result is None:
            return cls()
        m = result.metrics
        return cls(
            m.describe_s + m.exchange_s,
            m.plan_s,
            m.pack_s + m.transfer_s + m.unpack_s,
            m.local_s,
            m.check_s,
            m.setup_s,
            m.peer_wait_s,
        )


@dataclass
class Clocks:
    """``perf_counter`` marks of one process's switch, in the order they happen: entered (the
    assignment in hand), arrived at the generation's store, migration group formed, training group
    formed, state built, versions exchanged, data moved. A mark not reached stays 0. A generation
    prepared while training (:mod:`etc_agent.worker.prepare`) was arrived at and its migration
    group formed before the stop: those marks equal ``started``."""

    started: float
    grouped: float
    built: float
    arrived: float = 0.0
    migration_grouped: float = 0.0
    exchanged: float = 0.0
    migrated: float = 0.0
    prepared: bool = False
    """Arrived and migration group formed while training."""
    built_ahead: bool = False
    """Training groups formed and state built while training (``grouped`` and ``built`` then follow
    the migration group at once)."""
    touched_ahead: int = 0
    """Bytes of the new state made resident before the data phase (:func:`etc_agent.worker.member.touch_new_shards`):
    by the preparation, or in the background of the switch (:class:`etc_agent.worker.member.ResidentPages`)."""

    def parts(self, stopped: float, migration: MigrationTimes, now: float) -> dict[str, float]:
        """This process's stall from ``stopped`` to ``now`` in named parts (the fields of
        :class:`~etc_agent.rendezvous.records.StallParts`), consecutive marks, so that they add up."""
        marks = [
            ("stop_s", stopped),
            ("arrive_s", self.started),
            ("migration_group_s", self.arrived or self.started),
            ("group_s", self.migration_grouped or self.arrived or self.started),
            ("build_s", self.grouped),
            ("exchange_s", self.built),
            ("migrate_s", self.exchanged or self.built),
            ("settle_s", self.migrated or now),
        ]
        out = {}
        for (name, begin), (_, end) in zip(marks, [*marks[1:], ("", now)], strict=True):
            out[name] = max(0.0, end - begin)
        migrate = out.pop("migrate_s")
        named = {
            "describe_s": migration.describe_s,
            "plan_s": migration.plan_s,
            "transfer_s": migration.transfer_s,
            "local_copy_s": migration.local_copy_s,
            "plan_check_s": migration.plan_check_s,
            "setup_s": migration.setup_s,
            "peer_wait_s": migration.peer_wait_s,
        }
        out.update(named)
        out["migrate_other_s"] = max(0.0, migrate - sum(named.values()))
        out["unaccounted_s"] = max(0.0, (now - stopped) - sum(out.values()))
        return {name: round(value, 4) for name, value in out.items()}


def live_record(
    transport: Transport,
    assignment: Assignment,
    new_config: str,
    step: int,
    source_config: str | None,
    result: MigrationResult | None,
    lost: list[str],
    stopped: Stopped | None,
    clocks: Clocks,
    failure: bool,
    restored_from: str | None,
    redone: int,
) -> MigrationRecord | None:
    """A live migration's record (collective; new rank 0 gets it, None elsewhere or when nothing migrated)."""
    mine = {**_phase_times(result, stopped, clocks), "failure": failure}
    everyone = transport.all_gather_object(mine)
    if result is None or assignment.rank != 0:
        return None
    # A migration result comes with the layout it started from (Migration._migrate_from).
    assert source_config is not None
    stops, published = [e["stop_wall"] for e in everyone if e["stop_wall"] is not None], assignment.published_at
    # After a failure the survivors stopped before the leader published (detection is publish minus
    # the first stop); a planned change is published first (detection is the last stop minus
    # publish). Any process's flag counts: a replacement that becomes rank 0 saw no failure itself.
    after_failure = any(e["failure"] for e in everyone)
    detect = (published - min(stops) if after_failure else max(stops) - published) if stops else 0.0
    plan = result.plan
    return MigrationRecord(
        generation=assignment.generation,
        old_config=source_config,
        new_config=new_config,
        old_world_size=ParallelConfig.parse(source_config).world_size,
        new_world_size=assignment.world_size,
        devices=assignment.member_devices,
        senders=assignment.sender_devices,
        lost=lost,
        reason=assignment.reason,
        step=step,
        bytes_moved=plan.bytes_moved,
        bytes_moved_intra_node=plan.bytes_moved - plan.bytes_moved_inter_node,
        bytes_moved_inter_node=plan.bytes_moved_inter_node,
        bytes_reused=sum(e["kept"] for e in everyone),
        state_bytes=plan.state_bytes,
        checkpoint_bytes=plan.checkpoint_bytes,
        bytes_restored=plan.bytes_restored,
        restored_from=restored_from,
        redone_steps=redone,
        detect_s=round(max(detect, 0.0), 4),
        leave_spread_s=round(max(stops) - min(stops), 4) if after_failure and stops else None,
        agree_s=round(_worst(everyone, "agree"), 4),
        rebuild_s=round(_worst(everyone, "rebuild"), 4),
        plan_s=round(_worst(everyone, "plan"), 4),
        transfer_s=round(_worst(everyone, "transfer"), 4),
        inter_node_gbit_s=_gbit_s(plan.bytes_moved_inter_node, _worst(everyone, "transfer")),
        total_stall_s=round(_worst(everyone, "stall"), 4),
        **_done_ahead(everyone),
        planned_ahead=result.metrics.planned_ahead,
        stall_parts=_slowest_parts(everyone),
    )


def _done_ahead(everyone: list[dict]) -> dict[str, int]:
    """The record's counts of what was done before the data phase (see :class:`MigrationRecord`)."""
    return {
        "num_prepared": sum(e["prepared"] for e in everyone),
        "num_built_ahead": sum(e["built_ahead"] for e in everyone),
        "bytes_touched_ahead": sum(e["touched_ahead"] for e in everyone),
    }


def _slowest_parts(everyone: list[dict]) -> StallParts | None:
    """The named parts of the stall of the process that stalled longest (they add up to its stall)."""
    stalled = [e for e in everyone if e["stall"] is not None and e.get("parts") is not None]
    if not stalled:
        return None
    return StallParts(**max(stalled, key=lambda e: e["stall"])["parts"])


def _gbit_s(num_bytes: int, seconds: float) -> float | None:
    """``num_bytes`` over ``seconds`` in Gbit/s, as links are rated (None: nothing moved, or no time)."""
    return round(num_bytes * 8 / seconds / 1e9, 4) if num_bytes and seconds > 0 else None


def _worst(everyone: list[dict], name: str) -> float:
    """The longest ``name`` phase time any process reported (0 when none did)."""
    values = [e[name] for e in everyone if e[name] is not None]
    return max(values) if values else 0.0


def _phase_times(result: MigrationResult | None, stopped: Stopped | None, clocks: Clocks) -> dict:
    """This process's part of a live record: its stall, phase times and bytes kept in place."""
    now = time.perf_counter()
    times = MigrationTimes.of(result)
    return {
        "stop_wall": stopped.wall if stopped else None,
        "stall": (now - stopped.perf) if stopped else None,
        "parts": clocks.parts(stopped.perf, times, now) if stopped else None,
        "prepared": clocks.prepared,
        "built_ahead": clocks.built_ahead,
        "touched_ahead": clocks.touched_ahead,
        "agree": (clocks.grouped - stopped.perf) if stopped else None,
        "rebuild": clocks.built - clocks.grouped,
        "plan": times.plan_s,
        "transfer": result.metrics.transfer_phase_s if result else 0.0,
        "kept": (result.metrics.bytes_reused + result.metrics.bytes_copied_locally) if result else 0,
    }


def checkpoint_record(
    transport: Transport,
    assignment: Assignment,
    new_config: str,
    step: int,
    meta: dict,
    clocks: Clocks,
    new_tensors: dict,
) -> MigrationRecord | None:
    """The baseline's record: stall from the old workers' stop to this resume (one clock: one machine
    here; across machines the wall clocks must agree). Collective over the new world."""
    shards = describe_state(new_tensors)
    read = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
    sizes = {s.shard.key: prod(s.shard.global_shape) * s.tensor.element_size() for s in shards}
    mine = {
        "read": read,
        "sizes": sizes,
        "load": meta["load_s"],
        "rebuild": clocks.built - clocks.grouped,
        "group_wall": time.time() - (time.perf_counter() - clocks.grouped),
    }
    everyone = transport.all_gather_object(mine)
    if assignment.rank != 0:
        return None
    stopped = meta["stopped_at"]
    moved = meta["written_bytes"] + sum(e["read"] for e in everyone)
    unique = sum({k: v for e in everyone for k, v in e["sizes"].items()}.values())
    return MigrationRecord(
        generation=assignment.generation,
        method="checkpoint",
        old_config=meta["config"],
        new_config=new_config,
        old_world_size=ParallelConfig.parse(meta["config"]).world_size,
        new_world_size=assignment.world_size,
        devices=assignment.member_devices,
        reason=assignment.reason,
        step=step,
        bytes_moved=moved,
        bytes_moved_intra_node=0,
        bytes_moved_inter_node=moved,
        state_bytes=unique,
        checkpoint_bytes=moved,
        bytes_restored=sum(e["read"] for e in everyone),
        restored_from=str(meta.get("path")) if meta.get("path") else None,
        checkpoint_api=meta["checkpoint_api"],
        detect_s=round(max(stopped - assignment.published_at, 0.0), 4),
        agree_s=round(max(e["group_wall"] for e in everyone) - stopped - meta["save_s"], 4),
        rebuild_s=round(max(e["rebuild"] for e in everyone), 4),
        plan_s=0.0,
        transfer_s=round(meta["save_s"] + max(e["load"] for e in everyone), 4),
        total_stall_s=round(time.time() - stopped, 4),
    )
