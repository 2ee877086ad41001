"""Crash benchmark: a worker (or a whole node) is SIGKILLed while a replica holds its state.

The example GPT on 2 agents x 2 workers (``--nnodes 1:2``), side by side in one run:

- ``live`` (``etcrun`` defaults): the other node goes on at once without the crashed worker's node
  (its replica holds everything); that node hands the worker's place to its warm spare process
  (the kill comes once one is ready) and rejoins once it runs;
- ``live-forked`` (``--spare-worker off``): the same, the worker forked again from the fork server;
- ``checkpoint``: the way a ``torchrun`` job recovers: every worker restarts and loads the newest
  periodic checkpoint with resharding (``--migration checkpoint``; the kill comes right after a
  checkpoint completed, the most favourable moment for it), and trains the steps since again.

Cases: ``worker`` (SIGKILL of one worker, pure data parallel ``dp=auto``), ``node`` (SIGKILL
of a whole agent with its workers, ``tp=2,dp=auto`` with ``--placement resilient``) and
``in-place`` (SIGKILL of one worker, ``tp=2,dp=auto`` with ``--nnodes 2:2``: the survivors may not
shrink, so they wait for the killed worker's restart in place and its state from a replica).

Figures, from the SIGKILL (wall clock, one machine): ``stall_s`` until the survivors finished their
first step after it; ``lost_s``, the time the crash cost beyond training: the interval from the last
step finished before the kill to the first one after it, less one step of the layout the survivors
train in (the median interval of the next steps), so the interrupted step's work and the switch;
``full_strength_s`` until a step trained again with every worker of before (``worker`` only; a
killed node does not come back); ``redone_steps``, steps trained twice.

    python scripts/bench_crash.py --quick               # 1.1 MB of state, 1 repetition
    python scripts/bench_crash.py --size 300mb          # ~320 MB data-parallel job, 3 repetitions
    python scripts/bench_crash.py --size 1gb --case node

Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_migration import MODEL_FULL, MODEL_QUICK
from elastic_demo import run_scenario

INTERVAL = 4
MODEL_300MB = [*MODEL_FULL[: MODEL_FULL.index("--layers")], "--layers", "2", *MODEL_FULL[MODEL_FULL.index("--vocab") :]]
"""MODEL_FULL's widths with 2 layers: ~26.8 M parameters, fp32 weights + AdamW state = 320 MB."""
SIZES = {"quick": MODEL_QUICK, "300mb": MODEL_300MB, "1gb": MODEL_FULL}
CASES = {
    "worker": ("tp=1,pp=1,dp=auto", "kill", [], 1),
    "node": ("tp=2,pp=1,dp=auto", "kill-agent", ["--placement", "resilient"], 1),
    "in-place": ("tp=2,pp=1,dp=auto", "kill", [], 2),
}
"""case -> (--parallel, event, extra agent flags, --nnodes MIN)"""
METHODS = ("live", "live-forked", "checkpoint")
"""live: etcrun's defaults (the crashed worker's place taken by its node's warm spare); live-forked:
--spare-worker off (forked again); checkpoint: the torchrun way. A killed node has no spare to use."""


