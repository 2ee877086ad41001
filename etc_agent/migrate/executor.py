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
   is exactly an old one and arrives on ``meta`` takes the old tensor itself (no copy, no allocation);
6. restore (only with ``read_checkpoint``): regions that no live process holds are read from the
   checkpoint by the process that needs them, alone; nothing else is read from storage.

Devices leaving after the migration only send, joining devices only receive. Every wait is
bounded by ``timeout_s`` and failures raise :class:`MigrationError` naming the peer and round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

import torch

from etc_agent.layout.devices import Device
from etc_agent.layout.shards import Shard, StateLayout
from etc_agent.migrate.describe import LocalShard, describe_state
from etc_agent.migrate.transport import MigrationError, TorchTransport, Transport
from etc_agent.planner.core import PlannerOptions, plan_migration
from etc_agent.planner.plan import MigrationPlan, Region, Transfer

log = logging.getLogger("etc_agent.migrate")

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
}
ALIGN = 16
DIRECT_MIN_BYTES = 256 << 10
"""(region, key) pieces at least this big travel as their own message, straight from the sender's
tensor and into the receiver's when those views are contiguous; smaller ones are packed together."""


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

    def to_json(self) -> dict[str, Any]:
        return {"event": "migration", **asdict(self)}


@dataclass
class MigrationResult:
    plan: MigrationPlan
    metrics: MigrationMetrics
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The new state's tensors by flattened key (materialized ones included)."""


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
    """
    started = time.perf_counter()
    transport = transport or TorchTransport()
    old_local = describe_state(old_state) if old_rank is not None else []
    new_local = describe_state(new_state) if new_rank is not None else []
    t_describe = time.perf_counter()

    payload = {
        "device": str(device),
        "old_rank": old_rank,
        "new_rank": new_rank,
        "old": _to_wire(old_local),
        "new": _to_wire(new_local),
    }
    descriptions = transport.all_gather_object(payload)
    t_exchange = time.perf_counter()

    if read_checkpoint is not None:
        options = (options or PlannerOptions()).model_copy(update={"restore_lost": True})
    plan, peer_of, names = _plan(descriptions, tp, options, failed, lost_old_ranks or {}, same_keys or {})
    t_plan = time.perf_counter()
    hashes = transport.all_gather_object(plan.plan_hash)
    if len(set(hashes)) != 1:
        differing = [names[r] for r, h in enumerate(hashes) if h != plan.plan_hash]
        raise MigrationError(
            f"plan hash mismatch: {plan.plan_hash} here on {device}, different on {', '.join(differing)}"
        )

    if on_plan is not None:
        on_plan(plan)
    runner = _Runner(plan, device, old_local, new_local, buffer_device, direct_min_bytes)
    with torch.no_grad():
        runner.run(transport, peer_of, names, timeout_s)
        if plan.restores:
            assert read_checkpoint is not None, "restores are planned only with a checkpoint to read"
            runner.restore(read_checkpoint)

    inter = plan.bytes_moved_inter_node
    metrics = MigrationMetrics(
        device=str(device),
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
        describe_s=t_describe - started,
        exchange_s=t_exchange - t_describe,
        plan_s=t_plan - t_exchange,
        local_s=runner.local_s,
        pack_s=runner.pack_s,
        transfer_s=runner.transfer_s,
        unpack_s=runner.unpack_s,
        restore_s=runner.restore_s,
        total_s=time.perf_counter() - started,
    )
    phases = transport.all_gather_object(runner.pack_s + runner.transfer_s + runner.unpack_s)
    metrics.transfer_phase_s = max(phases)
    metrics.achieved_gbps = plan.bytes_moved / metrics.transfer_phase_s / 1e9 if metrics.transfer_phase_s > 0 else 0.0
    log.info(json.dumps(metrics.to_json()))
    return MigrationResult(plan, metrics, runner.tensors)


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


def _plan(
    descriptions, tp, options, failed, lost_old_ranks, same_keys
) -> tuple[MigrationPlan, dict[Device, int], dict[int, str]]:
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


@dataclass(frozen=True)
class _Chunk:
    region: Region
    key: str
    dtype: torch.dtype
    offset: int
    """Byte offset in the message's packed buffer, or -1 for a piece sent on its own."""
    nbytes: int


