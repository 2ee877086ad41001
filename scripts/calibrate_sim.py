#!/usr/bin/env python
"""Measure this machine's figures for the simulator's cost model and write them as a costs file.

Bandwidths come from micro-benchmarks run with as many processes as the migration benchmark runs
workers (they share the cores the same way):

- links: every process sends ``--mb`` MB to one peer while receiving as much (one stream:
  ``stream_gbps``), then the same bytes split over every other process at once (``intra_node_gbps``:
  what a device reaches with several peers), gloo over 127.0.0.1 as the migration transport, into
  freshly allocated buffers; 1 KB messages for the per-message latency. One machine: intra- and
  inter-"node" links are the same loopback;
- copy: each process copies ``--mb`` MB into memory it already touched once (a model's tensors, a few
  MB to tens of MB each, come from the allocator's reused heap: the local copies of a 1 GB pp-up ran
  at 3.5-5 GB/s per process, as fast as this, while copies into fresh mmaps run 3-4x slower);
- alloc: ``torch.empty`` of the same size (a rebuild allocates; pages are touched by the copy);
- storage: each process writes ``--mb`` MB to its own file and fsyncs (as the DCP save does), then
  reads it back (after a save, from the page cache, as the benchmark's load does). Every "node" is
  this machine's disk: per-node and aggregate figures are the same.

Fixed costs come from the small benchmark (``bench_migration.py --small``: every transition with a
1.1 MB model of the same tensors as the 1 GB one, so its stalls are almost all fixed cost): the
checkpoint way's save/load latency is half its save + load time; then the simulator, with the
bandwidths above and no fixed costs, prices the small transitions, and what it does not explain of
the measured stalls is: live, ``control_s`` (median of the changes on the same devices) plus what a
node join (``join_s``) and a node leave (``leave_s``) add; checkpoint, ``restart_seconds`` +
``restart_per_process_s`` x processes restarted, fitted (on one machine every restarted process
takes its share of the same two cores). Communicator creation is inside these, so ``group_init_*``
are 0.
The 1 GB benchmark is not an input: it is what the simulator then predicts
(``etc-agent simulate --suite bench --costs ... --measured ...``).

    python scripts/calibrate_sim.py --out costs-local.json [--small-json small.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _worker(rank: int, world: int, port: int, nbytes: int, reps: int, folder: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    peer = rank ^ 1
    numel = nbytes // 4
    send = torch.arange(numel, dtype=torch.float32)
    result: dict[str, list[float]] = {
        "link": [],
        "link_all": [],
        "latency": [],
        "copy": [],
        "alloc": [],
        "write": [],
        "read": [],
    }

    def exchange(a: torch.Tensor, b: torch.Tensor) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()
        return time.perf_counter() - t0

    def exchange_all(a: torch.Tensor) -> float:
        """``a`` split over every other process, and as much received from them, all at once."""
        others = [r for r in range(world) if r != rank]
        size = a.numel() // len(others)
        dist.barrier()
        t0 = time.perf_counter()
        ops = []
        for i, r in enumerate(others):
            ops += [
                dist.P2POp(dist.isend, a[i * size : (i + 1) * size], r),
                dist.P2POp(dist.irecv, torch.empty(size), r),
            ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return time.perf_counter() - t0

    small_a, small_b = torch.zeros(256), torch.zeros(256)
    exchange(small_a, small_b)
    for _ in range(reps):
        # Receives land in freshly allocated buffers, as a migration's do in the new shards.
        result["link"].append(exchange(send, torch.empty(numel)))
        result["link_all"].append(exchange_all(send))
    for _ in range(20):
        result["latency"].append(exchange(small_a, small_b))
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fresh = torch.empty(numel)
        result["alloc"].append(time.perf_counter() - t0)
        del fresh
    target = torch.zeros(numel)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        target.copy_(send)
        result["copy"].append(time.perf_counter() - t0)
    path = Path(folder) / f"rank{rank}.bin"
    data = send.numpy().tobytes()
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        result["write"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = np.fromfile(path, dtype=np.float32)  # one read into fresh memory
        dist.barrier()
        result["read"].append(time.perf_counter() - t0)
        assert back.size == numel
        path.unlink()
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def micro(world: int, nbytes: int, reps: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        tempfile.TemporaryDirectory(prefix="calib-") as folder,
        tempfile.TemporaryDirectory(prefix="calib-out-") as out,
    ):
        mp.spawn(_worker, args=(world, port, nbytes, reps, folder, out), nprocs=world, join=True)
        per_rank = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]

    def per_process(key: str) -> float:
        """Median over repetitions of the slowest process's time."""
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key])))

    return {
        "link_gbps": nbytes / per_process("link") / 1e9,
        "link_all_gbps": nbytes / per_process("link_all") / 1e9,
        "message_latency_s": per_process("latency"),
        "copy_gbps": nbytes / per_process("copy") / 1e9,
        "alloc_gbps": nbytes / max(per_process("alloc"), 1e-9) / 1e9,
        "write_gbps_aggregate": world * nbytes / per_process("write") / 1e9,
        "read_gbps_aggregate": world * nbytes / per_process("read") / 1e9,
    }


