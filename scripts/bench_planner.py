#!/usr/bin/env python
"""Planner timings from 8 to 1024 devices (8 per node) on real model specs.

For each cluster size: the DP degree shrinks by one (a replica's nodes leave), grows by one (new
nodes join), and the shrink again with ZeRO-1 (every optimizer shard moves). Prints a table and
one JSON line with the median of ``--repeat`` runs.

    python scripts/bench_planner.py [--model configs/models/llama-70b.yaml] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from etc_agent.cli.report import fmt_bytes  # noqa: E402
from etc_agent.layout import DeviceSet, ModelSpec, ParallelConfig  # noqa: E402
from etc_agent.planner import plan_model_migration  # noqa: E402

SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
PER_NODE = 8


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "configs/models/llama-70b.yaml"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-devices", type=int, default=1024)
    args = parser.parse_args()
    spec = ModelSpec.from_yaml(args.model)
    rows = []
    for size in [s for s in SIZES if s <= args.max_devices]:
        for name, old_cfg, new_cfg, new_size in scenarios(size):
            times, plan = [], None
            for _ in range(args.repeat):
                started = time.perf_counter()
                plan = plan_model_migration(spec, old_cfg, devices(size), new_cfg, devices(new_size))
                times.append(time.perf_counter() - started)
            rows.append(
                {
                    "devices": size,
                    "scenario": name,
                    "from": old_cfg.short(),
                    "to": new_cfg.short(),
                    "new_devices": new_size,
                    "plan_seconds": statistics.median(times),
                    "bytes_moved": plan.bytes_moved,
                    "lower_bound_bytes": plan.lower_bound_bytes,
                    "naive_bytes_moved": plan.naive_bytes_moved,
                    "num_messages": plan.num_messages,
                    "num_rounds": plan.num_rounds,
                }
            )
    table = Table(title=f"planner time, {spec.name} (median of {args.repeat})", header_style="bold")
    for col in ("devices", "scenario", "from -> to", "plan s", "moved", "lower bound", "naive", "messages", "rounds"):
        table.add_column(col, justify="left" if col in ("scenario", "from -> to") else "right")
    for r in rows:
        table.add_row(
            str(r["devices"]),
            r["scenario"],
            f"{r['from']} -> {r['to']}",
            f"{r['plan_seconds']:.3f}",
            fmt_bytes(r["bytes_moved"]),
            fmt_bytes(r["lower_bound_bytes"]),
            fmt_bytes(r["naive_bytes_moved"]),
            str(r["num_messages"]),
            str(r["num_rounds"]),
        )
    Console(width=160).print(table)
    print(json.dumps({"bench": "planner", "model": spec.name, "repeat": args.repeat, "results": rows}))


if __name__ == "__main__":
    main()
