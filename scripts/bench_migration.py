"""Migration benchmark through ``etcrun``: live migration vs the checkpoint baseline, same work.

Every transition is a real job (agents over the embedded store, the example GPT trained by the
worker API) that trains a few steps, changes once (a node joins or leaves, or ``etc-agent
reconfigure`` asks for another layout), and trains on. The two methods run alternately, each
repetition in a fresh job; the stall is the migration record's ``total_stall_s`` (training stopped
on the first rank until it resumed on the last), bytes are the record's bytes moved.

    python scripts/bench_migration.py --quick          # 1.1 MB model, 3 transitions, 1 repetition
    python scripts/bench_migration.py --small          # 1.1 MB model, every transition
    python scripts/bench_migration.py --repeat 3       # ~1 GB of state, every transition
    python scripts/bench_migration.py --megatron       # Megatron-core GPT + distributed optimizer, 384 MB of state
    python scripts/bench_migration.py --fsdp           # the Llama example under FSDP2 + TP / HSDP / pp, ~1 GB

With ``--fsdp`` the checkpoint way is FSDP2's own (``get_state_dict`` + DCP save, new interpreters,
DCP load into the new module's state dict + ``set_state_dict``; :mod:`etc_agent.worker.baseline`).

Prints a rich table and one JSON line, and writes a bar chart (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_demo import run_scenario

from etc_agent.sim.suites import BENCH_TRANSITIONS, FSDP_BENCH_TRANSITIONS, BenchTransition

# One definition of the suite, shared with the simulator's ``bench`` suite.
SUITE = BENCH_TRANSITIONS
QUICK = [SUITE[0], SUITE[2], SUITE[6]]

# --elementwise: the step is an elementwise update of the same state (no forward/backward), so a CPU
# run spends its time on the migration being measured, not on training; the state is the same.
MODEL_FULL = [
    "--hidden",
    "768",
    "--heads",
    "12",
    "--ffn",
    "3072",
    "--layers",
    "10",
    "--vocab",
    "8192",
    "--seq",
    "16",
    "--global-batch",
    "12",
    "--micro-batch",
    "1",
    "--elementwise",
]
"""~83.6 M parameters: fp32 weights + AdamW state = 1.0 GB."""
MODEL_QUICK = ["--layers", "10", "--global-batch", "12", "--micro-batch", "1", "--elementwise"]
"""The example's default widths with MODEL_FULL's 10 layers (same tensors, 1.1 MB): the fixed costs."""


LLAMA_MODULE = "etc_agent.examples.llama"
LLAMA_FULL = [
    *("--hidden", "768", "--heads", "12", "--kv-heads", "4", "--ffn", "2560", "--layers", "10"),
    *("--vocab", "8192", "--seq", "16", "--global-batch", "12", "--micro-batch", "1", "--elementwise"),
]
"""~87 M parameters: fp32 weights + AdamW state = 1.05 GB."""
LLAMA_QUICK = ["--layers", "10", "--global-batch", "12", "--micro-batch", "1", "--elementwise"]
"""The example's default widths with 10 layers (about 1 MB): the fixed costs."""

MEGATRON_MODULE = "etc_agent.examples.megatron_gpt"
MEGATRON_SUITE = [t for t in SUITE if "zero" not in t.name and "zero" not in t.event]
"""The Megatron example shards its optimizer with Megatron's distributed optimizer in every layout."""
MEGATRON_FULL = [
    "--layers",
    "8",
    "--hidden",
    "512",
    "--heads",
    "8",
    "--query-groups",
    "4",
    "--ffn",
    "1408",
    "--vocab",
    "8192",
    "--seq",
    "16",
    "--global-batch",
    "12",
]
"""~32 M parameters: fp32 weights + Adam moments = 384 MB (the fp32 main parameters are the weights)."""
MEGATRON_QUICK = ["--global-batch", "12"]
"""The example's default widths (0.8 MB of state)."""


PHASES = ("detect_s", "agree_s", "rebuild_s", "plan_s", "transfer_s")