def _chunks(transfer: Transfer, plan: MigrationPlan, direct_min_bytes: int) -> tuple[list[_Chunk], int]:
    """How one planned message goes on the wire: its pieces and the size of its packed buffer.

    Sender and receiver compute this from the plan alone, so they agree on every wire message.
    """
    out, pos = [], 0
    for region in transfer.regions:
        group = plan.groups[region.group]
        numel = prod(region.lengths)
        for key, dtype_name in zip(group.keys, group.dtypes):
            dtype = TORCH_DTYPES[dtype_name]
            nbytes = numel * dtype.itemsize
            if nbytes >= direct_min_bytes:
                out.append(_Chunk(region, key, dtype, -1, nbytes))
            else:
                out.append(_Chunk(region, key, dtype, pos, nbytes))
                pos += -(-nbytes // ALIGN) * ALIGN  # aligned so every chunk can be viewed as its dtype
    return out, pos


class BufferPool:
    """Staging memory reused across rounds and migrations.

    Fresh host allocations pay a page fault per 4 KiB on first touch (~1.3 GB/s here), as much as
    the copy itself; keeping the arena avoids that from the second migration on. Holds at most what
    one round stages (bounded by the plan's memory cap, per direction).
    """

    def __init__(self) -> None:
        self.arenas: list[torch.Tensor] = []
        self.used = 0

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        size = -(-nbytes // ALIGN) * ALIGN
        arena = self.arenas[-1] if self.arenas else None
        if arena is None or arena.device != device or self.used + size > arena.numel():
            arena = torch.empty(max(size, 64 << 20), dtype=torch.uint8, device=device)
            self.arenas.append(arena)
            self.used = 0
        view = arena[self.used : self.used + nbytes]
        self.used += size
        return view

    def release(self) -> None:
        """End of a round: everything handed out is free again; keep one arena as big as the round needed."""
        if len(self.arenas) > 1:
            total = sum(a.numel() for a in self.arenas)
            device = self.arenas[-1].device
            self.arenas = [torch.empty(total, dtype=torch.uint8, device=device)]
        self.used = 0


BUFFERS = BufferPool()


class _Runner:
    def __init__(
        self,
        plan: MigrationPlan,
        device: Device,
        old_local: list[LocalShard],
        new_local: list[LocalShard],
        buffer_device,
        direct_min_bytes: int,
    ):
        self.plan, self.device, self.direct_min_bytes = plan, device, direct_min_bytes
        self.old_by_key: dict[str, list[LocalShard]] = {}
        for ls in old_local:
            self.old_by_key.setdefault(ls.shard.key, []).append(ls)
        self.new_by_key: dict[str, list[LocalShard]] = {}
        for ls in new_local:
            self.new_by_key.setdefault(ls.shard.key, []).append(ls)
        example = next((ls.tensor for ls in old_local + new_local if not ls.tensor.is_meta), None)
        self.buffer_device = buffer_device or (example.device if example is not None else torch.device("cpu"))
        self.bytes_sent = self.bytes_received = self.bytes_copied = self.bytes_reused = self.bytes_restored = 0
        self.peak_buffer_bytes = 0
        self.pack_s = self.transfer_s = self.unpack_s = self.local_s = self.restore_s = 0.0
        self.tensors: dict[str, torch.Tensor] = {}
        self._materialize()

    def _materialize(self) -> None:
        """Give ``meta`` new shards storage: the identical old tensor when there is one, else empty."""
        for key, shards in self.new_by_key.items():
            for ls in shards:
                if ls.tensor.is_meta:
                    twin = next((o for o in self.old_by_key.get(key, []) if o.shard == ls.shard), None)
                    if twin is not None:
                        ls.tensor = twin.tensor
                        self.bytes_reused += ls.shard.nbytes
                    else:
                        shape = (ls.shard.numel,) if ls.shard.flat_range else ls.shard.lengths
                        ls.tensor = torch.empty(shape, dtype=TORCH_DTYPES[ls.shard.dtype], device=self.buffer_device)
                self.tensors[key] = ls.tensor

    @staticmethod
    def _find(shards: list[LocalShard] | None, key: str, region: Region, where: str) -> torch.Tensor:
        for ls in shards or []:
            try:
                return ls.region_view(region.offsets, region.lengths)
            except ValueError:
                continue  # another shard of this key (rare: several per rank) may hold it
        raise MigrationError(f"{where}: no local shard of {key} holds region {region.offsets}/{region.lengths}")

    def local_copies(self) -> None:
        for copy in self.plan.local_copies:
            if copy.device != self.device:
                continue
            for region in copy.regions:
                for key in self.plan.groups[region.group].keys:
                    src = self._find(self.old_by_key.get(key), key, region, f"local copy on {self.device}")
                    dst = self._find(self.new_by_key.get(key), key, region, f"local copy on {self.device}")
                    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride():
                        continue  # already there (reused old tensor)
                    dst.copy_(src)
                    self.bytes_copied += src.numel() * src.element_size()

    def restore(self, read_checkpoint) -> None:
        """Read this device's planned restores, straight into the new shards where they are contiguous."""
        started = time.perf_counter()
        requests, scatter = [], []
        for restore in self.plan.restores:
            if restore.device != self.device:
                continue
            for region in restore.regions:
                for key in self.plan.groups[region.group].keys:
                    dst = self._find(self.new_by_key.get(key), key, region, f"restore on {self.device}")
                    out = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
                    requests.append((key, region.offsets, out.view(region.lengths)))
                    if out is not dst:
                        scatter.append((out, dst))
                    self.bytes_restored += dst.numel() * dst.element_size()
        read_checkpoint(requests)
        for out, dst in scatter:
            dst.copy_(out)
        self.restore_s = time.perf_counter() - started

    def run(self, transport: Transport, peer_of: dict[Device, int], names: dict[int, str], timeout_s: float) -> None:
        """The rounds first (every process reaches them at about the same time, right after planning,
        so nobody waits on a peer's local copying), then the local copies."""
        self.rounds(transport, peer_of, names, timeout_s)
        started = time.perf_counter()
        self.local_copies()
        self.local_s = time.perf_counter() - started

    def rounds(self, transport: Transport, peer_of: dict[Device, int], names: dict[int, str], timeout_s: float) -> None:
        by_round: dict[int, list[Transfer]] = {}
        for t in self.plan.transfers:
            if t.src == self.device or t.dst == self.device:
                by_round.setdefault(t.round, []).append(t)
        pool = BUFFERS
        by_tag = getattr(transport, "matches_by_tag", False)
        for round_index in range(self.plan.num_rounds):
            ready: list[tuple[int, torch.Tensor, int]] = []  # sends straight from a tensor
            later: list[
                tuple[int, torch.Tensor, int, torch.Tensor | None]
            ] = []  # (peer, buffer, tag, source or None if packed)
            packs: list[tuple[torch.Tensor, list[tuple[_Chunk, torch.Tensor]]]] = []
            recvs: list[tuple[int, torch.Tensor, int]] = []
            unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staged data, destination view)
            started = time.perf_counter()
            staged = 0
            for t in by_round.get(round_index, []):
                chunks, packed_size = _chunks(t, self.plan, self.direct_min_bytes)
                # Tag 0 is the packed buffer, tag i+1 the i-th piece sent on its own.
                if t.src == self.device:
                    peer, where = peer_of[t.dst], f"round {round_index} send to {t.dst}"
                    if packed_size:
                        buf = pool.get(packed_size, self.buffer_device)
                        staged += packed_size
                        sources = [
                            (c, self._find(self.old_by_key.get(c.key), c.key, c.region, where))
                            for c in chunks
                            if c.offset >= 0
                        ]
                        packs.append((buf, sources))
                        later.append((peer, buf, 0, None))
                    for i, c in enumerate(chunks):
                        if c.offset < 0:
                            src = self._find(self.old_by_key.get(c.key), c.key, c.region, where)
                            if src.is_contiguous() and by_tag:
                                ready.append((peer, src.view(-1), i + 1))
                            elif src.is_contiguous():
                                later.append((peer, src.view(-1), i + 1, None))
                            else:
                                stage = pool.get(c.nbytes, self.buffer_device).view(c.dtype)
                                staged += c.nbytes
                                later.append((peer, stage, i + 1, src))
                    self.bytes_sent += t.num_bytes
                else:
                    peer, where = peer_of[t.src], f"round {round_index} receive from {t.src}"
                    if packed_size:
                        buf = pool.get(packed_size, self.buffer_device)
                        staged += packed_size
                        recvs.append((peer, buf, 0))
                        for c in chunks:
                            if c.offset >= 0:
                                dst = self._find(self.new_by_key.get(c.key), c.key, c.region, where)
                                unpack.append((buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(dst.shape), dst))
                    for i, c in enumerate(chunks):
                        if c.offset < 0:
                            dst = self._find(self.new_by_key.get(c.key), c.key, c.region, where)
                            if dst.is_contiguous():
                                recvs.append((peer, dst.view(-1), i + 1))
                            else:
                                stage = pool.get(c.nbytes, self.buffer_device).view(c.dtype)
                                staged += c.nbytes
                                recvs.append((peer, stage, i + 1))
                                unpack.append((stage.view(dst.shape), dst))
                    self.bytes_received += t.num_bytes
            # With tag matching, what needs no staging goes on the wire before the packing starts.
            first = transport.post(round_index, ready, recvs, timeout_s, names) if by_tag else None
            for buf, sources in packs:
                for c, src in sources:
                    buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(src.shape).copy_(src)
            for _, stage, _, unstaged in later:
                if unstaged is not None:
                    stage.view(unstaged.shape).copy_(unstaged)
            sends_later = [(peer, buf, tag) for peer, buf, tag, _ in later]
            packed = time.perf_counter()
            if first is not None:  # by tag
                second = transport.post(round_index, sends_later, [], timeout_s, names)
                first.wait()
                second.wait()
            else:
                transport.post(round_index, sends_later, recvs, timeout_s, names).wait()
            exchanged = time.perf_counter()
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, staged)
            for data, dst in unpack:
                dst.copy_(data)
            pool.release()
            done = time.perf_counter()
            self.pack_s += packed - started
            self.transfer_s += exchanged - packed
            self.unpack_s += done - exchanged
