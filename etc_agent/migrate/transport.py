"""Point-to-point transports behind one small interface.

A transport moves whole buffers between the processes of one migration (old ∪ new devices) and
gathers small Python objects. :class:`TorchTransport` uses ``torch.distributed`` on a process group
that the caller created fresh for this generation: gloo on CPU, NCCL on GPU (same code path).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from etc_agent.utils.backends import data_backend


class MigrationError(RuntimeError):
    """A migration could not complete; the message names the peer and round that failed."""


class PendingExchange(Protocol):
    def wait(self) -> None:
        """Block until every posted send and receive completed; raise MigrationError naming the peer."""

    def wait_one(self, index: int) -> None:
        """Block until the ``index``-th posted operation (sends first, then receives, in list order)
        completed; raise MigrationError naming the peer."""


class Transport(Protocol):
    rank: int
    world_size: int
    matches_by_tag: bool
    """True when messages between two peers are matched by tag (gloo), so they may be posted in any
    order and in several batches; False when they are matched in posting order (NCCL)."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (JSON-serialisable; sent as JSON, never pickled), by transport rank."""

    def post(
        self,
        round_index: int,
        sends: Sequence[tuple[int, torch.Tensor, int]],
        recvs: Sequence[tuple[int, torch.Tensor, int]],
        timeout_s: float,
        peer_names: dict[int, str],
    ) -> PendingExchange:
        """Start sending each ``(peer, buffer, tag)`` and receiving into each receive buffer.

        With ``matches_by_tag`` a send meets the receive with the same peer and tag; otherwise
        buffers to and from the same peer are matched in list order on both sides.
        """


class TorchTransport:
    """``batch_isend_irecv`` on a ``torch.distributed`` process group, every wait bounded."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = data_backend(dist.get_backend(group))
        self.matches_by_tag = self.backend == "gloo"

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_gather_object(self, obj: Any) -> list[Any]:
        def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(out, tensor, group=self.group)
            return out

        return json_all_gather(obj, gather)

    def post(self, round_index, sends, recvs, timeout_s, peer_names) -> _TorchPending:
        ops, what = [], []
        for peer, buf, tag in sends:
            ops.append(dist.P2POp(dist.isend, buf, self._global(peer), self.group, tag if self.matches_by_tag else 0))
            what.append(f"send to {peer_names.get(peer, peer)} (rank {peer})")
        for peer, buf, tag in recvs:
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.group, tag if self.matches_by_tag else 0))
            what.append(f"receive from {peer_names.get(peer, peer)} (rank {peer})")
        deadline = time.monotonic() + timeout_s
        if not ops:
            return _TorchPending(round_index, [], [], deadline, timeout_s, False)
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as err:  # a peer that is already gone fails the post itself
            raise MigrationError(f"round {round_index}: posting {', '.join(what)} failed: {_first_line(err)}") from err
        # NCCL coalesces a batch into one work; gloo returns one per op.
        labels = what if len(works) == len(ops) else [", ".join(what)] * len(works)
        return _TorchPending(round_index, works, labels, deadline, timeout_s, self.backend == "nccl")

    def exchange(self, round_index, sends, recvs, timeout_s, peer_names) -> None:
        self.post(round_index, sends, recvs, timeout_s, peer_names).wait()


class GroupTransport:
    """Point-to-point on a standalone process group object (not the default group, not registered).

    A migration spans old and new devices (leavers send, joiners receive) while the training group
    of the new generation holds only the new world; this transport runs on a group made for the
    migration alone (``ProcessGroupGloo(store, rank, size, timeout)`` or the NCCL equivalent).
    """

    def __init__(self, group: dist.ProcessGroup, backend: str):
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.backend = backend
        self.matches_by_tag = backend == "gloo"

    def all_gather_object(self, obj: Any) -> list[Any]:
        def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self.group.allgather([out], [tensor]).wait()
            return out

        return json_all_gather(obj, gather)

    def barrier(self) -> None:
        self.group.allgather([[torch.zeros(1) for _ in range(self.world_size)]], [torch.zeros(1)]).wait()

    def post(self, round_index, sends, recvs, timeout_s, peer_names) -> _TorchPending:
        works, labels = [], []
        deadline = time.monotonic() + timeout_s
        try:
            for peer, buf, tag in sends:
                labels.append(f"send to {peer_names.get(peer, peer)} (rank {peer})")
                works.append(self.group.send([buf.view(-1)], peer, tag if self.matches_by_tag else 0))
            for peer, buf, tag in recvs:
                labels.append(f"receive from {peer_names.get(peer, peer)} (rank {peer})")
                works.append(self.group.recv([buf.view(-1)], peer, tag if self.matches_by_tag else 0))
        except Exception as err:
            raise MigrationError(f"round {round_index}: posting {labels[-1]} failed: {_first_line(err)}") from err
        return _TorchPending(round_index, works, labels, deadline, timeout_s, self.backend == "nccl")


def json_all_gather(obj: Any, gather) -> list[Any]:
    """All-gather JSON values as byte tensors: lengths first, then the padded payloads."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    lengths = gather(torch.tensor([data.numel()], dtype=torch.int64))
    size = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(size, 1), dtype=torch.uint8)
    padded[: data.numel()] = data
    return [json.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(gather(padded), lengths)]


class _TorchPending:
    def __init__(
        self, round_index: int, works: list, labels: list[str], deadline: float, timeout_s: float, cuda_sync: bool
    ):
        self.round_index, self.works, self.labels = round_index, works, labels
        self.deadline, self.timeout_s, self.cuda_sync = deadline, timeout_s, cuda_sync

    def wait(self) -> None:
        for index in range(len(self.works)):
            self.wait_one(index)
        if self.cuda_sync and self.works:
            torch.cuda.current_stream().synchronize()

    def wait_one(self, index: int) -> None:
        if not self.works:
            return
        # NCCL coalesces a batch into one work: every index waits for it.
        work, label = self.works[min(index, len(self.works) - 1)], self.labels[min(index, len(self.labels) - 1)]
        remaining = max(0.001, self.deadline - time.monotonic())
        try:
            ok = work.wait(timeout=timedelta(seconds=remaining))
        except Exception as err:
            raise MigrationError(f"round {self.round_index}: {label} did not complete: {_first_line(err)}") from err
        if ok is False:
            raise MigrationError(f"round {self.round_index}: {label} did not complete within {self.timeout_s:.0f} s")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
