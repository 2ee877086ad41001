"""Run a migration inside live processes.

Call sequence (every process of old ∪ new devices calls :func:`migrate_state` together, on a
transport whose process group was created fresh for this generation):

1. describe: each process turns its old state (if it held a rank of the old layout) and its new
   state (if it holds a rank of the new one, built for that rank; tensors may be on ``meta``) into
   shard boxes;
2. exchange: one ``all_gather_object`` of the descriptions (boxes only, no data);
3. plan: every process computes the same plan from the same descriptions, with the placement fixed
   by the new ranks the processes already hold, then the plan hashes are compared across processes;
4. rounds: per round, each process packs the small pieces it sends to each peer into one buffer
   (large pieces go straight from and into the tensors when contiguous), posts all sends and
   receives with ``batch_isend_irecv``, waits (bounded), and unpacks into the new shards;
5. local: regions of new shards already resident are copied from the old shards; a new shard that
   is exactly an old one and arrives on ``meta`` takes the old tensor itself (no copy, no allocation),
   and with ``adopt_old`` one that was allocated takes the old storage over (no copy);
6. restore (only with ``read_checkpoint``): regions that no live process holds are read from the
   checkpoint by the process that needs them, alone; nothing else is read from storage.

Devices leaving after the migration only send, joining devices only receive. Every wait is
bounded by ``timeout_s`` and failures raise :class:`MigrationError` naming the peer and round.
Steps 2 and 3 live in :mod:`etc_agent.migrate.exchange`, steps 4 to 6 in :mod:`etc_agent.migrate.rounds`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from etc_agent.layout.devices import Device
from etc_agent.layout.shards import Shard
from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.exchange import (
    PlanAhead,
    PlanInputs,
    agreed,
    check_same_plan,
    description,
    exchange_descriptions,
    plan_from_descriptions,
    warm_planner,
)
from etc_agent.migrate.rounds import (
    ALIGN,
    BUFFERS,
    DIRECT_MIN_BYTES,
    TORCH_DTYPES,
    BufferPool,
    ReadCheckpoint,
    Runner,
    warm_staging,
)
from etc_agent.migrate.transport import MigrationError, TorchTransport, Transport
from etc_agent.planner.core import PlannerOptions
from etc_agent.planner.plan import MigrationPlan

# Importers of this module before the split into exchange and rounds find these here too.
__all__ = [
    "ALIGN",
    "BUFFERS",
    "DIRECT_MIN_BYTES",
    "TORCH_DTYPES",
    "BufferPool",
    "MigrationError",
    "MigrationMetrics",
    "MigrationResult",
    "migrate_state",
    "warm_migration",
]

log = logging.getLogger("etc_agent.migrate")


@dataclass
class MigrationMetrics:
    """What one migration did, seen from one process (``*_total`` fields are the whole migration)."""

    device: str
    old_rank: int | None
    new_rank: int | None
    plan_hash: str
    bytes_moved_total: int
    bytes_moved_intra_node: int
    bytes_moved_inter_node: int
    bytes_sent: int
    bytes_received: int
    bytes_copied_locally: int
    bytes_reused: int
    bytes_restored: int
    """Read by this process from the checkpoint (regions no live process held)."""
    num_messages_total: int
    num_rounds: int
    peak_buffer_bytes: int
    describe_s: float
    exchange_s: float
    plan_s: float
    check_s: float
    """Comparing the plan's hash across processes (waits for the slowest planner)."""
    setup_s: float
    """Setting up this process's part: ``on_plan``, new shards given storage, the pieces indexed."""
    local_s: float
    pack_s: float
    transfer_s: float
    """From posting each round's messages to their completion."""
    unpack_s: float
    restore_s: float
    total_s: float
    transfer_phase_s: float = 0.0
    """Slowest process's pack + transfer + unpack time (the migration's data phase)."""
    achieved_gbps: float = 0.0
    """``bytes_moved_total`` / ``transfer_phase_s``, in GB/s."""
    peer_wait_s: float = 0.0
    """After this process's data phase, until every process finished its own (the slowest receiver)."""
    planned_ahead: bool = False
    """The plan was made before the stall (:class:`~etc_agent.migrate.exchange.PlanAhead`): no
    planning and no hash check in it (``plan_s`` and ``check_s`` ~0)."""

    def to_json(self) -> dict[str, Any]:
        return {"event": "migration", **asdict(self)}


