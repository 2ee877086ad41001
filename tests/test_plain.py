"""Plain torchrun scripts under ``etcrun`` (no worker API): a planned leave never ends the job, exit
codes tell the truth, the script sees what torchrun gives it, the console is quiet.

One scenario helper (:class:`PlainJob`) runs ``etc_agent.examples.plain_ddp`` (DDP, resuming from
its own checkpoint) on N agents over etcd or the embedded store, with etcrun's default flags.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, _free_port
from test_etcrun import LOOPBACK, finish

from etc_agent.agent.console import NOTICE, console_level, event_level
from etc_agent.agent.departure import DepartureOutcome, after_acknowledgement, departure_verdict
from etc_agent.examples.plain_ddp import train_reference
from etc_agent.rendezvous.records import GenerationRecord, LeaderRecord, NodeRecord
from etc_agent.worker.launch import script_path, user_traceback

STEPS = 80
STEP_DELAY = "0.1"
LR = 0.05


class PlainJob:
    """Agents of one plain-script job on ``backend`` (etcd or embedded), started one at a time."""

    def __init__(self, backend: str, tmp_path: Path, request, nnodes: str, rdzv_conf: str = ""):
        self.backend = backend
        self.run_id = f"plain-{uuid.uuid4().hex[:6]}"
        self.out = tmp_path
        self.progress = tmp_path / "progress.json"
        if backend == "etcd":
            from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore

            endpoint = request.getfixturevalue("etcd_server").endpoint
            self.rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id]
            self._open_store = lambda: EtcdStore(EtcdOptions(endpoint=endpoint), self.run_id)
        else:
            from etc_agent.rendezvous.embedded import EmbeddedStore

            endpoint = f"127.0.0.1:{_free_port()}"
            self.rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id]
            self._open_store = lambda: EmbeddedStore(endpoint, self.run_id, connect_timeout_s=20)
        self.args = ["--nnodes", nnodes, "--nproc-per-node", "1", *self.rdzv]
        self.rdzv_conf = rdzv_conf
        self.agents: list[subprocess.Popen] = []
        self.store = None

    def add_agent(self, steps: int = STEPS, step_delay: str = STEP_DELAY) -> subprocess.Popen:
        conf = [self.rdzv_conf] if self.rdzv_conf else []
        if self.backend == "embedded":
            conf.append(f"is_host={'true' if not self.agents else 'false'}")
        host = ["--rdzv-conf", ",".join(conf)] if conf else []
        script = ["-m", "etc_agent.examples.plain_ddp", "--steps", str(steps), "--step-delay", step_delay]
        script += ["--checkpoint-dir", str(self.out / "ckpt"), "--progress", str(self.progress)]
        p = subprocess.Popen(
            [sys.executable, "-m", "etc_agent.cli.etcrun", *self.args, *host, *script],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **LOOPBACK},
        )
        self.agents.append(p)
        if self.store is None:
            self.store = self._open_store()
        return p

    def generation(self) -> GenerationRecord | None:
        kv = self.store.get("generation")
        return GenerationRecord.loads(kv.value) if kv else None

    def step(self) -> dict:
        try:
            return json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return {"step": 0, "world_size": 0}

    def wait_training(self, world_size: int, past_step: int, timeout: float = 90) -> dict:
        """Until rank 0 reports a step past ``past_step`` at ``world_size``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            progress = self.step()
            if progress["world_size"] == world_size and progress["step"] > past_step:
                return progress
            if any(p.poll() is not None for p in self.agents):
                break
            time.sleep(0.05)
        outputs = "\n".join(f"--- agent {i}: {p.poll()}" for i, p in enumerate(self.agents))
        raise AssertionError(f"no step past {past_step} at world size {world_size}: {self.step()}\n{outputs}")

    def agent_of(self, node_id: str) -> subprocess.Popen:
        record = NodeRecord.loads(self.store.get(f"nodes/{node_id}").value)
        (agent,) = [p for p in self.agents if p.pid == record.pid]
        return agent

    def leader(self) -> subprocess.Popen:
        return self.agent_of(LeaderRecord.loads(self.store.get("leader").value).node_id)

    def non_leader(self) -> subprocess.Popen:
        leader = self.leader()
        return next(p for p in reversed(self.agents) if p is not leader)

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.kill()
        if self.store is not None:
            self.store.close()


