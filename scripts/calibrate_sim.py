#!/usr/bin/env python
"""Measure this machine's figures for the simulator's cost model and write them as a costs file.

Bandwidths come from micro-benchmarks run with as many processes as the migration benchmark runs
workers (they share the cores the same way):

- links: every process sends ``--mb`` MB to a peer while receiving as much (gloo over 127.0.0.1, the
  migration transport), and 1 KB messages for the per-message latency. One machine: intra- and
  inter-"node" links are the same loopback;
- copy: each process copies ``--mb`` MB into freshly allocated memory (what unpacking does);
- alloc: ``torch.empty`` of the same size (a rebuild allocates; pages are touched by the copy);
- storage: each process writes ``--mb`` MB to its own file and fsyncs (as the DCP save does), then
  reads it back (after a save, from the page cache, as the benchmark's load does). Every "node" is
  this machine's disk: per-node and aggregate figures are the same.

Fixed costs come from the quick benchmark (``bench_migration.py --quick``: a 0.5 MB model, so its
stalls are the fixed costs): the live switch's control cost (stall minus plan, rebuild and
transfer, lumped into ``control_s``), the checkpoint way's restart (stall minus save, load and
rebuild) and its per save/load latency. The 1 GB benchmark is not an input: it is what the
simulator then predicts (``etc-agent simulate --suite bench --costs ... --measured ...``).

    python scripts/calibrate_sim.py --out costs-local.json [--quick-json quick.json]
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _worker(rank: int, world: int, port: int, nbytes: int, reps: int, folder: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    peer = rank ^ 1
    numel = nbytes // 4
    send, recv = torch.arange(numel, dtype=torch.float32), torch.empty(numel)
    result: dict[str, list[float]] = {"link": [], "latency": [], "copy": [], "alloc": [], "write": [], "read": []}

    def exchange(a: torch.Tensor, b: torch.Tensor) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()
        return time.perf_counter() - t0

    small_a, small_b = torch.zeros(256), torch.zeros(256)
    exchange(small_a, small_b)
    for _ in range(reps):
        result["link"].append(exchange(send, recv))
    for _ in range(20):
        result["latency"].append(exchange(small_a, small_b))
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fresh = torch.empty(numel)
        result["alloc"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh.copy_(send)
        result["copy"].append(time.perf_counter() - t0)
        del fresh
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
        back = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
        dist.barrier()
        result["read"].append(time.perf_counter() - t0)
        assert back.numel() == numel
        path.unlink()
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def micro(world: int, nbytes: int, reps: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="calib-") as folder, tempfile.TemporaryDirectory(prefix="calib-out-") as out:
        mp.spawn(_worker, args=(world, port, nbytes, reps, folder, out), nprocs=world, join=True)
        per_rank = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]

    def per_process(key: str) -> float:
        """Median over repetitions of the slowest process's time."""
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key])))

    return {
        "link_gbps": nbytes / per_process("link") / 1e9,
        "message_latency_s": per_process("latency"),
        "copy_gbps": nbytes / per_process("copy") / 1e9,
        "alloc_gbps": nbytes / max(per_process("alloc"), 1e-9) / 1e9,
        "write_gbps_aggregate": world * nbytes / per_process("write") / 1e9,
        "read_gbps_aggregate": world * nbytes / per_process("read") / 1e9,
    }


def fixed_costs(quick: dict) -> dict[str, float]:
    """Fixed costs from the quick (0.5 MB) benchmark's phases."""
    control, restart, latency = [], [], []
    for t in quick["transitions"]:
        live, ckpt = t["etc_phases_s"], t["ckpt_phases_s"]
        control.append(t["etc_s"] - live["plan_s"] - live["rebuild_s"] - live["transfer_s"])
        # The checkpoint record's transfer_s is save + load; rebuild is the fresh workers' build.
        restart.append(t["ckpt_s"] - ckpt["transfer_s"] - ckpt["rebuild_s"])
        latency.append(ckpt["transfer_s"] / 2)
    return {"control_s": statistics.median(control), "restart_seconds": statistics.median(restart),
            "storage_latency_s": statistics.median(latency)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("costs-local.json"))
    ap.add_argument("--quick-json", type=Path, default=None, help="JSON line of bench_migration.py --quick (run here when omitted).")
    ap.add_argument("--quick-repeat", type=int, default=3, help="Repetitions of the quick benchmark when it is run here.")
    ap.add_argument("--procs", type=int, default=4, help="Processes, as many as the benchmark's workers.")
    ap.add_argument("--mb", type=int, default=256, help="MB per process per micro-benchmark.")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.procs < 2 or args.procs % 2:
        ap.error("--procs must be even (processes exchange in pairs)")
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if args.quick_json is None:
        console.print(f"running bench_migration.py --quick --repeat {args.quick_repeat} for the fixed costs ...")
        out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_migration.py"), "--quick", "--repeat", str(args.quick_repeat),
                              "--plot", os.devnull], capture_output=True, text=True, check=True)
        quick = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        quick = json.loads(args.quick_json.read_text().strip().splitlines()[-1])
    measured = micro(args.procs, args.mb << 20, args.repeat)
    fixed = fixed_costs(quick)
    costs = {
        "intra_node_gbps": round(measured["link_gbps"], 4),
        "inter_node_gbps": round(measured["link_gbps"], 4),
        "message_latency_s": round(measured["message_latency_s"], 6),
        "copy_gbps": round(measured["copy_gbps"], 4),
        "alloc_gbps": round(measured["alloc_gbps"], 2),
        "storage_write_gbps_per_node": round(measured["write_gbps_aggregate"], 4),
        "storage_aggregate_gbps": round(measured["write_gbps_aggregate"], 4),
        "storage_read_gbps_per_node": round(measured["read_gbps_aggregate"], 4),
        "storage_aggregate_read_gbps": round(measured["read_gbps_aggregate"], 4),
        "control_s": round(fixed["control_s"], 4),
        "control_per_process_s": 0.0,
        "group_init_s": 0.0,
        "group_init_per_process_s": 0.0,
        "restart_seconds": round(fixed["restart_seconds"], 4),
        "storage_latency_s": round(fixed["storage_latency_s"], 4),
    }
    table = Table(title=f"measured here ({args.procs} processes, {args.mb} MB each, median of {args.repeat})")
    table.add_column("cost field")
    table.add_column("value", justify="right")
    for k, v in costs.items():
        table.add_row(k, f"{v:g}")
    Console().print(table)
    console.print("control_s, restart_seconds and storage_latency_s come from the quick benchmark; communicator "
                  "creation is inside control_s (live) and restart_seconds (checkpoint) here, so group_init_* are 0.")
    data = {"costs": costs, "micro": measured, "fixed_from_quick": fixed, "quick_repeat": quick.get("repeat")}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data))


if __name__ == "__main__":
    main()
