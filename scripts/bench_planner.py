#!/usr/bin/env python
"""Planner time and memory from 1k to 65k devices (8 per node), each case in a fresh process.

For each cluster size (tp=8, pp=8 up to 1024 devices per replica shape; see ``shape_for``): the DP
degree shrinks by one (the last nodes leave), grows by one (new nodes join), and the shrink again
with ZeRO-1 (every optimizer range moves). Each case runs in a new Python process, as a leader
planning after an event would: the first plan's time (imports of what the planner loads lazily
included), the median of ``--repeat`` more, the process's peak memory, the bytes moved, the lower
bound and the gap between them. Prints a table and one JSON line.

    python scripts/bench_planner.py [--model configs/models/llama-70b.yaml] [--sizes 1024,4096,16384,65536]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from etc_agent.cli.report import fmt_bytes  # noqa: E402
from etc_agent.layout import DeviceSet, ModelSpec, ParallelConfig  # noqa: E402

PER_NODE = 8
SCENARIOS = ("leave", "join", "leave-zero1")


def devices(count: int) -> DeviceSet:
    return DeviceSet.parse(",".join(f"n{i}:{PER_NODE}" for i in range(count // PER_NODE)))


def shape_for(num_devices: int) -> tuple[int, int, int]:
    tp = 8
    pp = min(8, max(1, num_devices // 64))
    return tp, pp, num_devices // (tp * pp)


def scenarios(num_devices: int):
    tp, pp, dp = shape_for(num_devices)
    replica = tp * pp
    if dp > 1:
        yield (
            "leave",
            ParallelConfig(tp=tp, pp=pp, dp=dp),
            ParallelConfig(tp=tp, pp=pp, dp=dp - 1),
            num_devices - replica,
        )
        yield (
            "leave-zero1",
            ParallelConfig(tp=tp, pp=pp, dp=dp, zero=1),
            ParallelConfig(tp=tp, pp=pp, dp=dp - 1, zero=1 if dp > 2 else 0),
            num_devices - replica,
        )
    yield "join", ParallelConfig(tp=tp, pp=pp, dp=dp), ParallelConfig(tp=tp, pp=pp, dp=dp + 1), num_devices + replica


def run_one(model: str, size: int, scenario: str, repeat: int) -> dict:
    """One case in this (fresh) process: what the parent prints."""
    from etc_agent.planner import plan_model_migration

    spec = ModelSpec.from_yaml(model)
    [(name, old_cfg, new_cfg, new_size)] = [s for s in scenarios(size) if s[0] == scenario]
    old_devices, new_devices = devices(size), devices(new_size)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    plan = plan_model_migration(spec, old_cfg, old_devices, new_cfg, new_devices)
    first = time.perf_counter() - started
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        plan_model_migration(spec, old_cfg, old_devices, new_cfg, new_devices)
        times.append(time.perf_counter() - started)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bound = plan.lower_bound_bytes or 0
    return {
        "devices": size,
        "scenario": name,
        "from": old_cfg.short(),
        "to": new_cfg.short(),
        "new_devices": new_size,
        "first_plan_seconds": round(first, 3),
        "plan_seconds": round(statistics.median(times), 3) if times else None,
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "planning_rss_mib": round((peak_kib - baseline_kib) / 1024, 1),
        "bytes_moved": plan.bytes_moved,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "gap": round((plan.bytes_moved - bound) / plan.bytes_moved, 6) if plan.bytes_moved else 0.0,
        "num_messages": plan.num_messages,
        "num_rounds": plan.num_rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "configs/models/llama-70b.yaml"))
    parser.add_argument("--sizes", default="1024,4096,16384,65536")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeat", type=int, default=2, help="Plans after the first, in the same process.")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "SCENARIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.model, int(args.one[0]), args.one[1], args.repeat)))
        return
    spec = ModelSpec.from_yaml(args.model)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for scenario in args.scenarios.split(","):
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--model",
                    args.model,
                    "--repeat",
                    str(args.repeat),
                    "--one",
                    str(size),
                    scenario,
                ],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise SystemExit(f"{size} {scenario} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = Table(title=f"planner, {spec.name}, each case in a fresh process", header_style="bold")
    columns = ("devices", "scenario", "from -> to", "first plan s", "then s", "peak MiB", "moved", "lower bound", "gap")
    for col in columns:
        table.add_column(col, justify="left" if col in ("scenario", "from -> to") else "right")
    for r in rows:
        table.add_row(
            str(r["devices"]),
            r["scenario"],
            f"{r['from']} -> {r['to']}",
            f"{r['first_plan_seconds']:.2f}",
            "" if r["plan_seconds"] is None else f"{r['plan_seconds']:.2f}",
            f"{r['peak_rss_mib']:.0f}",
            fmt_bytes(r["bytes_moved"]),
            fmt_bytes(r["lower_bound_bytes"] or 0),
            f"{100 * r['gap']:.3f}%",
        )
    Console(width=180).print(table)
    print(json.dumps({"bench": "planner", "model": spec.name, "repeat": args.repeat, "results": rows}))


if __name__ == "__main__":
    main()
