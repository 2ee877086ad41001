"""A node joins a running plain-script job: how long the others' restart waits, side by side.

Two agents (embedded store, one worker each) train ``etc_agent.examples.plain_ddp`` (DDP, resuming
from its own checkpoint); once they run at world size 2 a third agent joins. A plain script's
workers restart on a membership change (as under torchrun), so the figures are, on the two
survivors: from ``generation_seen`` (the agent read the generation with the newcomer) to
``workers_started`` (its new workers forked), and from ``generation_seen`` to the first step the
job trains at world size 3 (every rank in ``init_process_group``, the checkpoint loaded, one DDP
step). Measured for ``--start-method forkserver`` (the default: the joiner warms its fork server
before it registers, the survivors fork from theirs) and ``--start-method spawn`` (each worker a
new interpreter, as torchrun starts them), alternating, medians of ``--runs``.

    python scripts/bench_plain_join.py            # 3 runs each
    python scripts/bench_plain_join.py --runs 5

Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_demo import free_port, json_line_event
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def _progress(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"step": 0, "world_size": 0}


def _events(text: str) -> list[dict]:
    return [event for line in text.splitlines() if (event := json_line_event(line)) is not None]


def run_once(start_method: str, work: Path) -> dict[str, float]:
    """One join; the survivors' figures (the slower of the two) in seconds."""
    run_id = f"join-{start_method}-{os.getpid()}-{time.monotonic_ns() % 100000}"
    endpoint = f"127.0.0.1:{free_port()}"
    out = work / run_id
    out.mkdir(parents=True)
    progress = out / "progress.json"
    common = [
        *("--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
        *("--rdzv-id", run_id, "--log-format", "json", "--start-method", start_method),
    ]
    script = [
        *("-m", "etc_agent.examples.plain_ddp", "--steps", "100000", "--step-delay", "0.05"),
        *("--checkpoint-dir", str(out / "ckpt"), "--progress", str(progress)),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [open(out / f"agent{i}.log", "w") for i in range(3)]

    def start(i: int) -> subprocess.Popen:
        host = ["--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}"]
        return subprocess.Popen(
            [sys.executable, "-m", "etc_agent.cli.etcrun", *common, *host, *script],
            cwd=ROOT,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            env=env,
        )

    agents = [start(0), start(1)]
    try:
        deadline = time.monotonic() + 120
        while not (_progress(progress)["world_size"] == 2 and _progress(progress)["step"] > 5):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise SystemExit(f"{start_method}: two agents never trained together; see {out}")
            time.sleep(0.05)
        agents.append(start(2))
        while _progress(progress)["world_size"] != 3:
            if time.monotonic() > deadline + 60 or any(a.poll() is not None for a in agents):
                raise SystemExit(f"{start_method}: the join never trained; see {out}")
            time.sleep(0.02)
        first_step_at = _progress(progress)["time"]
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGKILL)
            a.wait(timeout=30)
        for f in logs:
            f.close()
    figures = {"seen_to_started_s": 0.0, "seen_to_first_step_s": 0.0}
    for i in (0, 1):
        events = _events((out / f"agent{i}.log").read_text())
        seen = next(e for e in events if e["event"] == "generation_seen" and e.get("members") == 3)
        started = next(e for e in events if e["event"] == "workers_started" and e["generation"] == seen["generation"])
        figures["seen_to_started_s"] = max(figures["seen_to_started_s"], started["ts"] - seen["ts"])
        figures["seen_to_first_step_s"] = max(figures["seen_to_first_step_s"], first_step_at - seen["ts"])
    joiner = _events((out / "agent2.log").read_text())
    warm = next((e for e in joiner if e["event"] == "fork_server_warm"), None)
    figures["joiner_warm_up_s"] = warm["seconds"] if warm else 0.0
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="joins per start method")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etc-join-"))
    methods = ("forkserver", "spawn")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for _ in range(args.runs):
        for method in methods:
            results[method].append(run_once(method, work))
    medians = {m: {k: round(statistics.median(r[k] for r in results[m]), 3) for k in results[m][0]} for m in methods}
    table = Table(title=f"a join of a running plain-script job (survivors, median of {args.runs})")
    for column in ("start method", "generation_seen -> workers_started", "-> first step at 3", "joiner warm-up"):
        table.add_column(column, justify="right")
    for m in methods:
        table.add_row(
            m,
            f"{medians[m]['seen_to_started_s']:.3f} s",
            f"{medians[m]['seen_to_first_step_s']:.3f} s",
            f"{medians[m]['joiner_warm_up_s']:.2f} s",
        )
    Console().print(table)
    ratio = medians["spawn"]["seen_to_first_step_s"] / max(medians["forkserver"]["seen_to_first_step_s"], 1e-9)
    print(
        json.dumps(
            {
                "bench": "plain_join",
                "runs": args.runs,
                "median": medians,
                "all": results,
                "first_step_ratio_spawn_over_forkserver": round(ratio, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
