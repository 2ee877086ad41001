"""Freeing destroyed gloo process groups: one after the other vs side by side (``destroy_all_groups``).

Every generation switch destroys the old training group, its mesh's subgroups and the migration
group. A gloo group's destructor closes its connections one by one, each waiting for a tick of the
transport's event loop; :func:`etc_agent.worker.groups.destroy_all_groups` frees the groups in
threads of their own (torch releases the GIL in a group's destructor). Each repetition makes a
default group and ``--groups`` subgroups over all ``--ranks`` processes (gloo, 127.0.0.1), runs one
all-reduce on each, unregisters them and collects, then drops the last references one after the
other or with ``_free_in_parallel``; the figure is the slowest rank's seconds for that last part.

    python scripts/bench_group_teardown.py [--ranks 4] [--groups 5] [--repeat 5]

Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(rank: int, world: int, num_groups: int, parallel: bool, port: int, out) -> None:
    from etc_agent.worker.groups import _free_in_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(world))) for _ in range(num_groups)]
    for group in [None, *groups]:
        dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()
    del groups, group
    # As destroy_all_groups does before freeing: unregister, collect what holds a group in a cycle.
    everyone = list(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    gc.collect()
    started = time.perf_counter()
    if parallel:
        _free_in_parallel(everyone)
    else:
        while everyone:
            everyone.pop()  # the last reference: its destructor closes its connections here
    out.put((rank, time.perf_counter() - started))


def _run(world: int, num_groups: int, parallel: bool) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_one, args=(r, world, num_groups, parallel, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    seconds = [out.get(timeout=120)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return max(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--groups", type=int, default=5, help="Subgroups besides the default group.")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    samples: dict[str, list[float]] = {"one after the other": [], "side by side": []}
    for rep in range(args.repeat):
        for name in list(samples) if rep % 2 == 0 else list(samples)[::-1]:
            samples[name].append(_run(args.ranks, args.groups, parallel=name == "side by side"))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    connections = (args.groups + 1) * (args.ranks - 1)
    table = Table(
        title=f"freeing {args.groups + 1} gloo groups of {args.ranks} ranks ({connections} connections a rank)"
    )
    for col in ("way", "median s", "samples s"):
        table.add_column(col)
    for name, values in samples.items():
        table.add_row(name, f"{medians[name]:.3f}", " ".join(f"{v:.3f}" for v in values))
    Console().print(table)
    serial, parallel = medians["one after the other"], medians["side by side"]
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "groups": args.groups + 1,
                "repeat": args.repeat,
                "serial_s": round(serial, 4),
                "parallel_s": round(parallel, 4),
                "ratio": round(serial / parallel, 2) if parallel else None,
                "samples": {k: [round(v, 4) for v in vs] for k, vs in samples.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
