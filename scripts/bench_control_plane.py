#!/usr/bin/env python
"""The control plane at 16, 64 and 256 agents: real ``etcrun`` agents against a real etcd here.

Each agent runs one sleeping worker (``--no-python sleep``), so what is measured is the agents and
the store. For each fleet size:

1. start the agents (16 at a time, each wave registered before the next); wait until every one has
   seen a running generation of all of them;
2. idle for ``--idle-s``: each agent's memory (RSS) and CPU (share of one core);
3. SIGKILL one agent (not the leader): time from the kill to the generation without it seen by
   every survivor (each agent's own ``generation_seen`` line, wall clock);
4. start one agent: time from its start to the generation with it seen by all;
5. SIGKILL the leader: time to the next generation seen by all, and the store requests in the
   first second after the kill (a herd would be many per agent);

and for each event the store requests and bytes it cost (etcd's own ``/metrics`` counters: gRPC
calls handled, bytes received and sent), per agent. Prints a table and one JSON line.

    python scripts/bench_control_plane.py [--sizes 16,64,256] [--idle-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench_step_time import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """A single-member etcd on random ports, its data in ``work``."""

    def __init__(self, work: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise SystemExit("etcd is not installed (apt-get install etcd-server)")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = open(work / "etcd.log", "w")
        self.proc = subprocess.Popen(
            [
                binary,
                *("--name", "bench", "--data-dir", str(work / "etcd-data")),
                *(
                    "--listen-client-urls",
                    f"http://{self.endpoint}",
                    "--advertise-client-urls",
                    f"http://{self.endpoint}",
                ),
                *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-cluster", f"bench=http://127.0.0.1:{peer}"),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.counters()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"etcd did not come up on {self.endpoint}")

    def counters(self) -> dict[str, float]:
        """etcd's request and byte counters: gRPC calls handled, bytes received, bytes sent."""
        with urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=5) as response:
            text = response.read().decode()
        out = {"requests": 0.0, "bytes_in": 0.0, "bytes_out": 0.0}
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                out["requests"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_received_bytes_total"):
                out["bytes_in"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
                out["bytes_out"] += float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@dataclass
class Agent:
    proc: subprocess.Popen
    log: Path
    started: float
    offset: int = 0
    seen: list[tuple[float, int, int]] = field(default_factory=list)
    """(wall time, generation, members) of each running generation it saw."""
    leader_since: float | None = None
    registered: bool = False


class Fleet:
    """``etcrun`` agents of one job, each with one sleeping worker, against ``endpoint``.

    The scenario helper of the benchmark and of ``tests/test_control_plane.py``."""

    def __init__(self, endpoint: str, work: Path, max_nodes: int, lease_ttl: float = 2.0) -> None:
        self.endpoint, self.work, self.max_nodes, self.lease_ttl = endpoint, work, max_nodes, lease_ttl
        self.run_id = f"fleet-{uuid.uuid4().hex[:6]}"
        self.agents: list[Agent] = []

    def start(self, count: int) -> list[int]:
        """Start ``count`` agents; their indices."""
        env = {**os.environ, "ETC_AGENT_TIMEOUT": "120", "PYTHONPATH": str(ROOT)}
        started = []
        for _ in range(count):
            index = len(self.agents)
            log = self.work / f"agent-{index}.log"
            command = [
                sys.executable,
                *("-m", "etc_agent.cli.etcrun", "--nnodes", f"1:{self.max_nodes}", "--nproc-per-node", "1"),
                *("--rdzv-backend", "etcd-v3", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id),
                *("--local-addr", "127.0.0.1", "--lease-ttl", str(self.lease_ttl), "--reconfig-delay", "0.5"),
                *("--log-format", "json", "--max-restarts", "3", "--no-python", "sleep", "100000"),
            ]
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.work, start_new_session=True
                )
            self.agents.append(Agent(proc, log, time.time()))
            started.append(index)
        return started

    def read(self) -> None:
        """Take in the agents' new log lines."""
        for agent in self.agents:
            with open(agent.log, "rb") as f:
                f.seek(agent.offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            agent.offset += end
            for line in chunk[:end].decode(errors="replace").splitlines():
                if not line.startswith("{"):
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "generation_seen" and event.get("status") == "running":
                    agent.seen.append((float(event["ts"]), int(event["generation"]), int(event["members"])))
                elif event.get("event") == "registered":
                    agent.registered = True
                elif event.get("event") == "leader_elected":
                    agent.leader_since = float(event["ts"])

    def start_in_waves(self, count: int, wave: int, timeout: float) -> None:
        """Start ``count`` agents ``wave`` at a time, each wave registered before the next starts: on one
        small machine hundreds of Python start-ups at once starve the running agents (their lease
        keepalives and liveness ports), which hosts of their own would not."""
        deadline = time.monotonic() + timeout
        for first in range(0, count, wave):
            started = self.start(min(wave, count - first))
            while True:
                self.read()
                if all(self.agents[i].registered for i in started):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"agents {[i for i in started if not self.agents[i].registered]} did not register"
                    )
                time.sleep(0.2)

    def alive(self) -> list[int]:
        return [i for i, a in enumerate(self.agents) if a.proc.poll() is None]

    def leader(self) -> int | None:
        self.read()
        leaders = [(a.leader_since, i) for i, a in enumerate(self.agents) if a.proc.poll() is None and a.leader_since]
        return max(leaders)[1] if leaders else None

    def wait_all_see(self, members: int, after: float, timeout: float) -> dict[int, float]:
        """When each living agent first saw a running generation of ``members`` members after
        ``after`` (wall clock); raises naming the agents that did not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.read()
            seen: dict[int, float] = {}
            for i in self.alive():
                times = [ts for ts, _, n in self.agents[i].seen if n == members and ts >= after]
                if times:
                    seen[i] = min(times)
            if len(seen) == len(self.alive()):
                return seen
            if time.monotonic() > deadline:
                missing = sorted(set(self.alive()) - set(seen))
                raise TimeoutError(
                    f"agents {missing[:10]} did not see a generation of {members} members in {timeout} s"
                )
            time.sleep(0.2)

    def kill(self, index: int) -> float:
        """SIGKILL the agent and its worker (the node is gone); the wall time of the kill."""
        at = time.time()
        os.killpg(self.agents[index].proc.pid, signal.SIGKILL)
        self.agents[index].proc.wait(timeout=30)
        return at

    def usage(self, seconds: float) -> tuple[list[float], list[float]]:
        """Each living agent's RSS (MiB) and CPU share of one core over ``seconds``."""

        def cpu(pid: int) -> float:
            used = cpu_seconds(pid)
            if used is None:
                raise RuntimeError(f"agent pid {pid}: /proc/{pid}/stat is not readable")
            return used

        pids = [self.agents[i].proc.pid for i in self.alive()]
        before = {p: cpu(p) for p in pids}
        time.sleep(seconds)
        shares = [(cpu(p) - before[p]) / seconds for p in pids]
        rss = [int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text()).group(1)) / 1024 for p in pids]
        return rss, shares

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(agent.proc.pid, signal.SIGKILL)  # its session: the agent and what it left
            except ProcessLookupError:
                pass
            agent.proc.wait(timeout=10)


