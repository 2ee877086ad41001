"""Move a plan's bytes on one process: the transfer rounds, then the local copies and restores.

:class:`Runner` holds this process's old and new shards; both ends of a message cut it into the
same pieces (:func:`chunks`) from the plan alone, stage the small ones in a :class:`BufferPool`
and post every round's sends and receives on the transport in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

import torch

from etc_agent.layout.devices import Device
from etc_agent.migrate.describe import LocalShard
from etc_agent.migrate.transport import MigrationError, Transport
from etc_agent.planner.plan import MigrationPlan, Region, Transfer

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

ReadCheckpoint = Callable[[list[tuple[str, tuple[int, ...], torch.Tensor]]], None]
"""Reads ``(key, global offsets, contiguous out)`` boxes from the checkpoint into ``out``."""


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


ARENA_BYTES = 64 << 20
"""Size of one staging arena (bigger only for a single larger piece)."""


@dataclass
class _Arenas:
    """One device's arenas and how far the current round has used them."""

    arenas: list[torch.Tensor] = field(default_factory=list)
    index: int = 0
    used: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() for a in self.arenas)


class BufferPool:
    """Staging memory reused across rounds and migrations.

    Fresh host allocations pay a page fault per 4 KiB on first touch (~1.3 GB/s here), as much as
    the copy itself. The pool keeps every arena it made, already resident, and a round hands them
    out again in order; :meth:`reserve` makes them resident ahead (a worker reserves one arena as it
    starts, so even its first migration stages into resident memory). Holds what the largest round
    staged (bounded by the plan's memory cap, per direction), plus what did not fit at the end of
    each arena. Used by one thread at a time: the migration's.
    """

    def __init__(self) -> None:
        self._by_device: dict[torch.device, _Arenas] = {}

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        size = -(-nbytes // ALIGN) * ALIGN
        pool = self._by_device.setdefault(device, _Arenas())
        while pool.index < len(pool.arenas) and pool.used + size > pool.arenas[pool.index].numel():
            pool.index, pool.used = pool.index + 1, 0
        if pool.index == len(pool.arenas):
            pool.arenas.append(torch.empty(max(size, ARENA_BYTES), dtype=torch.uint8, device=device))
        view = pool.arenas[pool.index][pool.used : pool.used + nbytes]
        pool.used += size
        return view

    def release(self) -> None:
        """End of a round: everything handed out is free again (the arenas stay, resident)."""
        for pool in self._by_device.values():
            pool.index = pool.used = 0

    def reserve(self, nbytes: int, device: torch.device) -> int:
        """Hold at least ``nbytes`` of arenas on ``device``, their pages written (host memory); the
        bytes added."""
        pool = self._by_device.setdefault(device, _Arenas())
        added = 0
        while pool.num_bytes < nbytes:
            arena = torch.zeros(ARENA_BYTES, dtype=torch.uint8, device=device)
            pool.arenas.append(arena)
            added += arena.numel()
        return added

    def num_bytes(self, device: torch.device) -> int:
        """What the pool holds on ``device``."""
        pool = self._by_device.get(device)
        return pool.num_bytes if pool is not None else 0


BUFFERS = BufferPool()


def warm_staging(device: torch.device) -> int:
    """Make one staging arena resident on ``device`` ahead of this process's first migration (a
    worker as it starts, a warm spare before it is adopted): staged pieces of that migration then
    land in written pages instead of faulting them in inside the stall. Costs one arena of memory
    (:data:`ARENA_BYTES`) for the process's life, which its first migration would have allocated
    anyway. Returns the bytes added (0 when already there)."""
    return BUFFERS.reserve(ARENA_BYTES, device)


@dataclass
class _Round:
    """One round's messages on this process, in the order they are posted, and where they land."""

    pool: BufferPool
    device: torch.device
    ready: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)  # sends straight from a tensor
    # Sends that are packed first: (peer, buffer, tag, what to copy into it: [(destination, source)]).
    later: list[tuple[int, torch.Tensor, int, list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    # Per receive (same index as ``recvs``): (staged data, destination view) to copy once it arrived.
    unpack: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    staged: int = 0
    pack_s: float = 0.0
    unpack_s: float = 0.0

    def stage(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of staging memory from the pool, counted toward the round's peak."""
        buf = self.pool.get(nbytes, self.device)
        self.staged += nbytes
        return buf

    def receive(self, peer: int, buf: torch.Tensor, tag: int, unpack: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.recvs.append((peer, buf, tag))
        self.unpack.append(unpack)

    def pack_one(self, index: int) -> tuple[int, torch.Tensor, int]:
        """Copy the ``index``-th later send's sources into its staging buffer; the send to post."""
        started = time.perf_counter()
        peer, buf, tag, copies = self.later[index]
        for dst, src in copies:
            dst.copy_(src)
        self.pack_s += time.perf_counter() - started
        return peer, buf, tag

    def unpack_one(self, index: int) -> None:
        """Copy what the ``index``-th receive staged into the new shards."""
        started = time.perf_counter()
        for data, dst in self.unpack[index]:
            dst.copy_(data)
        self.unpack_s += time.perf_counter() - started


def _sole_owner(tensor: torch.Tensor, num_views_held: int) -> bool:
    """Whether no other tensor shares ``tensor``'s storage but the ``num_views_held`` views the caller
    holds: not a view itself, and no alias such as the detached copy a ``state_dict()`` gives
    (swapping an alias's storage would leave the parameter it stands for unfilled)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if tensor._base is not None or use_count is None:
        return False
    # One reference is the tensor's own, one the storage object made to ask.
    return use_count(tensor.untyped_storage()._cdata) <= 2 + num_views_held


class Runner:
    """This process's part of one plan: materialize the new shards, run the rounds, the local
    copies and the restores, and count what it did."""

    def __init__(
        self,
        plan: MigrationPlan,
        device: Device,
        old_local: list[LocalShard],
        new_local: list[LocalShard],
        buffer_device: torch.device | None,
        direct_min_bytes: int,
        adopt_old: bool = False,
    ):
        self.plan, self.device, self.direct_min_bytes = plan, device, direct_min_bytes
        self.adopt_old = adopt_old
        """Whether a new shard may take over an old shard's storage (the old state is discarded after)."""
        self._adopted: set[int] = set()
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
        return Runner._find_in(shards, key, region, where)[1]

    @staticmethod
    def _find_in(
        shards: list[LocalShard] | None, key: str, region: Region, where: str
    ) -> tuple[LocalShard, torch.Tensor]:
        """The local shard holding ``region`` and the view of it there."""
        for ls in shards or []:
            try:
                return ls, ls.region_view(region.offsets, region.lengths)
            except ValueError:
                continue  # another shard of this key (rare: several per rank) may hold it
        raise MigrationError(f"{where}: no local shard of {key} holds region {region.offsets}/{region.lengths}")

    def local_copies(self) -> None:
        where = f"local copy on {self.device}"
        for copy in self.plan.local_copies:
            if copy.device != self.device:
                continue
            for region in copy.regions:
                for key in self.plan.groups[region.group].keys:
                    old, src = self._find_in(self.old_by_key.get(key), key, region, where)
                    new, dst = self._find_in(self.new_by_key.get(key), key, region, where)
                    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride():
                        continue  # already there (reused old tensor)
                    if self.adopt_old and self._adopt(old.tensor, src, new.tensor, dst):
                        continue
                    dst.copy_(src)
                    self.bytes_copied += src.numel() * src.element_size()

    def _adopt(self, old: torch.Tensor, src: torch.Tensor, new: torch.Tensor, dst: torch.Tensor) -> bool:
        """Make the new tensor hold the old one's storage instead of copying it, when the region is the
        whole of both and both own their storage (not views: a view's base, e.g. FSDP2's padded shard
        or a flat parameter buffer, would not see the swap). Each old tensor is given away once."""
        whole = src.numel() == old.numel() == new.numel() and dst.data_ptr() == new.data_ptr()
        whole = whole and src.data_ptr() == old.data_ptr()
        owners = (
            old._base is None and _sole_owner(new, num_views_held=1) and old.is_contiguous() and new.is_contiguous()
        )
        fits = old.dtype == new.dtype and old.device == new.device and not new.is_meta
        if not (whole and owners and fits) or old.data_ptr() in self._adopted:
            return False
        self._adopted.add(old.data_ptr())
        new.set_(old.untyped_storage(), old.storage_offset(), new.shape, new.stride())
        self.bytes_reused += new.numel() * new.element_size()
        return True

    def restore(self, read_checkpoint: ReadCheckpoint) -> None:
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
        for round_index in range(self.plan.num_rounds):
            self._round(round_index, by_round.get(round_index, []), transport, peer_of, names, timeout_s)

    def _round(
        self,
        round_index: int,
        transfers: list[Transfer],
        transport: Transport,
        peer_of: dict[Device, int],
        names: dict[int, str],
        timeout_s: float,
    ) -> None:
        """One round: stage every message of this process, post, pack, wait, unpack."""
        by_tag = getattr(transport, "matches_by_tag", False)
        started = time.perf_counter()
        work = _Round(BUFFERS, self.buffer_device)
        for t in transfers:
            chunks, packed_size = _chunks(t, self.plan, self.direct_min_bytes)
            # Tag 0 is the packed buffer, tag i+1 the i-th piece sent on its own.
            if t.src == self.device:
                where = f"round {round_index} send to {t.dst}"
                self._stage_sends(work, chunks, packed_size, peer_of[t.dst], where, by_tag)
                self.bytes_sent += t.num_bytes
            else:
                where = f"round {round_index} receive from {t.src}"
                self._stage_receives(work, chunks, packed_size, peer_of[t.src], where)
                self.bytes_received += t.num_bytes
        self._exchange(round_index, work, transport, names, timeout_s, by_tag)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, work.staged)
        work.pool.release()
        # Packing and unpacking overlap the wire; what is left of the round was waiting for it.
        self.pack_s += work.pack_s
        self.unpack_s += work.unpack_s
        self.transfer_s += max(0.0, time.perf_counter() - started - work.pack_s - work.unpack_s)

    def _stage_sends(
        self, work: _Round, chunks: list[_Chunk], packed_size: int, peer: int, where: str, by_tag: bool
    ) -> None:
        """Queue one message's sends to ``peer``: its packed buffer, then each piece sent on its own."""
        if packed_size:
            buf = work.stage(packed_size)
            copies = []
            for c in chunks:
                if c.offset >= 0:
                    src = self._find(self.old_by_key.get(c.key), c.key, c.region, where)
                    copies.append((buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(src.shape), src))
            work.later.append((peer, buf, 0, copies))
        for i, c in enumerate(chunks):
            if c.offset < 0:
                src = self._find(self.old_by_key.get(c.key), c.key, c.region, where)
                if src.is_contiguous() and by_tag:
                    work.ready.append((peer, src.view(-1), i + 1))
                elif src.is_contiguous():
                    work.later.append((peer, src.view(-1), i + 1, []))
                else:
                    stage = work.stage(c.nbytes).view(c.dtype)
                    work.later.append((peer, stage, i + 1, [(stage.view(src.shape), src)]))

    def _stage_receives(self, work: _Round, chunks: list[_Chunk], packed_size: int, peer: int, where: str) -> None:
        """Queue one message's receives from ``peer``: its packed buffer, then each piece sent on its own."""
        if packed_size:
            buf = work.stage(packed_size)
            unpack = []
            for c in chunks:
                if c.offset >= 0:
                    dst = self._find(self.new_by_key.get(c.key), c.key, c.region, where)
                    unpack.append((buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(dst.shape), dst))
            work.receive(peer, buf, 0, unpack)
        for i, c in enumerate(chunks):
            if c.offset < 0:
                dst = self._find(self.new_by_key.get(c.key), c.key, c.region, where)
                if dst.is_contiguous():
                    work.receive(peer, dst.view(-1), i + 1, [])
                else:
                    stage = work.stage(c.nbytes).view(c.dtype)
                    work.receive(peer, stage, i + 1, [(stage.view(dst.shape), dst)])

    @staticmethod
    def _exchange(
        round_index: int, work: _Round, transport: Transport, names: dict[int, str], timeout_s: float, by_tag: bool
    ) -> None:
        """Post the round's messages and wait for them, packing and unpacking while others are on the wire.

        With tag matching (gloo) every receive and every send that needs no staging is posted first;
        each staged send is posted as soon as it is packed, and each receive is unpacked as soon as
        it arrived. Matched in posting order (NCCL), everything is packed first, posted in one
        batch, and unpacked after.
        """
        if not by_tag:
            sends = [work.pack_one(i) for i in range(len(work.later))]
            transport.post(round_index, sends, work.recvs, timeout_s, names).wait()
            for i in range(len(work.recvs)):
                work.unpack_one(i)
            return
        receiving = transport.post(round_index, [], work.recvs, timeout_s, names)
        sending = [transport.post(round_index, work.ready, [], timeout_s, names)]
        for i in range(len(work.later)):
            sending.append(transport.post(round_index, [work.pack_one(i)], [], timeout_s, names))
        for i in range(len(work.recvs)):
            receiving.wait_one(i)
            work.unpack_one(i)
        for pending in sending:
            pending.wait()
