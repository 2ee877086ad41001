"""Start-up overhead of a plain script: ``etcrun`` vs ``torchrun``, side by side in one run.

Both launch ``--standalone --nproc-per-node N`` on a script that only prints its rank (no torch
import in the workers), so the figure is the launcher's own cost: agent start, rendezvous, worker
spawn, and shutdown after the workers exit. Runs alternate (torchrun, etcrun, torchrun, ...) so
that machine noise hits both alike; medians and the difference are reported.

    python scripts/bench_startup.py            # 5 runs each, 2 workers
    python scripts/bench_startup.py --runs 9 --nproc 4

Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SCRIPT = 'import os\nprint("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)\n'


def launcher(name: str) -> list[str]:
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, "-m", "etc_agent.cli.etcrun"]


def run_once(name: str, script: Path, nproc: int) -> float:
    command = [*launcher(name), "--standalone", "--nproc-per-node", str(nproc), str(script)]
    started = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    seconds = time.perf_counter() - started
    ranks = sum(1 for line in done.stdout.splitlines() if line.startswith("rank ") or "]:rank " in line)
    if done.returncode != 0 or ranks != nproc:
        raise SystemExit(
            f"{name} failed (exit {done.returncode}, {ranks}/{nproc} ranks printed):\n{done.stderr[-2000:]}"
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each launcher")
    parser.add_argument("--nproc", type=int, default=2, help="workers per launch")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etc-startup-"))
    try:
        script = work / "print_rank.py"
        script.write_text(SCRIPT)
        times: dict[str, list[float]] = {"torchrun": [], "etcrun": []}
        run_once("etcrun", script, args.nproc)  # warm the page cache for both (same interpreter, same torch)
        for _ in range(args.runs):
            for name in times:
                times[name].append(run_once(name, script, args.nproc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    table = Table(
        title=f"start-up of a plain script, --standalone --nproc-per-node {args.nproc}, {args.runs} runs each"
    )
    for column in ("launcher", "median s", "min s", "max s"):
        table.add_column(column, justify="left" if column == "launcher" else "right")
    for name, values in times.items():
        table.add_row(name, f"{median[name]:.2f}", f"{min(values):.2f}", f"{max(values):.2f}")
    Console().print(table)
    result = {
        "benchmark": "startup",
        "nproc": args.nproc,
        "runs": args.runs,
        "torchrun_median_s": round(median["torchrun"], 3),
        "etcrun_median_s": round(median["etcrun"], 3),
        "overhead_s": round(median["etcrun"] - median["torchrun"], 3),
        "torchrun_s": [round(t, 3) for t in times["torchrun"]],
        "etcrun_s": [round(t, 3) for t in times["etcrun"]],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
