"""Attack a running job's control plane from outside and measure what it costs the job.

Starts ``etcrun`` (one agent hosting the embedded store, 2 workers training the example GPT), then,
from this process, which does not hold the job's secret:

1. forged requests: the store's ``generation`` compare-and-set to ``succeeded``, a lease-less
   ``nodes/evil-node``, the ``leader`` key deleted, a ``fatal`` and a ``finished`` on the agent's
   control channel (its port read from the agent's log), and the same signed with a wrong key;
2. a flood: idle connections, connect/close churn, and long unauthenticated lines at once, for
   ``--flood-s`` seconds, while a client that holds the secret (a reader of the store, as the
   agents are) times its requests.

It reports the agent's RSS and thread count before, during and after, the legitimate client's
request latency during the flood, whether every forged request was refused, and whether the job
trained to its last step and exited 0. Prints a table and one JSON line.

    python scripts/probe_control_plane.py [--flood-s 20] [--idle 1000] [--churn-threads 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from etc_agent.rendezvous.embedded import EmbeddedStore  # noqa: E402
from etc_agent.utils.auth import Key  # noqa: E402
from etc_agent.utils.jsonline import JsonLineError, parse_address, request  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> tuple[float, int]:
    """(RSS in MB, threads) of ``pid``."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024
    threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))
    return rss, threads