def run_once(case: str, method: str, model_args: list[str], work: Path) -> dict:
    parallel, event, case_args, min_nodes = CASES[case]
    agent_args = ["--checkpoint-dir", str(work / "checkpoints"), "--checkpoint-interval", str(INTERVAL), *case_args]
    every_agent = None
    if method == "checkpoint":
        # torchrun restarts every worker as a new interpreter (no fork server) and loads the checkpoint.
        agent_args += ["--migration", "checkpoint", "--start-method", "spawn"]
    elif method == "live-forked":
        agent_args += ["--spare-worker", "off"]  # the crashed worker is forked again
    elif case != "node":
        every_agent = '"spare_worker_ready"'  # the crashed node's warm spare takes the worker's place
    result = run_scenario(
        parallel,
        2,
        10_000,
        0.0,
        work,
        echo=False,
        events=(event,),
        extra_script_args=model_args,
        agent_args=agent_args,
        min_nodes=min_nodes,
        event_steps=[INTERVAL + 1],
        stop_after=3,
        event_after_text='"etc_checkpoint"',
        event_after_every_agent=every_agent,
        slow_during_events=None,
    )
    killed = result["events"][0]
    records = [json.loads(line) for line in (work / "loss.jsonl").read_text().splitlines()]
    before = [r for r in records if r["wall"] <= killed["wall"]]
    # The layout the kill broke (the job may have started on one agent and grown to two).
    full_config = max(before, key=lambda r: r["wall"])["config"]
    # The first step trained in a generation after the kill (a step in flight may still log after it).
    at_kill = max(r["generation"] for r in before)
    after = sorted((r for r in records if r["generation"] > at_kill), key=lambda r: r["wall"])
    if not after:
        raise RuntimeError(f"{case}/{method}: no step trained after the kill\n" + result["cluster"].tail())
    resumed = after[0]
    last_before = max(r["wall"] for r in before)
    # One step of the survivors' layout: the median interval between its next steps (not the
    # full-strength layout's, which a rejoin brings back).
    same = [r["wall"] for r in after if r["config"] == resumed["config"] and r["generation"] == resumed["generation"]]
    intervals = [b - a for a, b in zip(same, same[1:])][:INTERVAL]
    step_s = statistics.median(intervals) if intervals else None
    # A killed node does not come back; a restarted worker's node does (at once, for the baseline).
    back = None if case == "node" else next((r for r in after if r["config"] == full_config), None)
    return {
        "case": case,
        "method": method,
        "stall_s": round(resumed["wall"] - killed["wall"], 3),
        "lost_s": round(resumed["wall"] - last_before - step_s, 3) if step_s is not None else None,
        "step_s": round(step_s, 3) if step_s is not None else None,
        "full_strength_s": round(back["wall"] - killed["wall"], 3) if back else None,
        "killed_at_step": killed["step"],
        "resumed_at_step": resumed["step"],
        # The step in flight when the kill came is lost (trained again) unless it logged after it.
        "redone_steps": max(killed["step"] + 1 - resumed["step"], 0),
        "records": [
            {
                k: m.get(k)
                for k in (
                    "reason",
                    "new_world_size",
                    "bytes_moved",
                    "state_bytes",
                    "detect_s",
                    "leave_spread_s",
                    "agree_s",
                    "rebuild_s",
                    "plan_s",
                    "transfer_s",
                    "total_stall_s",
                    "stall_parts",
                )
            }
            for m in result["migrations"]
        ],
    }


def _fmt(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="--size quick, 1 repetition unless --repeat.")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="Model size (default 300mb).")
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="Cases to run (default: worker, node).")
    ap.add_argument("--repeat", type=int, default=None, help="Repetitions per method (default 3; --quick 1).")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    size = args.size or ("quick" if args.quick else "300mb")
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 3
    cases = args.case or ["worker", "node"]
    methods = {case: METHODS if case != "node" else ("live", "checkpoint") for case in cases}
    runs: dict[tuple[str, str], list[dict]] = {(c, m): [] for c in cases for m in methods[c]}
    # A run ends by SIGKILL of its agents (stop_after); their workers die with them within a fraction
    # of a second, and one still writing its checkpoint then can refill a directory being removed.
    with tempfile.TemporaryDirectory(prefix="bench-crash-", ignore_cleanup_errors=True) as tmp:
        for case in cases:
            for rep in range(repeat):
                for method in methods[case] if rep % 2 == 0 else methods[case][::-1]:
                    work = Path(tmp) / f"{case}-{method}-{rep}"
                    work.mkdir()
                    runs[case, method].append(run_once(case, method, SIZES[size], work))
                    print(
                        json.dumps({"event": "bench_crash_run", **runs[case, method][-1]}), file=sys.stderr, flush=True
                    )

    def median(key: tuple[str, str], field: str) -> float | None:
        values = [r[field] for r in runs[key] if r[field] is not None]
        return statistics.median(values) if values else None

    table = Table(title=f"Crash recovery ({size} model, 2 agents x 2, kill after a checkpoint; medians of {repeat})")
    for column in ("case", "method", "survivor stall s", "lost s", "step s", "full strength s", "redone", "ratio"):
        table.add_column(column, justify="right")
    summary = {}
    for case in cases:
        live, base = median((case, "live"), "stall_s"), median((case, "checkpoint"), "stall_s")
        summary[case] = {
            "live_stall_s": live,
            "checkpoint_stall_s": base,
            "speedup": round(base / live, 2),
            "live_lost_s": median((case, "live"), "lost_s"),
            "checkpoint_lost_s": median((case, "checkpoint"), "lost_s"),
        }
        if "live-forked" in methods[case]:
            summary[case]["live_forked_stall_s"] = median((case, "live-forked"), "stall_s")
        for method in methods[case]:
            full = median((case, method), "full_strength_s")
            table.add_row(
                case,
                method,
                f"{median((case, method), 'stall_s'):.2f}",
                _fmt(median((case, method), "lost_s")),
                _fmt(median((case, method), "step_s")),
                f"{full:.2f}" if full is not None else "-",
                f"{median((case, method), 'redone_steps'):.0f}",
                f"{base / median((case, method), 'stall_s'):.1f}x" if method != "checkpoint" else "",
            )
    Console().print(table)
    print(
        json.dumps(
            {
                "bench": "crash",
                "size": size,
                "repeat": repeat,
                "summary": summary,
                "runs": {f"{c}/{m}": r for (c, m), r in runs.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