def _line_at_least_zero(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0`` (through the origin when the free fit's ``a`` < 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    if b < 0:
        a, b = max(my, 0.0), 0.0
    return a, b


def fixed_costs(small: dict, bandwidths: dict[str, float], console) -> dict[str, float]:
    """Fixed costs: what the simulator with the measured bandwidths and no fixed costs leaves
    unexplained of the small benchmark's medians (``small``: its JSON line). Live: ``control_s`` is the
    median over the changes on the same devices, ``join_s`` and ``leave_s`` what a node join and a
    node leave add to it. Checkpoint: ``restart_seconds + restart_per_process_s * new processes`` (on
    one machine every restarted process takes its share of the same cores), fitted non-negative."""
    from etc_agent.sim.costs import CostModel
    from etc_agent.sim.estimate import simulate
    from etc_agent.sim.suites import bench_suite

    rows = {t["name"]: t for t in small.get("transitions", [])}
    latency = [
        t["ckpt_phases_s"]["transfer_s"] / 2
        for t in rows.values()
        if t.get("ckpt_phases_s", {}).get("transfer_s") is not None
    ]
    if not rows or not latency or any(t.get("etc_s") is None or t.get("ckpt_s") is None for t in rows.values()):
        raise SystemExit(
            "the small benchmark's JSON needs both methods' stalls for its transitions (run it without --methods)"
        )
    costs = CostModel(
        **bandwidths,
        control_s=0,
        control_per_process_s=0,
        join_s=0,
        leave_s=0,
        group_init_s=0,
        group_init_per_process_s=0,
        restart_seconds=0,
        restart_per_process_s=0,
        storage_latency_s=statistics.median(latency),
    )
    live: dict[str, list[float]] = {"same devices": [], "join": [], "leave": []}
    ckpt = []
    for scenario in bench_suite("gpt-bench-small"):
        measured = rows.get(scenario.name)
        if measured is None:
            continue
        result = simulate(scenario, costs)
        old, new = set(scenario.old_devices), set(scenario.new_devices)
        kind = "join" if new - old else "leave" if old - new else "same devices"
        live[kind].append(measured["etc_s"] - result.etc_s)
        ckpt.append((scenario.new_config.world_size, measured["ckpt_s"] - result.ckpt_s))
    if not live["same devices"]:
        raise SystemExit("the small benchmark needs at least one change on the same devices (tp/pp/zero)")
    control = statistics.median(live["same devices"])
    restart, restart_per_process = _line_at_least_zero(ckpt)
    fixed = {
        "control_s": control,
        "join_s": statistics.median(live["join"]) - control if live["join"] else 0.0,
        "leave_s": statistics.median(live["leave"]) - control if live["leave"] else 0.0,
        "restart_seconds": restart,
        "restart_per_process_s": restart_per_process,
        "storage_latency_s": costs.storage_latency_s,
    }
    for key, value in fixed.items():
        if value < 0:
            console.print(
                f"[yellow]{key} came out negative ({value:.3f}): the bandwidth terms overestimate the small runs; using 0[/]"
            )
            fixed[key] = 0.0
    return fixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("costs-local.json"))
    ap.add_argument(
        "--small-json", type=Path, default=None, help="JSON line of bench_migration.py --small (run here when omitted)."
    )
    ap.add_argument(
        "--small-repeat", type=int, default=3, help="Repetitions of the small benchmark when it is run here."
    )
    ap.add_argument("--procs", type=int, default=4, help="Processes, as many as the benchmark's workers.")
    ap.add_argument("--mb", type=int, default=256, help="MB per process per micro-benchmark.")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.procs < 2 or args.procs % 2:
        ap.error("--procs must be even (processes exchange in pairs)")
    if args.mb < 1 or args.repeat < 1 or args.small_repeat < 1:
        ap.error("--mb, --repeat and --small-repeat must be at least 1")
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if args.small_json is None:
        console.print(f"running bench_migration.py --small --repeat {args.small_repeat} for the fixed costs ...")
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts/bench_migration.py"),
                "--small",
                "--repeat",
                str(args.small_repeat),
                "--plot",
                os.devnull,
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise SystemExit(f"bench_migration.py --small failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        small = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        small = json.loads(args.small_json.read_text().strip().splitlines()[-1])
    measured = micro(args.procs, args.mb << 20, args.repeat)
    bandwidths = {
        "intra_node_gbps": round(max(measured["link_all_gbps"], measured["link_gbps"]), 4),
        "inter_node_gbps": round(max(measured["link_all_gbps"], measured["link_gbps"]), 4),
        "stream_gbps": round(measured["link_gbps"], 4),
        "message_latency_s": round(measured["message_latency_s"], 6),
        "copy_gbps": round(measured["copy_gbps"], 4),
        "alloc_gbps": round(measured["alloc_gbps"], 2),
        "storage_write_gbps_per_node": round(measured["write_gbps_aggregate"], 4),
        "storage_aggregate_gbps": round(measured["write_gbps_aggregate"], 4),
        "storage_read_gbps_per_node": round(measured["read_gbps_aggregate"], 4),
        "storage_aggregate_read_gbps": round(measured["read_gbps_aggregate"], 4),
    }
    fixed = fixed_costs(small, bandwidths, console)
    costs = {
        **bandwidths,
        "control_s": round(fixed["control_s"], 4),
        "control_per_process_s": 0.0,
        "join_s": round(fixed["join_s"], 4),
        "leave_s": round(fixed["leave_s"], 4),
        "group_init_s": 0.0,
        "group_init_per_process_s": 0.0,
        "restart_seconds": round(fixed["restart_seconds"], 4),
        "restart_per_process_s": round(fixed["restart_per_process_s"], 4),
        "storage_latency_s": round(fixed["storage_latency_s"], 4),
    }
    table = Table(title=f"measured here ({args.procs} processes, {args.mb} MB each, median of {args.repeat})")
    table.add_column("cost field")
    table.add_column("value", justify="right")
    for k, v in costs.items():
        table.add_row(k, f"{v:g}")
    Console().print(table)
    console.print(
        "control_*, restart_* and storage_latency_s come from the small benchmark; communicator "
        "creation is inside them here, so group_init_* are 0."
    )
    data = {"costs": costs, "micro": measured, "fixed_from_small": fixed, "small": small}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data))


if __name__ == "__main__":
    main()