def _control_port(log: Path, deadline: float) -> int:
    """The agent's control port, from its ``registered`` log line."""
    while time.monotonic() < deadline:
        match = re.search(r"control_addr=127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        time.sleep(0.1)
    raise TimeoutError("the agent's control address never appeared in its log")


def forged_requests(store_address: tuple[str, int], control_address: tuple[str, int], run_id: str) -> dict:
    """Each forged request -> the server's answer (every one must be a refusal)."""
    prefix = f"/etc-agent/{run_id}/"
    wrong = Key("job", b"a guess at the job's secret, 32+")
    cases = {
        "cas generation succeeded": (
            store_address,
            {"op": "cas", "key": prefix + "generation", "value": '{"status": "succeeded"}', "expected": 1},
        ),
        "lease-less node record": (store_address, {"op": "put", "key": prefix + "nodes/evil-node", "value": "{}"}),
        "delete leader": (store_address, {"op": "delete", "key": prefix + "leader"}),
        "read the whole store": (store_address, {"op": "get_prefix", "prefix": ""}),
        "control fatal": (control_address, {"op": "fatal", "reason": "forged"}),
        "control finished": (control_address, {"op": "finished", "step": 0, "generation": 0}),
        "control hello pid 1": (control_address, {"op": "hello", "local_rank": 0, "pid": 1}),
    }
    answers = {}
    for name, (address, req) in cases.items():
        for key in (wrong, Key("w0", wrong.secret)):
            try:
                request(address, req, 5, key)
                answers[f"{name} ({key.id})"] = "ACCEPTED"
            except JsonLineError as err:
                answers[f"{name} ({key.id})"] = str(err)
        with socket.create_connection(address, timeout=5) as sock:  # no signature at all
            sock.recv(4096)
            sock.sendall(json.dumps(req).encode() + b"\n")
            answers[f"{name} (unsigned)"] = sock.recv(4096).decode(errors="replace").strip()
    return answers


def flood(address: tuple[str, int], seconds: float, num_idle: int, churn_threads: int, num_long: int) -> dict:
    """Idle connections, connect/close churn and long lines at once for ``seconds``."""
    stop = threading.Event()
    counts = {"churn": 0, "long": 0, "idle_opened": 0}

    def churn():
        while not stop.is_set():
            try:
                socket.create_connection(address, timeout=2).close()
                counts["churn"] += 1
            except OSError:
                pass

    def long_line():
        while not stop.is_set():
            try:
                with socket.create_connection(address, timeout=5) as sock:
                    sock.recv(4096)
                    chunk = b"x" * (1 << 20)
                    for _ in range(20):  # 20 MB, no newline, no signature
                        sock.sendall(chunk)
                    counts["long"] += 1
            except OSError:
                counts["long"] += 1

    idle = []
    for _ in range(num_idle):
        try:
            idle.append(socket.create_connection(address, timeout=2))
            counts["idle_opened"] += 1
        except OSError:
            break
    threads = [threading.Thread(target=churn, daemon=True) for _ in range(churn_threads)]
    threads += [threading.Thread(target=long_line, daemon=True) for _ in range(num_long)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(10)
    for sock in idle:
        sock.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood-s", type=float, default=20.0)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--churn-threads", type=int, default=30)
    ap.add_argument("--long-lines", type=int, default=40)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-delay", type=float, default=0.1)
    args = ap.parse_args()

    port = _free_port()
    run_id = f"probe-{os.getpid()}"
    endpoint = f"127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="probe-"))
    losses = work / "losses.jsonl"
    log = work / "etcrun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETC_AGENT_SECRET")}
    cmd = [
        sys.executable,
        "-m",
        "etc_agent.cli.etcrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--parallel",
        "tp=2",
        "-m",
        "etc_agent.examples.gpt",
        "--steps",
        str(args.steps),
        "--step-delay",
        str(args.step_delay),
        "--loss-log",
        str(losses),
    ]
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (losses.exists() and losses.read_text().count("\n") >= 3):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job did not start training:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        control_port = _control_port(log, deadline)
        store = EmbeddedStore(endpoint, run_id, connect_timeout_s=10)  # holds the secret (this user's file)
        before = _proc_status(agent.pid)
        answers = forged_requests(parse_address(endpoint), ("127.0.0.1", control_port), run_id)
        latencies: list[float] = []
        failures = [0]
        peak = list(before)
        stop = threading.Event()

        def legit():
            while not stop.is_set():
                started = time.monotonic()
                try:
                    store.get("generation")
                    latencies.append(time.monotonic() - started)
                except Exception:  # noqa: BLE001 - counted
                    failures[0] += 1
                rss, threads = _proc_status(agent.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], threads)
                stop.wait(0.1)

        watcher = threading.Thread(target=legit, daemon=True)
        watcher.start()
        counts = flood(parse_address(endpoint), args.flood_s, args.idle, args.churn_threads, args.long_lines)
        stop.set()
        watcher.join()
        time.sleep(3)  # idle handshakes time out, freed buffers go back
        after = _proc_status(agent.pid)
        code = agent.wait(timeout=args.steps * args.step_delay * 3 + 120)
    finally:
        if agent.poll() is None:
            agent.kill()
    steps = sorted({json.loads(line)["step"] for line in losses.read_text().splitlines() if line.strip()})
    accepted = [name for name, answer in answers.items() if "ACCEPTED" in answer or "unauthenticated" not in answer]
    result = {
        "exit_code": code,
        "steps_trained": len(steps),
        "steps_expected": args.steps,
        "forged_requests": len(answers),
        "forged_accepted": accepted,
        "rss_before_mb": round(before[0], 1),
        "rss_peak_mb": round(peak[0], 1),
        "rss_after_mb": round(after[0], 1),
        "threads_before": before[1],
        "threads_peak": peak[1],
        "threads_after": after[1],
        "legit_requests": len(latencies),
        "legit_failures": failures[0],
        "legit_latency_median_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
        "legit_latency_max_ms": round(1000 * max(latencies), 1) if latencies else None,
        "flood": counts,
        "flood_s": args.flood_s,
    }
    rows = [
        ("exit code / steps", f"{code} / {len(steps)} of {args.steps}"),
        ("forged requests refused", f"{len(answers) - len(accepted)} of {len(answers)}"),
        ("agent RSS before / peak / after", f"{before[0]:.0f} / {peak[0]:.0f} / {after[0]:.0f} MB"),
        ("agent threads before / peak / after", f"{before[1]} / {peak[1]} / {after[1]}"),
        (
            "store request latency in the flood",
            f"median {result['legit_latency_median_ms']} ms, max {result['legit_latency_max_ms']} ms, "
            f"{failures[0]} failed of {len(latencies) + failures[0]}",
        ),
        ("flood", f"{counts['idle_opened']} idle, {counts['churn']} churned, {counts['long']} 20 MB lines"),
    ]
    print_report(rows, result)


def print_report(rows: list[tuple[str, str]], result: dict) -> None:
    """The probe's table (figure, value) and its JSON line."""
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
