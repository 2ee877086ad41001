"""Flood an agent's metrics port and measure what it costs the training.

Starts ``etcrun --standalone --metrics-port 0`` (one agent, 2 workers training the example GPT),
reads the metrics URL from its ``metrics_serving`` event, then:

1. checks the endpoint: ``GET /metrics`` answers; other methods and paths are refused;
2. measures the step time (median gap between consecutive steps of the loss log) for
   ``--quiet-s`` seconds, then during ``--flood-s`` seconds of the control-plane probe's flood on
   the metrics port (idle connections, connect/close churn, 20 MB lines without a request:
   :func:`probe_control_plane.flood`) plus a client that scrapes once a second;
3. checks that the endpoint answers again and the job trains to its last step and exits 0.

Prints a table and one JSON line: step time quiet and flooded (and their ratio), the scrapes
answered during the flood, the agent's RSS and threads before, at peak and after.

    python scripts/probe_metrics_port.py [--flood-s 15] [--quiet-s 10] [--idle 500] [--churn-threads 8]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from probe_control_plane import _proc_status, flood, print_report  # noqa: E402


def _status(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def _step_gaps(losses: Path, since: float, until: float) -> list[float]:
    walls = sorted(
        json.loads(line)["wall"] for line in losses.read_text().splitlines() if line.strip() and '"wall"' in line
    )
    walls = [w for w in walls if since <= w <= until]
    return [b - a for a, b in zip(walls, walls[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood-s", type=float, default=15.0)
    ap.add_argument("--quiet-s", type=float, default=10.0)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--churn-threads", type=int, default=8)
    ap.add_argument("--long-lines", type=int, default=8)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="probe-metrics-"))
    losses, log = work / "losses.jsonl", work / "etcrun.log"
    steps = 1_000_000  # more than the probe lasts: it ends the job with SIGTERM
    cmd = [sys.executable, "-m", "etc_agent.cli.etcrun", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--metrics-port", "0", "-m", "etc_agent.examples.gpt", "--steps", str(steps), "--loss-log", str(losses)]
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None or not (losses.exists() and losses.read_text().count("\n") >= 20):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job did not start training:\n{log.read_text()[-3000:]}")
            match = re.search(r"(http://[0-9.]+:\d+/metrics)", log.read_text())
            url = match.group(1) if match else None
            time.sleep(0.2)
        assert url is not None
        refused = {m: _status(url, m) for m in ("POST", "PUT", "DELETE")} | {
            "GET /": _status(url.rsplit("/", 1)[0] + "/")
        }
        before = _proc_status(agent.pid)
        quiet_from = time.time()
        time.sleep(args.quiet_s)
        flood_from = time.time()
        peak = list(before)
        scrapes = {"answered": 0, "refused": 0}
        stop = threading.Event()

        def scrape() -> None:
            while not stop.is_set():
                scrapes["answered" if _status(url) == 200 else "refused"] += 1
                rss, threads = _proc_status(agent.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], threads)
                stop.wait(1.0)

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        counts = flood((host, int(port)), args.flood_s, args.idle, args.churn_threads, args.long_lines)
        flood_until = time.time()
        stop.set()
        scraper.join()
        time.sleep(6)  # idle connections time out
        after = _proc_status(agent.pid)
        answers_after = _status(url)
        alive = agent.poll() is None
        agent.terminate()  # the job is not meant to run its steps out: its one node leaves
        code = agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    quiet = _step_gaps(losses, quiet_from, flood_from)
    flooded = _step_gaps(losses, flood_from, flood_until)
    quiet_ms, flood_ms = 1000 * statistics.median(quiet), 1000 * statistics.median(flooded)
    result = {
        "step_ms_quiet": round(quiet_ms, 2),
        "step_ms_flooded": round(flood_ms, 2),
        "ratio": round(flood_ms / quiet_ms, 3),
        "steps_quiet": len(quiet),
        "steps_flooded": len(flooded),
        "scrapes_answered_in_flood": scrapes["answered"],
        "scrapes_refused_in_flood": scrapes["refused"],
        "answers_after": answers_after,
        "refused": refused,
        "rss_mb": [round(before[0], 1), round(peak[0], 1), round(after[0], 1)],
        "threads": [before[1], peak[1], after[1]],
        "flood": counts,
        "alive_after": alive,
        "exit_code_on_sigterm": code,
    }
    rows = [
        ("step time quiet / flooded", f"{quiet_ms:.1f} / {flood_ms:.1f} ms ({result['ratio']:.3f})"),
        ("scrapes in the flood", f"{scrapes['answered']} answered, {scrapes['refused']} refused"),
        ("after the flood", f"GET /metrics -> {answers_after}, job {'training' if alive else 'gone'}"),
        ("other methods and paths", ", ".join(f"{k} -> {v}" for k, v in refused.items())),
        ("agent RSS before / peak / after", " / ".join(f"{v:.0f}" for v in (before[0], peak[0], after[0])) + " MB"),
        ("agent threads before / peak / after", f"{before[1]} / {peak[1]} / {after[1]}"),
        ("flood", f"{counts['idle_opened']} idle, {counts['churn']} churned, {counts['long']} 20 MB lines"),
    ]
    print_report(rows, result)


if __name__ == "__main__":
    main()
