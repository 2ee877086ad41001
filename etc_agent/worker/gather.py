"""The whole app state, unsharded, on one rank (:meth:`etc_agent.worker.job.Job.gather_state`).

It runs on the migration executor: rank 0's new layout holds every key as one full box, and every
other rank only sends.
"""

from __future__ import annotations

import torch

from etc_agent.layout.devices import Device
from etc_agent.migrate.describe import BoxedTensor, describe_state
from etc_agent.migrate.executor import TORCH_DTYPES, migrate_state
from etc_agent.migrate.transport import TorchTransport
from etc_agent.worker.appstate import split_state
from etc_agent.worker.context import ParallelContext


def gather_state(state: dict, ctx: ParallelContext, timeout_s: float) -> dict[str, torch.Tensor] | None:
    """``state``'s tensors, unsharded, on rank 0 (None elsewhere); every rank of ``ctx`` calls it."""
    tensors, _ = split_state(state)
    transport = TorchTransport()
    infos = transport.all_gather_object(
        [[s.shard.key, list(s.shard.global_shape), s.shard.dtype] for s in describe_state(tensors)]
    )
    full = None
    if ctx.rank == 0:
        shapes = {key: (tuple(shape), dtype) for info in infos for key, shape, dtype in info}
        full = {
            key: BoxedTensor(torch.empty(shape, dtype=TORCH_DTYPES[dtype]), shape, (0,) * len(shape))
            for key, (shape, dtype) in sorted(shapes.items())
        }
    result = migrate_state(
        tensors,
        full,
        device=Device("g", ctx.rank),
        old_rank=ctx.rank,
        new_rank=0 if ctx.rank == 0 else None,
        transport=transport,
        timeout_s=timeout_s,
    )
    if full is None:
        return None
    return {key: result.tensors[key].view(full[key].global_shape) for key in full}
