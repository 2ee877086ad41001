"""Lost-state recovery benchmark: a worker holding the only copy of some state is killed.

Both methods keep periodic asynchronous checkpoints (``--checkpoint-interval``) in the same job
(the example GPT, ZeRO-1 over dp=4: each rank's optimizer range has no replica), and the kill comes
right after a checkpoint completed:

- ``live``: the survivors stay; their snapshots of the checkpointed step move device to device
  and only the killed rank's regions are read from storage (``etcrun`` default);
- ``checkpoint``: the baseline (``--migration checkpoint``, what a ``torchrun`` job does): every
  worker restarts and loads the whole checkpoint with resharding.

Both then train the steps since the checkpoint again. The stall is measured the same way for both:
from the SIGKILL to the end of the first step trained after it (wall clock, one machine), so
detection, restarts, reads and the redone step are all in it.

    python scripts/bench_restore.py --quick      # 1.1 MB of state, 1 repetition
    python scripts/bench_restore.py              # ~1 GB of state, 3 repetitions

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

PARALLEL = "tp=1,pp=1,dp=auto,zero=1"
INTERVAL = 4


def run_once(method: str, model_args: list[str], work: Path) -> dict:
    agent_args = ["--checkpoint-dir", str(work / "checkpoints"), "--checkpoint-interval", str(INTERVAL)]
    if method == "checkpoint":
        # torchrun restarts every worker as a new interpreter (no fork server) and loads the checkpoint.
        agent_args += ["--migration", "checkpoint", "--start-method", "spawn"]
    # The kill comes once the first checkpoint is complete, a step or two after it.
    result = run_scenario(
        PARALLEL,
        2,
        10_000,
        0.0,
        work,
        echo=False,
        events=("kill",),
        extra_script_args=model_args,
        agent_args=agent_args,
        event_steps=[INTERVAL + 1],
        stop_after=2,
        event_after_text='"etc_checkpoint"',
        slow_during_events=None,
    )
    killed = result["events"][0]
    records = [json.loads(line) for line in (work / "loss.jsonl").read_text().splitlines()]
    after = [r for r in records if r["wall"] > killed["wall"] and r["generation"] > 0]
    if not after:
        raise RuntimeError(f"{method}: no step trained after the kill\n" + result["cluster"].tail())
    resumed = min(after, key=lambda r: r["wall"])
    migrations = [m for m in result["migrations"] if m.get("method", "live") == method]
    if len(migrations) != 1:
        raise RuntimeError(
            f"{method}: expected one migration record, got {len(migrations)}\n" + result["cluster"].tail()
        )
    record = migrations[0]
    return {
        "method": method,
        "stall_s": round(resumed["wall"] - killed["wall"], 3),
        "record_stall_s": record["total_stall_s"],
        "killed_at_step": killed["step"],
        "resumed_at_step": resumed["step"],
        "redone_steps": killed["step"] + 1 - record["step"],
        "bytes_read_from_storage": record["bytes_restored"],
        "state_bytes": record["state_bytes"],
        "bytes_moved_between_devices": record["bytes_moved"] if method == "live" else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1.1 MB model, 1 repetition unless --repeat.")
    ap.add_argument("--repeat", type=int, default=None, help="Repetitions per method (default 3; --quick 1).")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 3
    model_args = MODEL_QUICK if args.quick else MODEL_FULL
    runs: dict[str, list[dict]] = {"live": [], "checkpoint": []}
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as tmp:
        for rep in range(repeat):
            for method in ("live", "checkpoint") if rep % 2 == 0 else ("checkpoint", "live"):
                work = Path(tmp) / f"{method}-{rep}"
                work.mkdir()
                runs[method].append(run_once(method, model_args, work))
                print(json.dumps({"event": "bench_restore_run", **runs[method][-1]}), file=sys.stderr, flush=True)

    def median(method: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[method])

    table = Table(
        title=f"Lost-state recovery ({PARALLEL} on 2 agents x 2, kill after a checkpoint; medians of {repeat})"
    )
    for column in ("method", "stall s", "read from storage", "moved device to device", "state", "redone steps"):
        table.add_column(column, justify="right")
    for method in ("live", "checkpoint"):
        table.add_row(
            method,
            f"{median(method, 'stall_s'):.2f}",
            f"{median(method, 'bytes_read_from_storage') / 1e6:.1f} MB",
            f"{median(method, 'bytes_moved_between_devices') / 1e6:.1f} MB",
            f"{median(method, 'state_bytes') / 1e6:.1f} MB",
            f"{median(method, 'redone_steps'):.0f}",
        )
    Console().print(table)
    ratio = median("checkpoint", "stall_s") / median("live", "stall_s")
    print(
        json.dumps(
            {
                "bench": "restore",
                "model": "quick" if args.quick else "full",
                "repeat": repeat,
                "parallel": PARALLEL,
                "live_stall_s": median("live", "stall_s"),
                "checkpoint_stall_s": median("checkpoint", "stall_s"),
                "speedup": round(ratio, 2),
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