@dataclass
class MigrationResult:
    plan: MigrationPlan
    metrics: MigrationMetrics
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The new state's tensors by flattened key (materialized ones included)."""


def migrate_state(
    old_state: Mapping[str, Any] | None,
    new_state: Mapping[str, Any] | None,
    *,
    device: Device,
    old_rank: int | None,
    new_rank: int | None,
    transport: Transport | None = None,
    tp: int = 1,
    options: PlannerOptions | None = None,
    failed: Sequence[Device] = (),
    lost_old_ranks: Mapping[int, tuple[Device, list[Shard]]] | None = None,
    timeout_s: float = 300.0,
    buffer_device: torch.device | None = None,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    read_checkpoint: Callable[[list[tuple[str, tuple[int, ...], torch.Tensor]]], None] | None = None,
    on_plan: Callable[[MigrationPlan], None] | None = None,
    same_keys: Mapping[str, Sequence[int]] | None = None,
    adopt_old: bool = False,
    ahead: PlanAhead | None = None,
) -> MigrationResult:
    """Move ``old_state`` (this process's shards of the old layout, if any) into ``new_state``.

    ``device`` names this process's device (``node:local``); ``old_rank``/``new_rank`` are its ranks in
    the old and new layouts (None when it has none). ``lost_old_ranks`` describes old ranks whose
    process is gone (their devices must be in ``failed``). ``tp`` is the new layout's TP size.
    ``direct_min_bytes``: pieces at least this big go on the wire on their own, without packing.
    ``read_checkpoint``: given on every process or on none; with it, what no live process holds is
    planned as reads (``(key, global offsets, contiguous out)`` boxes) instead of raising
    :class:`~etc_agent.planner.core.StateLostError`. ``on_plan`` sees the checked plan before anything moves.
    ``same_keys``: named groups of new ranks that must all hold the same tensors (a pipeline stage),
    except ZeRO flat ranges, which may leave a rank without a key; a ``ValueError`` names the key and
    the ranks without it, on every process, before anything moves.
    ``adopt_old``: the caller drops ``old_state`` afterwards and nothing else writes to it, so a new
    shard that is exactly an old one (same box, both tensors owning their storage) takes the old
    storage over instead of a copy (``bytes_reused``); the old tensor then shares it.
    ``ahead``: a plan made before the stall (:class:`~etc_agent.migrate.exchange.PlanAhead`); used,
    without planning or hash check, when every process votes for it with the descriptions.
    """
    started = time.perf_counter()
    transport = transport or TorchTransport()
    old_local = describe_state(old_state) if old_rank is not None else []
    new_local = describe_state(new_state) if new_rank is not None else []
    mine = description(device, old_rank, new_rank, old_local, new_local)
    if read_checkpoint is not None:
        options = (options or PlannerOptions()).model_copy(update={"restore_lost": True})
    inputs = PlanInputs(tp, options, tuple(failed), lost_old_ranks or {}, same_keys or {})
    described = time.perf_counter()
    descriptions = exchange_descriptions(transport, mine, ahead.vote_for(mine, inputs.digest()) if ahead else None)
    exchanged = time.perf_counter()
    used = agreed(descriptions, ahead)
    plan, peer_of, names, planned, checked = _plan(transport, device, descriptions, used, inputs)
    if on_plan is not None:
        on_plan(plan)
    runner = Runner(plan, device, old_local, new_local, buffer_device, direct_min_bytes, adopt_old)
    set_up = time.perf_counter()
    _move(runner, transport, peer_of, names, timeout_s, read_checkpoint)
    marks = (started, described, exchanged, planned, checked, set_up)
    metrics = _finish(runner, transport, old_rank, new_rank, marks, planned_ahead=used is not None)
    return MigrationResult(plan, metrics, runner.tensors)


