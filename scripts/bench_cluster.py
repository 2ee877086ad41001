"""Partitions and etcd failures on hosts made of network namespaces: what each costs the job.

    sudo python scripts/bench_cluster.py                 # every scenario once
    sudo python scripts/bench_cluster.py --repeat 3 --only cut

Scenarios (``scripts/cluster_scenarios.py``; the same ones ``tests/test_cluster.py`` asserts on):
a non-leader host cut off silently for ``--cut-s``, the leader's host cut off the same way, the host
of training rank 0 cut off from etcd alone for ``--etcd-cut-s`` (detect: when it fenced itself;
rejoin: from etcd answering it again to its first step back), the etcd leader of 3 members killed
for good, 2 of 3 etcd members cut off for ``--cut-s`` (quorum lost; stall: the longest gap between
steps), and a host whose link is shaped by ``tc tbf`` joining.
Prints a table (scenario, detect s, survivor stall s, rejoin s, steps trained twice / missing,
bytes moved, rate) with medians over ``--repeat`` runs, and one JSON line.
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

from cluster_scenarios import Outcome, etcd_cut, etcd_leader_loss, quorum_loss, shaped_join, silent_cut
from netlab import unavailable


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _detail(outcomes: list[Outcome]) -> str:
    """What a fencing scenario showed beyond the common columns (every run's)."""
    parts = []
    for o in outcomes:
        extra = o.extra
        if "refused" in extra:
            parts.append(f"refused {len(extra['refused'])}, after heal {extra['refused_after_heal']}")
        elif "commits_during_outage" in extra:
            parts.append(
                f"{extra['steps_during_outage']} steps, {len(extra['commits_during_outage'])} commits in outage, "
                f"shared {extra['shared']}, restarts {extra['restarts']}"
            )
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cut-s", type=float, default=20.0, help="How long a cut lasts.")
    ap.add_argument("--etcd-cut-s", type=float, default=10.0, help="How long a cut from etcd alone lasts.")
    ap.add_argument("--rate", default="100mbit", help="The joining host's shaped link (tc units).")
    ap.add_argument("--hidden", type=int, default=96, help="The example's width in the join (96: a 2.6 MB replica).")
    ap.add_argument("--only", default=None, help="Comma-separated substrings of the scenarios to run.")
    ap.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"bench_cluster: {reason}")
    scenarios = {
        "cut non-leader": lambda work: silent_cut(work, "non-leader", args.cut_s),
        "cut leader": lambda work: silent_cut(work, "leader", args.cut_s),
        "cut from etcd": lambda work: etcd_cut(work, args.etcd_cut_s),
        "etcd leader lost": etcd_leader_loss,
        "etcd quorum lost": lambda work: quorum_loss(work, args.cut_s),
        f"join over {args.rate}": lambda work: shaped_join(work, args.rate, model_args=["--hidden", str(args.hidden)]),
    }
    wanted = [w.strip() for w in args.only.split(",")] if args.only else None
    started = time.monotonic()
    results: dict[str, list[Outcome]] = {}
    for name, run in scenarios.items():
        if wanted and not any(w in name for w in wanted):
            continue
        for rep in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
                outcome = run(Path(tmp))
            results.setdefault(name, []).append(outcome)
            print(
                f"{name:<22} rep {rep + 1}: stall {outcome.stall_s} s, detect {outcome.detect_s} s, "
                f"rejoin {outcome.rejoin_s} s, exit codes {outcome.codes}, state bitwise {outcome.state_matches}",
                flush=True,
            )
    rows = []
    for name, outcomes in results.items():
        rows.append(
            {
                "scenario": name,
                "runs": len(outcomes),
                "detect_s": _median([o.detect_s for o in outcomes]),
                "stall_s": _median([o.stall_s for o in outcomes]),
                "stall_samples_s": [o.stall_s for o in outcomes],
                "rejoin_s": _median([o.rejoin_s for o in outcomes]),
                "steps_trained_twice": max(o.steps_trained_twice for o in outcomes),
                "steps_missing": max(o.steps_missing for o in outcomes),
                "steps_at_old_size_while_cut": max(o.steps_during_cut_at_old_size for o in outcomes),
                "bytes_moved": max(o.bytes_moved for o in outcomes),
                "rate_mbit": _median([o.rate_mbit for o in outcomes]),
                "all_exit_0": all(o.codes and all(c == 0 for c in o.codes) for o in outcomes),
                "state_bitwise": all(o.state_matches for o in outcomes),
                "detail": _detail(outcomes),
            }
        )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cluster scenarios (medians of {args.repeat})")
    columns = ["scenario", "detect_s", "stall_s", "rejoin_s", "steps_trained_twice", "steps_missing"]
    columns += ["bytes_moved", "rate_mbit", "all_exit_0", "state_bitwise", "detail"]
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    Console(width=160).print(table)
    summary = {"bench": "cluster", "repeat": args.repeat, "cut_s": args.cut_s, "rows": rows}
    summary["wall_s"] = round(time.monotonic() - started, 1)
    line = json.dumps(summary)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