@pytest.fixture
def plain_job(tmp_path, request):
    jobs: list[PlainJob] = []

    def make(backend: str, nnodes: str = "1:3", rdzv_conf: str = "") -> PlainJob:
        job = PlainJob(backend, tmp_path, request, nnodes, rdzv_conf)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def _final_weights_match_an_uninterrupted_run(checkpoint: Path) -> None:
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == STEPS
    reference = train_reference(STEPS, LR)
    for name, value in reference.items():
        torch.testing.assert_close(state["model"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("backend", "num_agents", "whom"),
    [
        ("etcd", 2, "non-leader"),
        ("etcd", 3, "leader"),
        ("embedded", 2, "non-leader"),
        ("embedded", 3, "store host"),
    ],
)
def test_a_planned_leave_never_ends_the_job(plain_job, backend, num_agents, whom):
    """SIGTERM to one agent (etcrun's default flags): the others go on and finish, no restart is
    counted, every agent exits 0, and the script's own checkpoint carries the training through (the
    final weights are an uninterrupted run's). With three agents the third joins the running job
    after a warm-up of its fork server."""
    # A joiner warms its fork server up before it registers (4 s alone here, over 10 s on two loaded
    # cores): slower steps keep the job running until it joined (the same steps: the final weights
    # are compared within a tolerance that more steps would outgrow).
    delay = STEP_DELAY if num_agents == 2 else "0.25"
    job = plain_job(backend)
    job.add_agent(step_delay=delay)
    job.add_agent(step_delay=delay)
    job.wait_training(world_size=2, past_step=3)
    if num_agents == 3:
        job.add_agent(step_delay=delay)  # a join of the running job
    running = job.wait_training(world_size=num_agents, past_step=job.step()["step"] + 3)
    before = job.generation()
    leaving = {"leader": job.leader, "non-leader": job.non_leader, "store host": lambda: job.agents[0]}[whom]()
    leaving.send_signal(signal.SIGTERM)
    outputs = finish(job.agents, timeout=120)
    texts = "\n".join(f"--- agent {i} ---\n{text[-4000:]}" for i, (_, text) in enumerate(outputs))
    assert [code for code, _ in outputs] == [0] * num_agents, texts
    final = job.step()
    assert final["step"] == STEPS and final["world_size"] == num_agents - 1, texts
    assert final["restart_count"] == 0 and running["restart_count"] == 0
    # The store may be gone with its host: what the agents said is the record.
    assert f"status=succeeded members={num_agents - 1}" in texts, texts
    assert "workers_failed" not in texts and "restart_count=0" in texts and "restart_count=1" not in texts
    leaver_text = outputs[job.agents.index(leaving)][1]
    assert f"departure_acknowledged generation={before.number + 1}" in leaver_text, leaver_text[-3000:]
    assert "departed exit_code=0" in leaver_text
    if num_agents == 3:
        joiner = outputs[2][1]
        assert joiner.index("fork_server_warm") < joiner.index(" registered "), joiner[-3000:]
    _final_weights_match_an_uninterrupted_run(job.out / "ckpt" / "checkpoint.pt")


def test_a_killed_worker_with_max_restarts_0_ends_the_job_and_every_agent_exits_non_zero(plain_job):
    job = plain_job("etcd", nnodes="1:2")
    job.add_agent(steps=1000)
    job.add_agent(steps=1000)
    progress = job.wait_training(world_size=2, past_step=3)
    os.kill(progress["pid"], signal.SIGKILL)  # rank 0's worker
    outputs = finish(job.agents, timeout=60)
    texts = "\n".join(text[-3000:] for _, text in outputs)
    assert all(code != 0 for code, _ in outputs), texts
    final = job.generation()
    assert final.status == "failed" and "0/0 restarts used" in final.reason, final


def test_a_leave_below_min_nodes_ends_the_job_non_zero(plain_job):
    """--nnodes 2:2 and one agent leaves: it exits 1 at once (its departure left the job waiting for a
    second node), the other once the wait for --nnodes MIN times out."""
    job = plain_job("embedded", nnodes="2:2", rdzv_conf="join_timeout=4")
    job.add_agent(steps=1000)
    job.add_agent(steps=1000)
    job.wait_training(world_size=2, past_step=3)
    leaving = job.non_leader()
    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(timeout=60) == 1
    outputs = finish(job.agents, timeout=60)
    codes = {job.agents.index(leaving): 1, **{i: c for i, (c, _) in enumerate(outputs) if job.agents[i] is not leaving}}
    assert all(code == 1 for code in codes.values()), outputs
    leaver_text = outputs[job.agents.index(leaving)][1]
    assert "job_unfinished exit_code=1" in leaver_text and "waits for --nnodes MIN" in leaver_text, leaver_text[-3000:]
    stayer_text = outputs[1 - job.agents.index(leaving)][1]
    assert "join_timeout" in stayer_text, stayer_text[-3000:]


FAILING_SCRIPT = """\
import os, sys, json
json.dump({"file": __file__, "argv0": sys.argv[0], "cwd": os.getcwd()}, open(sys.argv[1], "w"))
def inner():
    raise ValueError("the script failed")
inner()
"""


def test_the_script_sees_what_python_gives_it_and_its_traceback_starts_at_the_script(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(FAILING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    direct = subprocess.run(
        [sys.executable, "sub/train.py", "direct.json"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    under = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.etcrun", "--standalone", "sub/train.py", "etcrun.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert direct.returncode == 1 and under.returncode == 1, under.stderr[-3000:]
    seen = json.loads((tmp_path / "etcrun.json").read_text())
    assert seen == json.loads((tmp_path / "direct.json").read_text())
    assert seen["file"] == str(tmp_path / "sub" / "train.py") and seen["argv0"] == "sub/train.py"
    traceback = direct.stderr.strip().splitlines()
    assert traceback[0] == "Traceback (most recent call last):"
    start = under.stderr.index("Traceback (most recent call last):")
    assert under.stderr[start:].splitlines()[: len(traceback)] == traceback, under.stderr[-3000:]


def test_the_console_is_quiet_by_default_and_the_log_file_has_every_event(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    args = [sys.executable, "-m", "etc_agent.cli.etcrun", "--standalone", "--log-dir", str(tmp_path / "logs")]
    script = [str(ROOT / "tests" / "scripts" / "sleeper.py"), str(tmp_path), "0"]
    quiet = subprocess.run([*args, *script], capture_output=True, text=True, env=env, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.strip().splitlines()
    assert len(lines) == 2, quiet.stderr  # one line per generation: the start and the end
    assert "NOTICE" in lines[0] and "generation=0 status=running" in lines[0]
    assert "generation=1 status=succeeded" in lines[1]
    (log_file,) = (tmp_path / "logs").glob("*/agent.log")
    events = log_file.read_text()
    for event in ("registered", "leader_elected", "workers_started", "workers_succeeded", "generation_seen"):
        assert f" {event} " in events, events
    loud = subprocess.run([*args, "--log-level", "info", *script], capture_output=True, text=True, env=env, timeout=60)
    assert loud.returncode == 0 and " workers_started " in loud.stderr and " registered " in loud.stderr


# ---- the pure parts: a departure's verdict, the console's levels, the script's traceback ----------


def _gen(number: int, status: str, members=("a", "b")) -> GenerationRecord:
    return GenerationRecord(number=number, status=status, members=list(members), num_devices=[1] * len(members))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("outcome", "code", "why"),
    [
        (DepartureOutcome(True, True, None, False), 0, "finished"),
        (DepartureOutcome(False, True, _gen(3, "succeeded"), True), 0, "finished"),
        (DepartureOutcome(False, True, _gen(3, "running"), True, "went_on"), 0, "goes on with 2"),
        (DepartureOutcome(False, True, _gen(3, "running"), True, "unknown"), 0, "goes on"),
        (DepartureOutcome(False, True, _gen(3, "running"), False, "unknown"), 1, "no other node"),
        (DepartureOutcome(False, True, _gen(3, "running"), True, "failed"), 1, "failed after"),
        (DepartureOutcome(False, True, _gen(3, "waiting", ["a"]), True), 1, "--nnodes MIN"),
        (DepartureOutcome(False, True, _gen(3, "failed"), True), 1, "the job failed"),
        (DepartureOutcome(False, True, None, True), 1, "in time"),
        (DepartureOutcome(False, True, None, False), 1, "no other node"),
        (DepartureOutcome(False, False, None, True), 0, "other nodes"),
        (DepartureOutcome(False, False, None, False), 1, "no other node"),
    ],
)
def test_a_departure_exits_0_only_when_the_job_goes_on_or_finished(outcome, code, why):
    verdict = departure_verdict(outcome)
    assert verdict.exit_code == code and why in verdict.reason


@pytest.mark.unit
def test_what_followed_an_acknowledgement():
    ack = _gen(3, "running")
    assert after_acknowledgement(ack, ack, {"a": "running"}) is None  # b has not started yet
    assert after_acknowledgement(ack, ack, {"a": "running", "b": "succeeded"}) == "went_on"
    assert after_acknowledgement(ack, _gen(4, "failed"), {}) == "failed"
    assert after_acknowledgement(ack, _gen(4, "running"), {}) == "went_on"


@pytest.mark.unit
def test_console_levels():
    assert console_level(None, {}) == NOTICE
    assert console_level(None, {"LOGLEVEL": "INFO"}) == logging.INFO
    assert console_level("warning", {"LOGLEVEL": "INFO"}) == logging.WARNING  # the flag wins
    with pytest.raises(ValueError, match="LOGLEVEL 'loud'"):
        console_level(None, {"LOGLEVEL": "loud"})
    assert event_level("generation_seen") == NOTICE
    assert event_level("workers_failed") == logging.WARNING
    assert event_level("workers_started") == logging.INFO
    assert event_level("fenced") == logging.WARNING and event_level("unfenced") == NOTICE


@pytest.mark.unit
def test_json_console_lines_stay_json_for_library_warnings(capsys):
    """Under ``--log-format json`` a warning that is no agent event (the etcd client's "watch
    failed", say) is a JSON line too."""
    import json

    from etc_agent.agent.console import configure_logging

    root = logging.getLogger()
    before = list(root.handlers)
    configure_logging(logging.WARNING, "json")
    try:
        logging.getLogger("etc_agent.rendezvous.etcd").warning("etcd watch on %s failed: %s", "/etc-agent/x/", "gone")
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["event"] == "agent_log" and record["level"] == "WARNING"
    assert record["message"] == "etcd watch on /etc-agent/x/ failed: gone"


@pytest.mark.unit
def test_script_path_and_user_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert script_path("sub/train.py") == f"{tmp_path}/sub/train.py"
    assert script_path("/abs/train.py") == "/abs/train.py"
    import runpy

    (tmp_path / "boom.py").write_text("def f():\n    raise KeyError(1)\nf()\n")
    with pytest.raises(KeyError) as caught:
        runpy.run_path(str(tmp_path / "boom.py"))

    def files(tb) -> list[str]:
        names = []
        while tb is not None:
            names.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        return names

    everything = files(caught.value.__traceback__.tb_next)  # from runpy's first frame on
    assert files(user_traceback(caught.value.__traceback__.tb_next)) == [str(tmp_path / "boom.py")] * 2
    assert len(everything) > 2
