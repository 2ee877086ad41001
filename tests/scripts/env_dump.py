"""A torchrun-style script: dumps the launcher environment and runs a DDP step on gloo."""

import json
import os
import sys
from datetime import timedelta

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]


def write(out_dir: str, env: dict) -> None:
    path = os.path.join(out_dir, f"{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(env, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    out_dir = sys.argv[1]
    env = {k: os.environ.get(k) for k in KEYS}
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        env["parent_command"] = f.read().replace(b"\0", b" ").decode()
    if "--no-dist" in sys.argv:
        write(out_dir, env)
        print(f"rank {os.environ['RANK']} done", flush=True)
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = DDP(torch.nn.Linear(4, 2))
    loss = model(torch.ones(3, 4) * (dist.get_rank() + 1)).sum()
    loss.backward()
    grad = model.module.weight.grad.clone()
    gathered = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grad)
    assert all(torch.equal(g, grad) for g in gathered), "DDP gradients differ across ranks"
    env["num_threads"] = torch.get_num_threads()
    env["dist_rank"] = dist.get_rank()
    env["dist_world_size"] = dist.get_world_size()
    # Everyone done before anyone tears down: a rank that exits while a peer's gloo pairs are still
    # open made that peer abort ("terminate called without an active exception") now and then.
    dist.barrier()
    dist.destroy_process_group()
    write(out_dir, env)
    sys.stdout.flush()
    # No destructors: the DDP reducer still holds the gloo group, and freeing it joins gloo's worker
    # threads with the GIL held while one of them may still be releasing the barrier's work, whose
    # tensors need the GIL (torch 2.13): a deadlock at exit, seen once in ~10 runs on two cores.
    os._exit(0)


if __name__ == "__main__":
    main()
