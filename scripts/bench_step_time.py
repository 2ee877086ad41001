"""Steady-state step time: the same training script under ``torchrun`` and under ``etcrun``.

The example GPT (``etc_agent.examples.gpt``, synthetic data, one thread per worker) trains for
``--steps`` steps under each launcher; a run's figure is the median gap between consecutive steps'
wall-clock stamps after ``--warmup`` steps (so the step boundary, where an elastic job's agreement
runs, is inside every gap). Runs alternate launchers (torchrun, etcrun, torchrun, ...) so that
machine noise hits all alike; the table gives each launcher's median over runs and its ratio to
torchrun's.

    python scripts/bench_step_time.py                      # 5 runs each, 2 workers, dp=2
    python scripts/bench_step_time.py --runs 7 --steps 400
    python scripts/bench_step_time.py --parallel tp=2,pp=1,dp=1   # a sharded layout (commit barrier)

``--variant NAME="[KEY=VALUE ...] ETCRUN FLAGS"`` adds an etcrun run with those environment
variables and extra flags to every round (``--variant no-spare="--spare-worker off"``: without the
warm spare worker). The last column is the share of the measured gaps during which the agent's
warm spare was ready (it starts once the job trained 2 s undisturbed). "launcher CPU" is the
launcher process's own CPU time (torchrun's agent, etcrun's agent; not its workers) over the run's
wall time, in percent of one core, read from ``/proc`` while it runs.
Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

MODEL = "--data synthetic --hidden 128 --ffn 512 --layers 4 --seq 64 --global-batch 8".split()


def launcher(name: str, extra: list[str]) -> list[str]:
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"]
    # Every event on the console: the spare's readiness is read from it (a few lines a run).
    return [sys.executable, "-m", "etc_agent.cli.etcrun", "--log-level", "info", *extra]


def step_walls(stdout: str) -> list[float]:
    return [json.loads(line)["wall"] for line in stdout.splitlines() if line.startswith('{"step"')]


def step_gap_s(stdout: str, warmup: int) -> float:
    """The median gap between consecutive steps' stamps, after the first ``warmup`` steps."""
    walls = step_walls(stdout)
    gaps = [later - earlier for earlier, later in zip(walls[warmup:], walls[warmup + 1 :])]
    if len(gaps) < 10:
        raise SystemExit(f"only {len(walls)} steps were reported; raise --steps above --warmup")
    return statistics.median(gaps)


def spare_share(stdout: str, stderr: str, warmup: int) -> float | None:
    """The share of the measured gaps that began once the agent's warm spare worker was ready
    (etcrun's log line ``spare_worker_ready``); None for a run without one."""
    for line in stderr.splitlines():
        if "spare_worker_ready" in line:
            ready = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            break
    else:
        return None
    starts = step_walls(stdout)[warmup:-1]
    return round(sum(start >= ready for start in starts) / len(starts), 3) if starts else None


@dataclass
class RunResult:
    gap_s: float
    """The median gap between consecutive steps after the warm-up."""
    spare_share: float | None
    """The share of measured gaps with the warm spare ready (None: no spare)."""
    launcher_cpu: float | None
    """The launcher process's CPU time over the run's wall time (None where /proc is not readable)."""


def cpu_seconds(pid: int) -> float | None:
    """``pid``'s own user + system CPU time so far (not its children's), from ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch_cpu(process: subprocess.Popen, samples: list[float]) -> None:
    """Sample the process's CPU time every 0.2 s until it exits (the last sample is its total)."""
    while process.poll() is None:
        seconds = cpu_seconds(process.pid)
        if seconds is not None:
            samples.append(seconds)
        time.sleep(0.2)


def run_once(name: str, extra: list[str], args: argparse.Namespace, work: Path) -> RunResult:
    # Leading KEY=VALUE tokens are the environment; the rest are flags (whose values may hold "=").
    num_variables = next((i for i, token in enumerate(extra) if token.startswith("-") or "=" not in token), len(extra))
    variables = dict(token.split("=", 1) for token in extra[:num_variables])
    extra = extra[num_variables:]
    command = [
        *launcher(name, extra),
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "-m",
        "etc_agent.examples.gpt",
        "--steps",
        str(args.steps),
        "--parallel",
        args.parallel,
        *MODEL,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ETC_DATA_DIR": str(work), **variables}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    samples: list[float] = []
    watcher = threading.Thread(target=watch_cpu, args=(process, samples), daemon=True)
    watcher.start()
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        raise SystemExit(f"{name} ran past 600 s") from None
    wall_s = time.monotonic() - started
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{name} failed (exit {process.returncode}):\n{stderr[-3000:]}")
    cpu = samples[-1] / wall_s if samples else None
    return RunResult(step_gap_s(stdout, args.warmup), spare_share(stdout, stderr, args.warmup), cpu)


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {"torchrun": [], "etcrun": []}
    for spec in specs:
        name, _, flags = spec.partition("=")
        if not name or name in runs:
            raise SystemExit(f"--variant {spec!r}: give NAME=FLAGS with a new name")
        runs[name] = shlex.split(flags)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each launcher")
    parser.add_argument("--nproc", type=int, default=2, help="workers per launch (dp = nproc)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start of each run")
    parser.add_argument("--parallel", default="tp=1,pp=1,dp=auto", help="the example's layout, under both launchers")
    parser.add_argument("--variant", action="append", default=[], help='NAME="extra etcrun flags"')
    args = parser.parse_args()
    runs = parse_variants(args.variant)
    results: dict[str, list[RunResult]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="etc-step-time-") as tmp:
        for _ in range(args.runs):
            for name, extra in runs.items():
                results[name].append(run_once("torchrun" if name == "torchrun" else "etcrun", extra, args, Path(tmp)))
    gaps = {name: [r.gap_s for r in values] for name, values in results.items()}
    median = {name: statistics.median(values) for name, values in gaps.items()}
    cpu = {name: [r.launcher_cpu for r in values if r.launcher_cpu is not None] for name, values in results.items()}
    spare = {name: [r.spare_share for r in values] for name, values in results.items()}
    title = f"step time, example GPT, {args.parallel}, {args.nproc} workers, {args.runs} alternating runs each"
    table = Table(title=title)
    columns = ("launcher", "median ms", "min ms", "max ms", "vs torchrun", "with spare ready", "launcher CPU")
    for column in columns:
        table.add_column(column, justify="left" if column == "launcher" else "right")
    for name, values in gaps.items():
        ratio = median[name] / median["torchrun"]
        shares = [share for share in spare[name] if share is not None]
        table.add_row(
            name,
            f"{median[name] * 1e3:.2f}",
            f"{min(values) * 1e3:.2f}",
            f"{max(values) * 1e3:.2f}",
            f"{ratio:.3f}",
            f"{statistics.median(shares):.0%} of gaps" if shares else "-",
            f"{statistics.median(cpu[name]):.1%} of a core" if cpu[name] else "-",
        )
    Console().print(table)
    result = {
        "benchmark": "step_time",
        "nproc": args.nproc,
        "parallel": args.parallel,
        "runs": args.runs,
        "steps": args.steps,
        "median_step_ms": {name: round(value * 1e3, 3) for name, value in median.items()},
        "ratio_to_torchrun": {name: round(value / median["torchrun"], 4) for name, value in median.items()},
        "step_ms": {name: [round(v * 1e3, 3) for v in values] for name, values in gaps.items()},
        "spare_ready_share": spare,
        "launcher_cpu_share": {name: [round(v, 4) for v in values] for name, values in cpu.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