def _plan(
    transport: Transport,
    device: Device,
    descriptions: list[dict[str, Any]],
    agreed_ahead: PlanAhead | None,
    inputs: PlanInputs,
) -> tuple[MigrationPlan, dict[Device, int], dict[int, str], float, float]:
    """The plan every process agreed on ahead, or the plan from the descriptions and ``inputs``
    with its hash checked across processes (collective); with the ``perf_counter`` readings after
    planning and after the check."""
    if agreed_ahead is not None:  # every process holds this plan, unchanged: no planning, no hash check
        now = time.perf_counter()
        return agreed_ahead.plan, agreed_ahead.peer_of, agreed_ahead.names, now, now
    plan, peer_of, names = plan_from_descriptions(descriptions, inputs)
    planned = time.perf_counter()
    check_same_plan(transport, plan, names, device)
    return plan, peer_of, names, planned, time.perf_counter()


def warm_migration(device: torch.device) -> None:
    """Pay a process's first-migration costs ahead, outside any stall: the planner's first use
    (:func:`~etc_agent.migrate.exchange.warm_planner`) and one resident staging arena on ``device``
    (:func:`~etc_agent.migrate.rounds.warm_staging`). The worker calls it as the job starts, a warm
    spare before it is adopted."""
    warm_planner()
    warm_staging(device)


def _finish(
    runner: Runner,
    transport: Transport,
    old_rank: int | None,
    new_rank: int | None,
    marks: tuple[float, ...],
    planned_ahead: bool,
) -> MigrationMetrics:
    """This process's metrics, with the slowest process's data phase (collective) and the wait for it."""
    metrics = _metrics(runner, old_rank, new_rank, marks)
    metrics.planned_ahead = planned_ahead
    moved = time.perf_counter()
    _gather_transfer_phase(metrics, runner, transport)
    metrics.peer_wait_s = time.perf_counter() - moved
    log.info(json.dumps(metrics.to_json()))
    return metrics


def _move(
    runner: Runner,
    transport: Transport,
    peer_of: dict[Device, int],
    names: dict[int, str],
    timeout_s: float,
    read_checkpoint: ReadCheckpoint | None,
) -> None:
    """The data phase: the rounds, the local copies, then the restores (with a checkpoint to read)."""
    with torch.no_grad():
        runner.run(transport, peer_of, names, timeout_s)
        if runner.plan.restores:
            assert read_checkpoint is not None, "restores are planned only with a checkpoint to read"
            runner.restore(read_checkpoint)


def _metrics(runner: Runner, old_rank: int | None, new_rank: int | None, marks: tuple[float, ...]) -> MigrationMetrics:
    """This process's metrics; ``marks`` are the ``perf_counter`` readings at the start and after the
    describe, exchange, plan, hash check and setup steps."""
    started, described, exchanged, planned, checked, set_up = marks
    plan = runner.plan
    inter = plan.bytes_moved_inter_node
    return MigrationMetrics(
        device=str(runner.device),
        old_rank=old_rank,
        new_rank=new_rank,
        plan_hash=plan.plan_hash,
        bytes_moved_total=plan.bytes_moved,
        bytes_moved_intra_node=plan.bytes_moved - inter,
        bytes_moved_inter_node=inter,
        bytes_sent=runner.bytes_sent,
        bytes_received=runner.bytes_received,
        bytes_copied_locally=runner.bytes_copied,
        bytes_reused=runner.bytes_reused,
        bytes_restored=runner.bytes_restored,
        num_messages_total=plan.num_messages,
        num_rounds=plan.num_rounds,
        peak_buffer_bytes=runner.peak_buffer_bytes,
        describe_s=described - started,
        exchange_s=exchanged - described,
        plan_s=planned - exchanged,
        check_s=checked - planned,
        setup_s=set_up - checked,
        local_s=runner.local_s,
        pack_s=runner.pack_s,
        transfer_s=runner.transfer_s,
        unpack_s=runner.unpack_s,
        restore_s=runner.restore_s,
        total_s=time.perf_counter() - started,
    )


def _gather_transfer_phase(metrics: MigrationMetrics, runner: Runner, transport: Transport) -> None:
    """Fill in the slowest process's data phase and the rate it gives: one ``all_gather_object``,
    which every process calls."""
    phases = transport.all_gather_object(runner.pack_s + runner.transfer_s + runner.unpack_s)
    metrics.transfer_phase_s = max(phases)
    bytes_moved = runner.plan.bytes_moved
    metrics.achieved_gbps = bytes_moved / metrics.transfer_phase_s / 1e9 if metrics.transfer_phase_s > 0 else 0.0
