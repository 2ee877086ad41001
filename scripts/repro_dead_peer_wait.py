"""Reproduce the survivors' wait on a dead peer (issue: crash recovery): 4 gloo processes run
all-reduces, rank 3 exits; each rank that fails reports how long after the death it failed, then
tears its group down (``destroy_process_group``) and, with ``--abort``, calls ``ProcessGroup.abort``.

    python scripts/repro_dead_peer_wait.py plain     # dist.all_reduce: every rank fails within ~0.1 s
    python scripts/repro_dead_peer_wait.py funcol    # functional all_reduce: one rank waits the timeout
    python scripts/repro_dead_peer_wait.py funcol --release   # with etc_agent.worker.groups: all within ~0.5 s

It also prints the Python reference count of the default group after its destruction (2 means
only this script holds it) and the functional collectives' work-registry size.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int, mode: str, abort: bool, release: bool, timeout_s: float, t_dead) -> None:
    if release:
        from etc_agent.worker.groups import destroy_all_groups  # imported before the group exists
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    c10d = torch._C._distributed_c10d
    x = torch.ones(1000)
    try:
        for i in range(10**6):
            if rank == world - 1 and i == 50:
                t_dead.value = time.time()
                os._exit(1)
            if mode == "funcol":
                funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
            else:
                dist.all_reduce(x)
    except Exception as err:  # noqa: BLE001 - the failure is what is measured
        waited = time.time() - t_dead.value
        print(f"rank {rank}: failed {waited:.2f} s after the death ({str(err).splitlines()[0][:70]})", flush=True)
        traceback.clear_frames(err.__traceback__)
        del err
        group = dist.group.WORLD
        if abort:
            group.abort()
        if release:
            del group  # the script's own reference: the report below must see only other holders
            print(f"rank {rank}: groups still referenced after destroy_all_groups: {destroy_all_groups()}", flush=True)
        else:
            dist.destroy_process_group()
            gc.collect()
            print(
                f"rank {rank}: after destroy: refcount {sys.getrefcount(group)}, work registry "
                f"{c10d._get_work_registry_size()}",
                flush=True,
            )
            del group
        time.sleep(timeout_s + 5)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("plain", "funcol"))
    ap.add_argument("--abort", action="store_true", help="ProcessGroup.abort() before destroy_process_group().")
    ap.add_argument(
        "--release", action="store_true", help="Use etc_agent.worker.groups (the fix) to import and destroy."
    )
    ap.add_argument("--timeout", type=float, default=20.0, help="The group's collective timeout (s).")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    t_dead = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=run, args=(r, 4, port, args.mode, args.abort, args.release, args.timeout, t_dead))
        for r in range(4)
    ]
    for p in procs:
        p.start()
    deadline = time.time() + 2 * args.timeout + 10
    for p in procs:
        p.join(max(0.1, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
