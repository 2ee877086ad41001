"""A plain torchrun script (no worker API) that keeps its progress through membership changes.

Under torchrun and under etcrun alike, a plain script's workers are restarted on every membership
change (a node joins or leaves) and on a failure: the script runs again from the top with the new
``RANK`` / ``WORLD_SIZE``, and everything it held in memory is gone. It keeps its progress only by
resuming from its own checkpoint, which is all this example adds to a DDP loop:

1. at start, load the newest checkpoint if there is one (``--checkpoint-dir``, a directory every
   node reaches) and continue from its step;
2. every ``--checkpoint-every`` steps, rank 0 writes the model, the optimizer and the step to a
   temporary file and renames it over the checkpoint (a worker stopped mid-write leaves the previous
   checkpoint whole);
3. the data of a step depends on the step alone (a fixed global batch, split over the ranks), so
   the steps since the last checkpoint are trained again on the same samples.

``TORCHELASTIC_RESTART_COUNT`` counts failure restarts as torchrun counts them (a membership change
is not one); the script logs it, but the checkpoint, not the count, says where to resume.
``etc_agent.init()`` (the worker API) keeps the workers and their state alive across changes
instead, with no checkpoint needed (docs/worker-api.md).

    etcrun --nnodes 1:4 --nproc-per-node 2 --rdzv-backend etcd-v3 --rdzv-endpoint 127.0.0.1:2379 \\
           --rdzv-id job7 -m etc_agent.examples.plain_ddp --steps 300 --checkpoint-dir /shared/job7
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 12
"""Samples per step, split evenly over the ranks (1, 2, 3, 4 and 6 ranks divide it)."""
FEATURES = 16


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of ``step``: the same whatever the world size (a resumed step trains on them again)."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    return inputs, targets


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step to start from: the checkpoint's, or 0 when there is none."""
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, temporary)
    os.replace(temporary, path)  # atomic: a reader sees the old checkpoint or the new one


def train_reference(steps: int, lr: float) -> dict[str, torch.Tensor]:
    """The same training in one process without interruption (what a job through changes must match)."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        inputs, targets = global_batch(step)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", type=Path, required=True, help="A directory every node reaches.")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (to watch it).")
    parser.add_argument("--progress", type=Path, default=None, help="Rank 0 writes its step here as JSON.")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world_size:
        raise SystemExit(f"world size {world_size} does not divide the global batch of {GLOBAL_BATCH}")
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoint = args.checkpoint_dir / "checkpoint.pt"
    start = load_checkpoint(checkpoint, model, optimizer)
    ddp = DistributedDataParallel(model)
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == 0:
        print(f"world size {world_size}, restart count {restarts}: starting at step {start}", flush=True)
    share = GLOBAL_BATCH // world_size
    for step in range(start, args.steps):
        inputs, targets = global_batch(step)
        mine = slice(rank * share, (rank + 1) * share)
        loss = nn.functional.mse_loss(ddp(inputs[mine]), targets[mine])
        loss.backward()  # DDP averages the gradients: the global batch's mean gradient
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(checkpoint, model, optimizer, step + 1)
        if rank == 0 and args.progress is not None:
            record = {
                "step": step + 1,
                "world_size": world_size,
                "restart_count": int(restarts),
                "pid": os.getpid(),
                "time": time.time(),
            }
            args.progress.with_suffix(".tmp").write_text(json.dumps(record))
            os.replace(args.progress.with_suffix(".tmp"), args.progress)
        time.sleep(args.step_delay)
    if rank == 0:
        save_checkpoint(checkpoint, model, optimizer, args.steps)
        print(f"done: {args.steps} steps, world size {world_size}, loss {loss.item():.6f}", flush=True)
    del ddp  # its reducer holds the process group: freed before the group, not at interpreter exit
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