def run_once(
    t: BenchTransition,
    method: str,
    model_args: list[str],
    steps: int,
    work: Path,
    module: str = "etc_agent.examples.gpt",
) -> dict:
    agent_args = (
        # torchrun restarts every worker as a new interpreter (no fork server) and loads the checkpoint.
        ["--migration", "checkpoint", "--start-method", "spawn", "--checkpoint-dir", str(work / "checkpoints")]
        if method == "checkpoint"
        else []
    )
    # Long enough never to end before the change; killed two steps after it (the record is what counts).
    result = run_scenario(
        t.parallel,
        2,
        10_000,
        0.0,
        work,
        echo=False,
        events=(t.event,),
        extra_script_args=model_args,
        agent_args=agent_args,
        initial_agents=t.initial_agents,
        event_steps=[1],
        stop_after=2,
        min_nodes=min(t.initial_agents, 2),
        module=module,
        slow_during_events=None,
    )
    records = [m for m in result["migrations"] if m.get("method", "live") == method]
    if len(records) != 1:
        raise RuntimeError(f"{t.name} / {method}: expected one migration record, got {len(records)}")
    return records[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="1.1 MB model, 3 transitions, 1 repetition unless --repeat (a spot check)."
    )
    ap.add_argument(
        "--small",
        action="store_true",
        help="The --quick model on every transition (fixed costs, for calibrate_sim.py).",
    )
    ap.add_argument(
        "--repeat", type=int, default=None, help="Repetitions of each method per transition (default 3; --quick 1)."
    )
    ap.add_argument("--only", default=None, help="Comma-separated substrings: run the transitions whose name matches.")
    ap.add_argument("--plot", type=Path, default=Path("bench_migration.png"))
    ap.add_argument(
        "--megatron",
        action="store_true",
        help="Train the Megatron-core example (GPTModel, Megatron DDP, distributed "
        "optimizer) instead of the DTensor one; the transitions without zero (with --quick: its small widths).",
    )
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="Train the Llama example with FSDP2 (+ TP, HSDP, pipeline stages) through the fsdp transitions.",
    )
    ap.add_argument(
        "--methods", default="live,checkpoint", help="Comma-separated subset of live,checkpoint (profiling one side)."
    )
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    suite = QUICK if args.quick else SUITE
    module = "etc_agent.examples.gpt"
    if args.megatron and args.fsdp:
        ap.error("--megatron and --fsdp are different examples: give one")
    if args.megatron:
        suite, module = [t for t in suite if t in MEGATRON_SUITE], MEGATRON_MODULE
    if args.fsdp:
        suite, module = FSDP_BENCH_TRANSITIONS[:3] if args.quick else FSDP_BENCH_TRANSITIONS, LLAMA_MODULE
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        suite = [t for t in suite if any(w in t.name for w in wanted)]
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 3
    if repeat < 1:
        ap.error("--repeat must be at least 1")
    methods = tuple(m.strip() for m in args.methods.split(","))
    if not methods or not set(methods) <= {"live", "checkpoint"}:
        ap.error(f"--methods: expected live and/or checkpoint, got {args.methods!r}")
    model_args = MODEL_QUICK if args.quick or args.small else MODEL_FULL
    if args.megatron:
        model_args = MEGATRON_QUICK if args.quick or args.small else MEGATRON_FULL
    if args.fsdp:
        model_args = LLAMA_QUICK if args.quick or args.small else LLAMA_FULL
    steps = 0  # unused: each job is stopped two steps after its change
    console = Console(stderr=True)
    rows = []
    started = time.monotonic()
    for t in suite:
        samples: dict[str, list[dict]] = {"live": [], "checkpoint": []}
        for rep in range(repeat):
            for method in methods if rep % 2 == 0 else methods[::-1]:
                with tempfile.TemporaryDirectory(prefix="etc-bench-") as tmp:
                    record = run_once(t, method, model_args, steps, Path(tmp), module)
                samples[method].append(record)
                console.print(
                    f"{t.name:38s} {method:10s} rep {rep + 1}: stall {record['total_stall_s']:.3f} s, "
                    f"moved {record['bytes_moved'] / 1e6:.1f} MB"
                )
        rows.append(_row(t, samples))
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    summary = {
        "suite": "quick" if args.quick else "small" if args.small else "full",
        "model": module,
        "repeat": repeat,
        "transitions": rows,
        "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "wall_s": round(time.monotonic() - started, 1),
    }

    table = Table(title=f"migration stall, live vs checkpoint (medians of {repeat})")
    for col in ("transition", "from -> to", "live s", "checkpoint s", "ratio", "moved MB", "checkpoint MB", "state MB"):
        table.add_column(col)
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        table.add_row(
            r["name"],
            f"{r['from']} -> {r['to']}",
            _fmt(r["etc_s"], ".3f"),
            _fmt(r["ckpt_s"], ".3f"),
            ratio,
            _fmt(r["bytes_moved"], ".1f", 1e6),
            _fmt(r["checkpoint_bytes"], ".1f", 1e6),
            _fmt(r["state_bytes"], ".1f", 1e6),
        )
    Console().print(table)
    print(json.dumps(summary))
    _plot(rows, args.plot)


def _median(records: list[dict], key: str) -> float | None:
    return round(statistics.median(r[key] for r in records), 4) if records else None


def _median_parts(records: list[dict]) -> dict[str, float] | None:
    """The median of each named part of the live stalls (the slowest rank's, as each record has them)."""
    parts = [r["stall_parts"] for r in records if r.get("stall_parts")]
    if not parts:
        return None
    return {name: round(statistics.median(p[name] for p in parts), 4) for name in parts[0]}


def _row(t: BenchTransition, samples: dict[str, list[dict]]) -> dict:
    live, ckpt = samples["live"], samples["checkpoint"]
    etc_s, ckpt_s = _median(live, "total_stall_s"), _median(ckpt, "total_stall_s")
    first = (live or ckpt)[0]
    return {
        "name": t.name,
        "from": first["old_config"],
        "to": first["new_config"],
        "etc_s": etc_s,
        "ckpt_s": ckpt_s,
        "ratio": round(ckpt_s / etc_s, 3) if etc_s and ckpt_s else None,
        "bytes_moved": live[0]["bytes_moved"] if live else None,
        "checkpoint_bytes": ckpt[0]["bytes_moved"] if ckpt else None,
        "state_bytes": first["state_bytes"],
        "etc_phases_s": {k: _median(live, k) for k in PHASES},
        "ckpt_phases_s": {k: _median(ckpt, k) for k in PHASES},
        "etc_stall_parts_s": _median_parts(live),
        "etc_samples_parts_s": [r.get("stall_parts") for r in live],
        "etc_planned_ahead": [r.get("planned_ahead", False) for r in live],
        "etc_samples_s": [r["total_stall_s"] for r in live],
        "ckpt_samples_s": [r["total_stall_s"] for r in ckpt],
    }


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["etc_s"] or 0 for r in rows], width=0.4, label="live (ETC)")
    ax.bar(
        [x + 0.2 for x in xs], [r["ckpt_s"] or 0 for r in rows], width=0.4, label="checkpoint (DCP save, restart, load)"
    )
    ax.set_xticks(list(xs), [r["name"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("stall (s, median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
