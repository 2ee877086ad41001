#!/usr/bin/env python
"""Churn soak: random joins, SIGTERM leaves, worker SIGKILLs and whole-agent SIGKILLs in a row on the CPU example.

Agents are ``etcrun`` processes on this machine (every agent a "node", over the embedded store or a
given etcd). After each event the soak waits for its migration record and for training to go on a
few steps (after a worker kill, also for its node's rejoin: both stalls are reported), and checks
that no step was skipped. A whole agent is killed only while more than ``--min-agents`` run; over
the embedded store never agent 0, which hosts it (with ``--etcd`` any, the leader included). The state check of each event is the loss of every
step from the one it resumed at to the next event, against one uninterrupted single-process run of
the same schedule (the loss of a step depends on every element of the state). At the end every agent gets
SIGTERM and the soak checks that nothing is left: no process of the job, no listening socket more
than before, and that agents and long-lived workers did not grow in memory. Prints a table per
event type and one JSON line; exits 1 on any failed check.

    python scripts/soak.py --events 30                 # ~10 minutes here
    python scripts/soak.py --events 30 --etcd 127.0.0.1:2379
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_demo import Cluster, free_port, leader_of, migrations, read_losses, reference_losses


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def listening_sockets() -> int:
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        count += sum(1 for line in lines if line.split()[3] == "0A")  # TCP_LISTEN
    return count


def processes_with(marker: str) -> list[int]:
    """Processes whose command line or start-up environment holds ``marker`` (a forked worker shows
    its fork server's command line, but the run's environment)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                text = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
                if marker in text.decode(errors="replace") and "Z" not in (entry / "stat").read_text().split()[2]:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", default="tp=2,pp=1,dp=auto")
    ap.add_argument("--nproc", type=int, default=2, help="Workers per agent.")
    ap.add_argument(
        "--min-agents", type=int, default=2, help="Never leave below this many agents (each holds one replica)."
    )
    ap.add_argument("--max-agents", type=int, default=4)
    ap.add_argument("--steps-after", type=int, default=3, help="Steps trained after each migration before its check.")
    ap.add_argument("--step-delay", type=float, default=0.05)
    ap.add_argument("--etcd", default=None, help="host:port of an etcd server (default: the embedded store).")
    ap.add_argument("--max-agent-growth-mb", type=float, default=40.0)
    ap.add_argument("--max-worker-growth-mb", type=float, default=150.0)
    ap.add_argument("--keep", type=Path, default=None, help="Copy the agents' logs here at the end.")
    args = ap.parse_args()
    if args.min_agents < 2 or args.max_agents <= args.min_agents:
        ap.error("need 2 <= --min-agents < --max-agents (a kill needs a second replica)")
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    rng = random.Random(args.seed)
    steps = 100_000  # never reached: the soak ends the job with SIGTERM after the last check
    started = time.monotonic()
    listening_before = listening_sockets()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="etc-soak-") as tmp:
        work = Path(tmp)
        loss_log = work / "loss.jsonl"
        # 12 micro-batches of 1: every dp from 2 to 4 agents' replicas divides the global batch.
        model_args = ["--global-batch", "12", "--micro-batch", "1"]
        script_args = [
            "--steps",
            str(steps),
            "--parallel",
            args.parallel,
            "--step-delay",
            str(args.step_delay),
            "--loss-log",
            str(loss_log),
            *model_args,
        ]
        run_id = f"soak-{uuid.uuid4().hex[:6]}"
        if args.etcd:
            rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", args.etcd, "--rdzv-id", run_id]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id]
        # Every kill counts as a restart (torchrun's --max-restarts): allow one per event.
        cluster = Cluster(
            rdzv,
            args.nproc,
            args.parallel,
            script_args,
            work,
            echo=False,
            max_nodes=args.max_agents,
            min_nodes=1,
            extra=["--max-restarts", str(args.events + 10)],
        )
        events: list[dict] = []
        samples: dict[int, list[float]] = {}
        agent_pid = None
        leaked: list[int] = []
        departed: set[int] = set()
        """Agents told to leave or killed: out of the job although a leaving one may not have exited yet."""
        try:
            agent_pid = cluster.add_agent(host_store=True).pid
            for _ in range(args.min_agents - 1):
                cluster.add_agent()
            cluster.wait_for(lambda: max(read_losses(loss_log), default=-1) >= 3, 300, "training to start")
            for i in range(args.events):
                alive = [k for k, a in enumerate(cluster.agents) if a.poll() is None and k not in departed]
                choices = ["kill"]
                if len(alive) < args.max_agents:
                    choices.append("join")
                if len(alive) > args.min_agents:
                    choices += ["leave", "kill-agent"]
                event = rng.choice(choices)
                before = len(migrations(cluster))
                world_before = migrations(cluster)[-1]["new_world_size"] if before else args.min_agents * args.nproc
                at = time.monotonic()
                if event == "join":
                    cluster.add_agent()
                    target = len(cluster.agents) - 1
                elif event == "leave":
                    target = rng.choice([k for k in alive if k != 0])  # agent 0 hosts the embedded store
                    cluster.agents[target].send_signal(signal.SIGTERM)
                    departed.add(target)
                elif event == "kill-agent":
                    # A whole node dies (its workers die with it); over etcd it may be the leader.
                    target = rng.choice([k for k in alive if k != 0 or args.etcd])
                    if target == leader_of(cluster):
                        event = "kill-leader"
                    cluster.agents[target].kill()
                    departed.add(target)
                else:
                    target = rng.choice(alive)
                    pids = cluster.worker_pids(target)
                    if not pids:
                        failures.append(f"event {i}: agent {target} has no worker to kill")
                        break
                    os.kill(rng.choice(pids), signal.SIGKILL)
                cluster.wait_for(lambda: len(migrations(cluster)) > before, 300, f"event {i} ({event}) to migrate")  # noqa: B023
                record = migrations(cluster)[before]
                rejoin = None
                if event == "kill" and record["new_world_size"] != world_before:
                    # The others went on without the node; it rejoins once its restarted worker runs.
                    cluster.wait_for(
                        lambda: any(m["new_world_size"] == world_before for m in migrations(cluster)[before + 1 :]),  # noqa: B023
                        300,
                        f"event {i}: the node of the killed worker back",
                    )
                    rejoin = next(m for m in migrations(cluster)[before + 1 :] if m["new_world_size"] == world_before)
                cluster.wait_for(
                    lambda: max(read_losses(loss_log), default=-1) >= record["step"] + args.steps_after,  # noqa: B023
                    300,
                    f"training after event {i}",
                )
                losses = read_losses(loss_log)
                missing = sorted(set(range(max(losses) + 1)) - set(losses))
                for k, a in enumerate(cluster.agents):
                    if a.poll() is None:
                        for pid in [a.pid, *cluster.worker_pids(k)]:
                            value = rss_mb(pid)
                            if value is not None:
                                samples.setdefault(pid, []).append(value)
                events.append(
                    {
                        "i": i,
                        "event": event,
                        "agent": target,
                        "generation": record.get("generation"),
                        "stall_s": record.get("total_stall_s"),
                        "rejoin_stall_s": rejoin.get("total_stall_s") if rejoin else None,
                        "bytes_moved": record.get("bytes_moved"),
                        "world": record.get("new_world_size"),
                        "step": record["step"],
                        "missing_steps": len(missing),
                        "wall_s": round(time.monotonic() - at, 2),
                    }
                )
                console.print(
                    f"{i + 1:3d}/{args.events} {event:5s} agent {target}: generation {record.get('generation')}, "
                    f"world {record.get('new_world_size')}, resumed at step {record['step']}, stall {record.get('total_stall_s', 0):.2f} s, "
                    f"moved {record.get('bytes_moved', 0) / 1e6:.2f} MB"
                    + (f", rejoined with a stall of {rejoin['total_stall_s']:.2f} s" if rejoin else "")
                )
                if missing:
                    failures.append(f"event {i} ({event}): steps never trained: {missing[:5]}")
                    break
        finally:
            for a in cluster.agents:
                if a.poll() is None:
                    a.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 90
            for a in cluster.agents:
                try:
                    a.wait(timeout=max(1.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - any failure to exit is reported
                    failures.append(f"agent pid {a.pid} did not exit within 90 s of SIGTERM")
                    a.kill()
            for i, lines in enumerate(cluster.outputs):
                (work / f"agent-{i}.log").write_text("".join(lines))
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"agent-{i}.log").write_text("".join(lines))
        # The state check of every event: the loss of each step it resumed into (and up to the next
        # event) against one uninterrupted run of the same schedule.
        losses = read_losses(loss_log)
        if events:
            reference, _ = reference_losses(steps, work, [*model_args, "--stop-at", str(max(losses) + 1)])
            bounds = [e["step"] for e in events] + [max(losses) + 1]
            for e, start, stop in zip(events, bounds, bounds[1:]):
                window = [s for s in losses if max(start, 0) <= s < max(stop, start + 1)]
                e["worst_rel_loss_diff"] = max(
                    (abs(losses[s] - reference[s]) / (abs(reference[s]) or 1.0) for s in window), default=None
                )
                if e["worst_rel_loss_diff"] is None or not e["worst_rel_loss_diff"] <= 1e-4:
                    failures.append(
                        f"event {e['i']} ({e['event']}): worst relative loss difference {e['worst_rel_loss_diff']}"
                    )
        time.sleep(1.0)
        leaked = processes_with(str(work))
        if leaked:
            failures.append(f"processes left after the job: {leaked}")
            for pid in leaked:
                os.kill(pid, signal.SIGKILL)
    listening_after = listening_sockets()
    if listening_after > listening_before:
        failures.append(f"listening sockets {listening_before} before, {listening_after} after")
    # Growth after the first quarter of the events (start-up allocations and first DTensor use excluded).
    warm = max(1, len(events) // 4)
    agent_series = samples.get(agent_pid, [])
    agent_growth = agent_series[-1] - agent_series[min(warm, len(agent_series) - 1)] if agent_series else 0.0
    long_lived = {pid: s for pid, s in samples.items() if pid != agent_pid and len(s) > warm + 5}
    worker_growth = max((s[-1] - s[warm] for s in long_lived.values()), default=0.0)
    if agent_growth > args.max_agent_growth_mb:
        failures.append(f"agent 0 grew {agent_growth:.0f} MB")
    if worker_growth > args.max_worker_growth_mb:
        failures.append(f"a long-lived worker grew {worker_growth:.0f} MB")
    if len(events) < args.events and not failures:
        failures.append(f"only {len(events)} of {args.events} events ran")

    table = Table(
        title=f"soak: {len(events)} events, seed {args.seed}, {args.parallel}, {args.nproc} workers per agent"
    )
    for col in (
        "event",
        "count",
        "stall median s",
        "stall max s",
        "rejoin stall median s",
        "rejoin stall max s",
        "moved median MB",
        "event wall median s",
    ):
        table.add_column(col)
    by_kind: dict[str, list[dict]] = {}
    for e in events:
        by_kind.setdefault(e["event"], []).append(e)
    summary = {}
    for kind, rows in sorted(by_kind.items()):
        stalls = [r["stall_s"] for r in rows if r["stall_s"] is not None]
        rejoins = [r["rejoin_stall_s"] for r in rows if r.get("rejoin_stall_s") is not None]
        summary[kind] = {
            "count": len(rows),
            "stall_median_s": round(statistics.median(stalls), 3),
            "stall_max_s": round(max(stalls), 3),
            "rejoin_stall_median_s": round(statistics.median(rejoins), 3) if rejoins else None,
            "rejoin_stall_max_s": round(max(rejoins), 3) if rejoins else None,
        }
        table.add_row(
            kind,
            str(len(rows)),
            f"{statistics.median(stalls):.2f}",
            f"{max(stalls):.2f}",
            f"{statistics.median(rejoins):.2f}" if rejoins else "-",
            f"{max(rejoins):.2f}" if rejoins else "-",
            f"{statistics.median(r['bytes_moved'] or 0 for r in rows) / 1e6:.2f}",
            f"{statistics.median(r['wall_s'] for r in rows):.1f}",
        )
    Console().print(table)
    result = {
        "soak": args.parallel,
        "events": len(events),
        "by_event": summary,
        "worst_rel_loss_diff": max((e.get("worst_rel_loss_diff") or 0.0 for e in events), default=None),
        "leaked_processes": len(leaked),
        "listening_sockets_before": listening_before,
        "listening_sockets_after": listening_after,
        "agent0_rss_mb": [round(agent_series[0], 1), round(agent_series[-1], 1)] if agent_series else None,
        "agent0_growth_mb": round(agent_growth, 1),
        "max_worker_growth_mb": round(worker_growth, 1),
        "num_long_lived_workers": len(long_lived),
        "wall_s": round(time.monotonic() - started, 1),
        "failures": failures,
    }
    print(json.dumps(result))
    if failures:
        console.print("[red]soak failed[/]: " + "; ".join(failures))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
