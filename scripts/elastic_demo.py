"""The demo: the example GPT trained by ``etcrun`` through a join, a planned leave and a crash.

Runs on one machine with every agent a "node" over the embedded store (or a given etcd):

1. two agents x ``--nproc`` workers start training ``etc_agent.examples.gpt`` with ``--parallel``;
2. a third agent joins (scale-out);
3. one agent gets SIGTERM (planned scale-in: its workers send their shards, then exit);
4. one worker is killed with SIGKILL (its shards come from a surviving data-parallel replica);
5. training reaches the last step. Prints each migration's report and the loss curve, and checks the
   loss of every step against an uninterrupted single-process run of the same global batch.

    python scripts/elastic_demo.py                     # tp=2,dp=auto, embedded store
    python scripts/elastic_demo.py --parallel tp=2,pp=2,dp=auto --nproc 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without an install
from etc_agent.agent.workers import SPARE_PROCESS_NAME  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Agents started as separate ``etcrun`` processes of one job; with ``sidecar``, each node is an
    ``etc-agent sidecar`` plus an ``etc-agent workers`` process that starts (and restarts) the workers."""

    def __init__(
        self,
        rdzv: list[str],
        nproc: int,
        parallel: str,
        script_args: list[str],
        log_dir: Path,
        echo: bool,
        max_nodes: int = 4,
        extra: list[str] | None = None,
        min_nodes: int = 1,
        sidecar: bool = False,
        module: str = "etc_agent.examples.gpt",
        hosts: list[tuple[list[str], str | None]] | None = None,
    ):
        self.hosts = hosts
        """Where agent ``i`` runs: a command prefix (``ip netns exec NS``) and its ``--local-addr``
        (``None``: the flag is left out). Without it every agent runs here on 127.0.0.1."""
        self.module = module
        """The training script every worker runs (``python -m``)."""
        self.rdzv, self.nproc, self.parallel = rdzv, nproc, parallel
        self.script_args, self.log_dir, self.echo = with_data(script_args), log_dir, echo
        self.max_nodes, self.min_nodes = max_nodes, min_nodes
        self.extra = extra or []
        self.agents: list[subprocess.Popen] = []
        self.launchers: list[subprocess.Popen | None] = []
        """Sidecar mode: each node's ``etc-agent workers`` process (the workers' parent)."""
        self.sidecar = sidecar
        self.outputs: list[list[str]] = []
        # On hosts of their own the agents choose the workers' interface from their address.
        loopback = {} if hosts else {"GLOO_SOCKET_IFNAME": "lo"}
        self.env = {
            **os.environ,
            **loopback,
            "ETC_AGENT_TIMEOUT": os.environ.get("ETC_AGENT_TIMEOUT", "60"),
            # The fork server imports the example's modules (Megatron-core: seconds) once per node.
            "ETC_AGENT_PRELOAD": os.environ.get("ETC_AGENT_PRELOAD", module),
            # Every process of the run carries it in /proc/PID/environ, forked workers too (a leak check).
            "ETC_AGENT_DEMO_DIR": str(log_dir),
        }

    def add_agent(self, host_store: bool = False) -> subprocess.Popen:
        index = len(self.agents)
        command = ["etc_agent.cli.main", "sidecar"] if self.sidecar else ["etc_agent.cli.etcrun"]
        args = [
            sys.executable,
            "-m",
            *command,
            "--nnodes",
            f"{self.min_nodes}:{self.max_nodes}",
            "--nproc-per-node",
            str(self.nproc),
            *self.rdzv,
            "--reconfig-delay",
            "0.5",
            "--lease-ttl",
            "3",
            "--parallel",
            self.parallel,
            "--log-format",
            "json",
            *self.extra,
        ]
        prefix, local_addr = self.hosts[index] if self.hosts else ([], "127.0.0.1")
        args = [*prefix, *args] + (["--local-addr", local_addr] if local_addr else [])
        if "--rdzv-backend" in self.rdzv and self.rdzv[self.rdzv.index("--rdzv-backend") + 1] == "c10d":
            args += ["--rdzv-conf", f"is_host={'1' if host_store else '0'}"]
        lines: list[str] = []
        if self.sidecar:
            control = f"127.0.0.1:{free_port()}"
            args += ["--control-addr", control]
            launcher_args = [
                sys.executable,
                "-m",
                "etc_agent.cli.main",
                "workers",
                "--nproc-per-node",
                str(self.nproc),
                "--agent",
                control,
                "-m",
                self.module,
                *self.script_args,
            ]
        else:
            args += ["-m", self.module, *self.script_args]
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        self.agents.append(proc)
        self.outputs.append(lines)
        self._pump(proc, lines, f"agent {index}")
        launcher = None
        if self.sidecar:
            launcher = subprocess.Popen(
                launcher_args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
            )
            self._pump(launcher, lines, f"workers {index}")
        self.launchers.append(launcher)
        return proc

    def _pump(self, proc: subprocess.Popen, lines: list[str], label: str) -> None:
        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                if self.echo:
                    sys.stdout.write(f"[{label}] {line}")

        threading.Thread(target=pump, daemon=True).start()

    def worker_pids(self, agent: int) -> list[int]:
        """Live worker pids of one agent, from /proc: its children running the example, or the
        children of its fork server (``--start-method forkserver``, the default) but the workers'
        stores it hosts (``etc-store``) and a child forked a moment ago that has not taken its name
        yet (it could be a store host: a spare one is forked at every switch), and its warm spare worker."""
        table: dict[int, tuple[int, str]] = {}
        comms: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] == "Z" or stat.split("(", 1)[1].startswith("etc-store)"):
                continue  # exited, not yet reaped; or a store host
            table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
            comms[int(entry.name)] = stat.split("(", 1)[1].rsplit(")", 1)[0]
        parent = (self.launchers[agent] if self.sidecar else self.agents[agent]).pid
        servers = {pid for pid, (ppid, cmd) in table.items() if ppid == parent and "etc_agent.worker.forkserver" in cmd}
        return sorted(
            pid
            for pid, (ppid, cmd) in table.items()
            if ((ppid == parent and self.module in cmd) or (ppid in servers and comms[pid] != comms[ppid]))
            and comms[pid] != SPARE_PROCESS_NAME
        )

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if all(a.poll() is not None for a in self.agents):
                break
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n" + self.tail())

    def tail(self, lines: int = 30) -> str:
        return "\n".join(f"--- agent {i} ---\n" + "".join(o[-lines:]) for i, o in enumerate(self.outputs))

    def finish(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes = []
        for a in self.agents:
            try:
                codes.append(a.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for launcher in self.launchers:
            if launcher is not None:
                try:
                    launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for a in [*self.agents, *(p for p in self.launchers if p is not None)]:
            if a.poll() is None:
                a.kill()
        return codes

    def launcher_codes(self) -> list[int | None]:
        return [p.poll() for p in self.launchers if p is not None]


def json_line_event(line: str) -> dict | None:
    """The agent's JSON event on this output line, also where a worker's output (workers print to
    the same console, a print's text and its newline in two writes) shares the line; else None."""
    start = line.find('{"ts": ')
    if start < 0:
        return None
    try:
        event, _ = json.JSONDecoder().raw_decode(line, start)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def loss_records(path: Path) -> list[dict]:
    """Every line of the loss log (rank 0's ``{step, loss, generation, ...}`` per step)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # the line rank 0 is appending right now
            continue
    return records


def read_losses(path: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for record in loss_records(path):
        losses[record["step"]] = record["loss"]  # a step redone after a crash: the completed one wins
    return losses


def leader_of(cluster: Cluster) -> int | None:
    """The agent that logged the latest ``leader_elected``."""
    latest = None
    for k, lines in enumerate(cluster.outputs):
        for line in list(lines):
            if '"leader_elected"' in line:
                try:
                    ts = json.loads(line[line.index('{"ts"') :])["ts"]
                except (ValueError, KeyError):
                    continue
                if latest is None or ts > latest[0]:
                    latest = (ts, k)
    return latest[1] if latest else None


def migrations(cluster: Cluster) -> list[dict]:
    out = []
    for lines in cluster.outputs:
        for line in list(lines):
            if '"event": "migration"' in line and (record := json_line_event(line)) is not None:
                if record.get("event") == "migration" and "node" in record:
                    out.append(record)
    return sorted(out, key=lambda m: m["generation"])  # each agent's log holds the ones its rank 0 reported


CRASHES = ("kill", "hang", "kill-twice", "kill-in-recovery")
"""Events that take down a worker of agent 1 (its agent restarts it): ``kill`` (SIGKILL), ``hang``
(SIGSTOP: its agent must notice the silence), ``kill-twice`` (its replacement too, as soon as it
exists), ``kill-in-recovery`` (a worker of agent 2 too, once agent 2 reports the first failure)."""


def run_scenario(
    parallel: str,
    nproc: int,
    steps: int,
    step_delay: float,
    work: Path,
    echo: bool,
    rdzv: list[str] | None = None,
    events: tuple[str, ...] = ("join", "leave", "kill"),
    extra_script_args: list[str] | None = None,
    wait_migrations: bool = True,
    agent_args: list[str] | None = None,
    initial_agents: int = 2,
    event_steps: list[int] | None = None,
    stop_after: int | None = None,
    min_nodes: int | None = None,
    event_after_text: str | tuple[str, ...] | None = None,
    event_after_every_agent: str | None = None,
    sidecar: bool = False,
    module: str = "etc_agent.examples.gpt",
    gap_before: dict[str, int] | None = None,
    slow_during_events: float | None = 4.0,
    hosts: list[tuple[list[str], str | None]] | None = None,
    watch: Callable[[Cluster, threading.Event], None] | None = None,
) -> dict:
    """Run the elastic scenario; return losses, migration records and exit codes.

        ``wait_migrations=False``: do not wait for a migration after each event (a run expected to fail).
        ``stop_after``: once the last event's migration is done and this many more steps trained, kill the
        job instead of training to the end (benchmarks; exit codes are then None).
        ``min_nodes`` (default ``initial_agents``): ``--nnodes`` MIN; below ``initial_agents`` (so that a
        leave does not drop the job below it), the events wait until a generation runs with all the
        initial agents, and only the migrations after that are returned. ``event_after_text``: before each
        event, also wait until an agent's output has a line containing it, or each of several (e.g. a
        checkpoint written); ``event_after_every_agent``: ... until every running agent's output has
        such a line (its warm spare worker ready, say).
        ``gap_before``: event -> steps that must be trained after the previous event's migration resumed
        before it comes (a join takes effect seconds after its agent starts, which on a busy machine can
        be most of ``event_steps``' spacing; a kill right after a layout change would find no periodic
        checkpoint of the new layout yet). ``slow_during_events``: seconds per step, from each event until
        its migration is seen, for the last steps of the run (3 per event still to come; the example's
        ``--slow-while``), so that however long a busy machine takes to start a joining agent or notice a
        crash, the run does not reach its end first, and a quick one costs nothing; ``None`` keeps the
        ``step_delay`` pace throughout (benchmarks, whose runs are long and whose records time the switch,
        not the steps). ``hosts``: where each agent runs (:class:`Cluster`). ``watch(cluster, stop)`` runs in a
    thread from the first agent's start until the agents are done (``stop`` is set then): an observer
    of the running job (tests scrape the agents' metrics with it)."""
    loss_log = work / "loss.jsonl"
    state_file = work / "state.pt"
    slow_file = work / "slow-steps"
    script_args = [
        "--steps",
        str(steps),
        "--parallel",
        parallel,
        "--step-delay",
        str(step_delay),
        "--loss-log",
        str(loss_log),
        "--dump-state",
        str(state_file),
        *(extra_script_args or []),
    ]
    if slow_during_events is not None:
        script_args += ["--slow-while", str(slow_file), "--slow-step-delay", str(slow_during_events)]
    rdzv = rdzv or [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        f"demo-{uuid.uuid4().hex[:6]}",
    ]
    # The job starts once the initial agents are all in, so no extra generation precedes the events.
    cluster = Cluster(
        rdzv,
        nproc,
        parallel,
        script_args,
        work,
        echo,
        extra=agent_args,
        min_nodes=min_nodes or initial_agents,
        sidecar=sidecar,
        module=module,
        hosts=hosts,
    )
    events_done: list[dict] = []
    skipped = 0
    started = time.monotonic()
    stop_watch = threading.Event()
    watcher = threading.Thread(target=watch, args=(cluster, stop_watch), daemon=True) if watch else None
    try:
        cluster.add_agent(host_store=True)
        if watcher is not None:
            watcher.start()
        for _ in range(initial_agents - 1):
            cluster.add_agent()

        def at_step(n: int) -> None:
            cluster.wait_for(lambda: max(read_losses(loss_log), default=-1) >= n, 300, f"step {n}")

        def migrated(count: int) -> None:
            cluster.wait_for(lambda: len(migrations(cluster)) >= count, 300, f"migration {count}")

        def all_initial_training() -> bool:
            """Every initial agent's workers train: the first running generation had them all, or the
            workers migrated into one that has (a published generation is entered a little later:
            the ranks train on while they prepare it), or rank 0 trained a step in one (workers
            that had built no state yet enter it without a migration)."""
            seen = [
                event
                for line in list(cluster.outputs[0])
                if '"generation_seen"' in line and (event := json_line_event(line)) is not None
            ]
            if not seen or seen[-1]["status"] != "running" or seen[-1]["members"] != initial_agents:
                return False
            running = [e["generation"] for e in seen if e["status"] == "running"]
            full = min(e["generation"] for e in seen if e["status"] == "running" and e["members"] == initial_agents)
            if running[0] == full or any(m["generation"] >= full for m in migrations(cluster)):
                return True
            # Workers that had built no state yet enter the full generation with no migration.
            return any(record.get("generation", -1) >= full for record in loss_records(loss_log))

        expected = 0
        if min_nodes is not None and min_nodes < initial_agents:
            cluster.wait_for(all_initial_training, 300, f"training in a generation with all {initial_agents} agents")
            expected = skipped = len(migrations(cluster))
        step_marks = iter(event_steps or range(steps // 5, steps, max(1, steps // 5)))
        for event in events:
            gap = (gap_before or {}).get(event, 0)
            resumed = max((m["step"] for m in migrations(cluster)), default=-1)
            mark = max(next(step_marks), resumed + gap if gap and expected else 0)
            if mark >= steps:
                raise RuntimeError(
                    f"event {event!r} would come at step {mark}, after the last step ({steps - 1}): "
                    f"the previous migration resumed at step {resumed}\n" + cluster.tail()
                )
            at_step(mark)
            for text in (event_after_text,) if isinstance(event_after_text, str) else event_after_text or ():
                cluster.wait_for(
                    lambda text=text: any(text in line for lines in cluster.outputs for line in list(lines)),
                    300,
                    f"a line with {text!r}",
                )
            if event_after_every_agent is not None:
                cluster.wait_for(
                    lambda: all(
                        any(event_after_every_agent in line for line in list(lines))
                        for agent, lines in zip(cluster.agents, cluster.outputs)
                        if agent.poll() is None
                    ),
                    300,
                    f"a line with {event_after_every_agent!r} from every agent",
                )
            t = time.monotonic() - started
            wall = time.time()
            if slow_during_events is not None:
                slow_file.write_text(str(steps - 3 * (len(events) - len(events_done))))
            if event == "join":
                cluster.add_agent()
            elif event in ("leave", "leave-crash"):
                # SIGTERM the last-started agent still running that does not host the store. With
                # sidecars, as a terminating pod does: its workers' launcher first (which asks the
                # sidecar to leave), then the sidecar itself, neither stopping the workers early.
                target = max(i for i, a in enumerate(cluster.agents) if a.poll() is None and i != 0)
                launcher = cluster.launchers[target] if cluster.sidecar else None
                if launcher is not None:
                    launcher.send_signal(signal.SIGTERM)
                    time.sleep(0.2)
                cluster.agents[target].send_signal(signal.SIGTERM)
                if event == "leave-crash":
                    # A sender dies mid-migration (needs ETC_AGENT_FAULT_SENDER_PAUSE_S in the environment).
                    cluster.wait_for(
                        lambda: any("fault injection: pausing" in line for line in list(cluster.outputs[target])),  # noqa: B023
                        120,
                        "a sender to start its migration",
                    )
                    os.kill(cluster.worker_pids(target)[0], signal.SIGKILL)
            elif event.startswith("reconfigure:"):
                backend = rdzv[rdzv.index("--rdzv-backend") + 1]
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "etc_agent.cli.main",
                        "reconfigure",
                        "--parallel",
                        event.split(":", 1)[1],
                        "--rdzv-backend",
                        "embedded" if backend == "c10d" else backend,
                        "--rdzv-endpoint",
                        rdzv[rdzv.index("--rdzv-endpoint") + 1],
                        "--rdzv-id",
                        rdzv[rdzv.index("--rdzv-id") + 1],
                    ],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
            elif event in ("kill-agent", "kill-leader"):
                # A whole node dies: SIGKILL its agent (its workers die with it) and, for a sidecar, its
                # workers' launcher. kill-leader: the leader's node (over etcd; agent 0 hosts an embedded store).
                target = max(i for i, a in enumerate(cluster.agents) if a.poll() is None and i != 0)
                if event == "kill-leader":
                    target = leader_of(cluster)
                cluster.agents[target].kill()
                if cluster.launchers[target] is not None:
                    cluster.launchers[target].kill()
            elif event in CRASHES:
                pids = cluster.worker_pids(1)
                if not pids:
                    raise RuntimeError(f"no live worker of agent 1 to {event}\n" + cluster.tail())
                # hang: SIGSTOP freezes the worker without killing it; its agent must notice the silence.
                os.kill(pids[-1], signal.SIGSTOP if event == "hang" else signal.SIGKILL)
                if event == "kill-in-recovery":
                    # A second death while the survivors recover from the first: a worker of agent 2
                    # as soon as its agent reports that it left its collective.
                    cluster.wait_for(
                        lambda: any('"peer_failure"' in line for line in list(cluster.outputs[2])),
                        120,
                        "agent 2's worker to report the first failure",
                    )
                    os.kill(cluster.worker_pids(2)[-1], signal.SIGKILL)
                if event == "kill-twice":
                    # A second death during the recovery: the replacement, as soon as it is there.
                    cluster.wait_for(
                        lambda: any(p not in pids for p in cluster.worker_pids(1)),  # noqa: B023
                        120,
                        "the killed worker's replacement",
                    )
                    os.kill(next(p for p in cluster.worker_pids(1) if p not in pids), signal.SIGKILL)
            before = len(migrations(cluster))
            expected += 1
            events_done.append(
                {"event": event, "at_s": round(t, 1), "wall": wall, "step": max(read_losses(loss_log), default=-1)}
            )
            if wait_migrations:
                migrated(expected)
                if event in CRASHES:
                    # The others go on without the crashed worker's node; it rejoins once its restarted
                    # worker runs (a second migration, unless the restart was quicker than the leader).
                    earlier = migrations(cluster)[:before]
                    world = (
                        max(earlier, key=lambda m: m["generation"])["new_world_size"]
                        if earlier
                        else initial_agents * nproc
                    )
                    latest = max((m["generation"] for m in earlier), default=-1)
                    cluster.wait_for(
                        lambda: any(
                            m["new_world_size"] >= world and m["generation"] > latest  # noqa: B023
                            for m in migrations(cluster)
                        ),
                        300,
                        f"the job back at {world} workers after the {event}",
                    )
                    expected = len(migrations(cluster))
                events_done[-1]["migrations"] = list(range(before - skipped, expected - skipped))
            slow_file.unlink(missing_ok=True)
        if stop_after is not None:
            resumed = max(read_losses(loss_log), default=-1)
            at_step(resumed + stop_after)
            for a in [*cluster.agents, *(p for p in cluster.launchers if p is not None)]:
                a.kill()
            codes = [None] * len(cluster.agents)
        else:
            codes = cluster.finish(timeout=600 if wait_migrations else 180)
    finally:
        stop_watch.set()
        if watcher is not None and watcher.is_alive():
            watcher.join(timeout=30)
        slow_file.unlink(missing_ok=True)
        for a in [*cluster.agents, *(p for p in cluster.launchers if p is not None)]:
            if a.poll() is None:
                a.kill()
        for i, lines in enumerate(cluster.outputs):
            (work / f"agent-{i}.log").write_text("".join(lines))
    return {
        "losses": read_losses(loss_log),
        "migrations": migrations(cluster)[skipped:],
        "codes": codes,
        "events": events_done,
        "state_file": state_file,
        "cluster": cluster,
    }


def with_data(script_args: list[str]) -> list[str]:
    """The example's arguments with ``--data synthetic`` unless they name a dataset: the scenarios
    test migrations, and the examples' own default (the pydoc dataset, with loader processes) is for
    users; the data tests pass ``--data``."""
    return list(script_args) if "--data" in script_args else [*script_args, "--data", "synthetic"]


def reference_losses(
    parallel_steps: int, work: Path, extra_script_args: list[str] | None = None, module: str = "etc_agent.examples.gpt"
) -> tuple[dict[int, float], Path]:
    """The same training in one process (world of 1), uninterrupted. The run is deterministic: one
    with the same arguments earlier in this process (its files still there) is reused."""
    extra_script_args = with_data(extra_script_args or [])
    key = (parallel_steps, tuple(extra_script_args), module)
    if key in _REFERENCES and all(p.exists() for p in _REFERENCES[key]):
        loss_log, state_file = _REFERENCES[key]
        return read_losses(loss_log), state_file
    loss_log = work / "reference_loss.jsonl"
    state_file = work / "reference_state.pt"
    argv = [
        module,
        "--steps",
        str(parallel_steps),
        "--loss-log",
        str(loss_log),
        "--dump-state",
        str(state_file),
        *(extra_script_args or []),
    ]
    output = work / "reference_output.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETC_AGENT")}
    # Forked from multiprocessing's fork server, which imported torch once for every reference run of
    # this process (a new interpreter spends ~3 s of CPU on it each time); what runs is what
    # `python -m MODULE ARGS` runs, in ROOT, with this environment less its ETC_AGENT_* variables.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    process = ctx.Process(target=_run_module, args=(argv, env, str(ROOT), str(output)), daemon=True)
    process.start()
    process.join(timeout=600)
    if process.exitcode != 0:
        process.kill()
        tail = output.read_text()[-4000:] if output.exists() else ""
        raise RuntimeError(f"reference run {' '.join(argv)} failed (exit code {process.exitcode}):\n{tail}")
    _REFERENCES[key] = (loss_log, state_file)
    return read_losses(loss_log), state_file


def _run_module(argv: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """``python -m ARGV...`` in this (forked) process, its output to ``output``; exits with its code."""
    from etc_agent.utils.forkserver import run_as_main

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # Not the interpreter's exit: torch 2.13's gloo teardown can deadlock there.
    os._exit(run_as_main(["-m", *argv]))


_REFERENCES: dict[tuple, tuple[Path, Path]] = {}


def compare_states(elastic: Path, reference: Path) -> list[str]:
    """Keys whose tensors differ (bitwise) between two full-state dumps; a missing key counts too."""
    import torch

    a, b = torch.load(elastic), torch.load(reference)
    differ = sorted(set(a) ^ set(b))
    differ += [k for k in sorted(set(a) & set(b)) if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", default="tp=2,pp=1,dp=auto")
    ap.add_argument("--nproc", type=int, default=2, help="Workers per agent.")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-delay", type=float, default=0.1)
    ap.add_argument("--quiet", action="store_true", help="Do not echo the agents' output.")
    ap.add_argument(
        "--migration",
        choices=("live", "checkpoint"),
        default="live",
        help="checkpoint: the baseline (DCP save, restart every worker, load with resharding).",
    )
    ap.add_argument(
        "--events",
        default="join;leave;kill",
        help="Semicolon-separated events in order: join, leave, kill, hang (SIGSTOP a worker), reconfigure:<parallel spec>.",
    )
    ap.add_argument(
        "--elementwise", action="store_true", help="Layout-independent update; check the final state bit for bit."
    )
    ap.add_argument(
        "--data",
        default="pydoc",
        help="pydoc: the default token dataset (etc_agent.data.prepare; built once per machine), trained on with "
        "exactly-once sampling; a dataset directory; or synthetic: the example's generated sequences.",
    )
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with tempfile.TemporaryDirectory(prefix="etc-demo-") as tmp:
        work = Path(tmp)
        console.print(
            f"[bold]ETC demo[/]: {args.parallel}, agents of {args.nproc} workers; join, SIGTERM leave, SIGKILL of a worker"
        )
        extra = ["--elementwise"] if args.elementwise else []
        if args.data != "synthetic":
            from etc_agent.data.prepare import default_dataset

            data = default_dataset() if args.data == "pydoc" else Path(args.data)
            extra += ["--data", str(data), "--seq", "64"]
            console.print(f"training on {data} (real tokens, every sample once through every change)")
        events = tuple(e for e in args.events.split(";") if e)
        unknown = {
            e
            for e in events
            if e not in ("join", "leave", "leave-crash", "kill-agent", "kill-leader", *CRASHES)
            and not e.startswith("reconfigure:")
        }
        if unknown:
            raise SystemExit(f"--events: unknown {sorted(unknown)}")
        agent_args = (
            ["--migration", args.migration, "--checkpoint-dir", str(work / "checkpoints")]
            if args.migration == "checkpoint"
            else []
        )
        result = run_scenario(
            args.parallel,
            args.nproc,
            args.steps,
            args.step_delay,
            work,
            echo=not args.quiet,
            events=events,
            extra_script_args=extra,
            agent_args=agent_args,
        )
        reference, reference_state = reference_losses(args.steps, work, extra)
        mismatched = compare_states(result["state_file"], reference_state) if args.elementwise else None
    from etc_agent.cli.main import migration_table
    from etc_agent.rendezvous.records import MigrationRecord

    for m in result["migrations"]:
        record = MigrationRecord.model_validate({k: v for k, v in m.items() if k in MigrationRecord.model_fields})
        console.print(migration_table(record, title="migration"))
    losses = result["losses"]
    worst = max(
        (abs(losses[s] - reference[s]) / (abs(reference[s]) or 1.0) for s in reference if s in losses),
        default=float("nan"),
    )
    curve = Table(title="loss (elastic vs uninterrupted reference)")
    for col in ("step", "elastic", "reference", "rel diff"):
        curve.add_column(col)
    for s in sorted(reference)[:: max(1, len(reference) // 12)]:
        curve.add_row(
            str(s),
            f"{losses.get(s, float('nan')):.5f}",
            f"{reference[s]:.5f}",
            f"{abs(losses.get(s, float('nan')) - reference[s]) / (abs(reference[s]) or 1.0):.1e}",
        )
    console.print(curve)
    missing = sorted(set(reference) - set(losses))
    console.print(
        f"events: {result['events']}; agent exit codes {result['codes']}; steps missing: {missing or 'none'}; "
        f"worst relative loss difference {worst:.2e}"
    )
    if args.elementwise:
        console.print(
            f"final state vs reference, bit for bit: {'equal' if not mismatched else f'{len(mismatched)} tensors differ: {mismatched[:5]}'}"
        )
    print(
        json.dumps(
            {
                "demo": args.parallel,
                "migrations": len(result["migrations"]),
                "worst_rel_loss_diff": worst,
                "missing_steps": missing,
                "exit_codes": result["codes"],
                "state_mismatches": mismatched,
            }
        )
    )
    if (
        missing
        or (not args.elementwise and not worst <= 1e-4)
        or mismatched
        or any(c not in (0,) for c in result["codes"])
    ):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
