"""The checkpoint way (``--migration checkpoint``, the baseline every figure is compared with):
``torch.distributed.checkpoint`` save, restart the workers, load with resharding.

The shard plumbing is :mod:`etc_agent.migrate.storage` (the same boxes the executor moves); the
baseline is its two collective calls. Call sequence: at the agreed step boundary every rank of the
old layout calls :func:`save_and_exit` (:func:`save_shards`, collective over the default group,
then exit with ``RESTART_EXIT``); the agent starts fresh workers, and every rank of the new layout
calls :func:`load_checkpoint` (:func:`load_shards`) on the state its ``build`` returned.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from etc_agent.agent.protocol import RESTART_EXIT
from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.storage import load_shards, save_shards
from etc_agent.utils.plainstate import to_json

__all__ = ["load_checkpoint", "load_shards", "save_and_exit", "save_shards"]


def save_and_exit(
    tensors: dict, plain: dict, checkpoint_dir: str, pending: int, step: int, rank: int, config: str, stopped_at: float
) -> None:
    """Save every shard with DCP (files synced), then exit so that the agent starts fresh workers for
    generation ``pending`` that load with resharding. Rank 0 writes the plain state beside them."""
    path = Path(checkpoint_dir) / f"gen{pending}"
    t0 = time.perf_counter()
    save_shards(describe_state(tensors), path)
    save_s = time.perf_counter() - t0
    if rank == 0:
        meta = {
            "app": plain,
            "rng": to_json(torch.get_rng_state(), "rng"),
            "step": step,
            "stopped_at": stopped_at,
            "save_s": save_s,
            "config": config,
            "generation": pending,
        }
        (path / "etc_state.json").write_text(json.dumps(meta))
    dist.barrier()
    print(
        f"[etc_agent] rank {rank}: saved to {path} in {save_s:.3f} s; exiting for generation {pending} "
        "(--migration checkpoint)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(RESTART_EXIT)  # no interpreter teardown: the saved state is all that matters now


def load_checkpoint(
    new_tensors: dict, checkpoint_dir: str, generation: int, published_at: float, periodic: bool
) -> dict | None:
    """Load the newest save into the new state (collective over the new world): the baseline's save
    at the last switch, or, after a failure, the newest complete periodic checkpoint (``periodic``;
    what a restarted ``torchrun`` job loads; its write ran in the background, off the stall).
    Returns the plain state and timings, or None when there is nothing to load."""
    root = Path(checkpoint_dir)
    saves = sorted(root.glob("gen*/etc_state.json"), key=lambda p: int(p.parent.name[3:]))
    # (step, the baseline's save over a periodic one, newest generation): the state to resume from.
    saves = [
        ((json.loads(p.read_text())), p.parent, (1, int(p.parent.name[3:])))
        for p in saves
        if int(p.parent.name[3:]) <= generation
    ]
    if periodic:
        from etc_agent.worker.checkpoint import complete_checkpoints

        for stored in complete_checkpoints(root):
            saves.append(
                ({**stored.state(), "stopped_at": published_at, "save_s": 0.0}, stored.path, (0, stored.generation))
            )
    if not saves:
        return None
    meta, path, _ = max(saves, key=lambda item: (item[0]["step"], *item[2]))
    t0 = time.perf_counter()
    load_shards(describe_state(new_tensors), path)
    meta["load_s"] = time.perf_counter() - t0
    meta["path"] = str(path)
    meta["written_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")
    return meta