def _event(etcd: Etcd, fleet: Fleet, members: int, act, timeout: float) -> dict:
    """Run ``act`` (returns its wall time), wait for every agent to see ``members``, report."""
    counters = etcd.counters()
    at = act()
    seen = fleet.wait_all_see(members, at, timeout)
    time.sleep(1.0)  # the requests that follow the new generation (statuses, keepalives settle)
    after = etcd.counters()
    delays = [ts - at for ts in seen.values()]
    num = len(fleet.alive())
    return {
        "seen_median_s": round(statistics.median(delays), 3),
        "seen_max_s": round(max(delays), 3),
        "requests": int(after["requests"] - counters["requests"]),
        "requests_per_agent": round((after["requests"] - counters["requests"]) / num, 2),
        "bytes_per_agent": round(
            (after["bytes_in"] + after["bytes_out"] - counters["bytes_in"] - counters["bytes_out"]) / num
        ),
    }


def measure(size: int, idle_s: float, work: Path, lease_ttl: float) -> dict:
    etcd = Etcd(work)
    fleet = Fleet(etcd.endpoint, work, max_nodes=size + 1, lease_ttl=lease_ttl)
    try:
        started = time.time()
        fleet.start_in_waves(size, wave=16, timeout=60 + 2.0 * size)
        fleet.wait_all_see(size, started, timeout=60 + 2.0 * size)
        up_s = time.time() - started
        rss, cpu = fleet.usage(idle_s)
        idle = etcd.counters()
        time.sleep(idle_s)
        idle_requests = (etcd.counters()["requests"] - idle["requests"]) / idle_s
        leader = fleet.leader()
        victim = next(i for i in fleet.alive() if i != leader)
        kill = _event(etcd, fleet, size - 1, lambda: fleet.kill(victim), timeout=60)
        join = _event(etcd, fleet, size, lambda: (time.time(), fleet.start(1))[0], timeout=120)
        leader = fleet.leader()
        assert leader is not None
        before = etcd.counters()
        at = fleet.kill(leader)
        time.sleep(1.0)
        herd = etcd.counters()["requests"] - before["requests"]
        seen = fleet.wait_all_see(size - 1, at, timeout=120)
        delays = [ts - at for ts in seen.values()]
        leader_loss = {
            "seen_median_s": round(statistics.median(delays), 3),
            "seen_max_s": round(max(delays), 3),
            "requests_first_second": int(herd),
            "requests_first_second_per_agent": round(herd / len(fleet.alive()), 2),
        }
        return {
            "agents": size,
            "start_all_seen_s": round(up_s, 1),
            "idle_rss_mib_median": round(statistics.median(rss), 1),
            "idle_cpu_share_median": round(statistics.median(cpu), 4),
            "idle_store_requests_per_s": round(idle_requests, 1),
            "kill": kill,
            "join": join,
            "leader_kill": leader_loss,
        }
    finally:
        fleet.stop()
        etcd.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--lease-ttl", type=float, default=5.0)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="etc-fleet-") as tmp:
            rows.append(measure(size, args.idle_s, Path(tmp), args.lease_ttl))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = Table(title="control plane: real agents against a real etcd on this machine", header_style="bold")
    columns = (
        "agents",
        "idle RSS MiB",
        "idle CPU",
        "idle req/s",
        "kill: seen med/max s",
        "req/agent",
        "join: seen med/max s",
        "req/agent",
        "leader kill: seen med/max s",
        "req/agent 1st s",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["agents"]),
            f"{r['idle_rss_mib_median']:.0f}",
            f"{100 * r['idle_cpu_share_median']:.1f}%",
            f"{r['idle_store_requests_per_s']:.0f}",
            f"{r['kill']['seen_median_s']:.2f} / {r['kill']['seen_max_s']:.2f}",
            f"{r['kill']['requests_per_agent']:.1f}",
            f"{r['join']['seen_median_s']:.2f} / {r['join']['seen_max_s']:.2f}",
            f"{r['join']['requests_per_agent']:.1f}",
            f"{r['leader_kill']['seen_median_s']:.2f} / {r['leader_kill']['seen_max_s']:.2f}",
            f"{r['leader_kill']['requests_first_second_per_agent']:.1f}",
        )
    Console(width=200).print(table)
    print(json.dumps({"bench": "control_plane", "lease_ttl_s": args.lease_ttl, "results": rows}))


if __name__ == "__main__":
    main()
