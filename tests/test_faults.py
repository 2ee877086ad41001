"""Faults around the agents, through real ``etcrun`` processes and a real etcd: foreign values in the
job's prefix, the leader dying, the etcd server restarting, two jobs sharing one etcd, a build() that
does not fit the state."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import ROOT, EtcdServer, run_script_json
from test_etcrun import Job, finish, job, launch  # noqa: F401 - job is a fixture

from etc_agent.rendezvous.records import LeaderRecord, NodeRecord


def events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _one_record(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _or_none(read):
    try:
        return read()
    except ValueError:
        return None


def test_foreign_values_in_the_prefix_are_rejected_and_logged(job):  # noqa: F811 - job is the fixture
    j = job(nnodes="2", extra=("--log-format", "json"))
    j.add_agent(script_args=("6",))
    j.add_agent(script_args=("6",))
    first = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
    lease = j.store.grant_lease(60)  # garbage under a lease is parsed, and rejected
    j.store.put("nodes/intruder", "not json at all", lease=lease)
    # A valid node record without a lease (a leftover, or written by hand): never a member.
    evil = NodeRecord(node_id="evil-node", host="127.0.0.1", num_devices=2, pid=os.getpid())
    j.store.put("nodes/evil-node", evil.dumps())
    j.store.put(f"generations/{first.number}/status/intruder", json.dumps({"schema_version": 99, "state": "running"}))
    j.store.put("parallel", "{")
    j.store.put(f"generations/{first.number + 5}/master", json.dumps({"addr": 1}))
    time.sleep(2.0)  # the leader re-reads the members and statuses at least every second
    # The generation itself overwritten by something foreign: the leader publishes a valid one after
    # the highest number it finds, so agents never go back to an old number.
    j.store.put("generation", json.dumps({"schema_version": 1, "number": "seven"}))
    strict = j.generation
    j.generation = lambda: _or_none(strict)  # the test's own reads must survive the foreign value too
    healed = j.wait_for(
        lambda g: g.number > first.number + 5 and g.status in ("running", "succeeded"), 30, "a valid generation again"
    )
    assert "evil-node" not in healed.members and healed.world_size == 4, healed
    outputs = finish(j.agents, timeout=120)
    texts = "\n".join(text for _, text in outputs)
    for code, text in outputs:
        assert code == 0, text[-3000:]
    assert "Traceback" not in texts
    assert "nodes/evil-node has no lease: not a member" in texts
    rejected = {e["key"]: e["reason"] for e in events(texts) if e.get("event") == "rejected_record"}
    assert "invalid NodeRecord" in rejected["nodes/intruder"]
    assert "schema version 99" in rejected[f"generations/{first.number}/status/intruder"]
    assert "generation" in rejected and "number" in rejected["generation"]
    assert "parallel" in rejected
    assert healed.world_size == 4


def test_leader_death_hands_over_without_split_brain(job):  # noqa: F811 - job is the fixture
    j = job(extra=("--log-format", "json"))
    for _ in range(3):
        j.add_agent(script_args=("30",))
    running = j.wait_for(lambda g: g.status == "running" and g.world_size == 6, 60, "three agents running")
    leader_id = LeaderRecord.loads(j.store.get("leader").value).node_id
    pids = {NodeRecord.loads(kv.value).node_id: NodeRecord.loads(kv.value).pid for kv in j.store.get_prefix("nodes/")}
    leader = next(a for a in j.agents if a.pid == pids[leader_id])
    leader.kill()
    killed = time.monotonic()
    after = j.wait_for(
        lambda g: g.number > running.number and g.world_size == 4 and g.status == "running",
        30,
        "a generation without the leader",
    )
    new_leader = LeaderRecord.loads(j.store.get("leader").value).node_id
    assert new_leader != leader_id and leader_id not in after.members
    assert time.monotonic() - killed < 15
    survivors = [a for a in j.agents if a is not leader]
    for a in survivors:
        a.send_signal(signal.SIGTERM)
    outputs = finish(survivors, timeout=60)
    published = [
        e["generation"] for _, text in outputs for e in events(text) if e.get("event") == "generation_published"
    ]
    # Every generation number was published by one leader only (compare-and-set), in order.
    assert len(published) == len(set(published))
    for _, text in outputs:
        seen = [e["generation"] for e in events(text) if e.get("event") == "generation_seen"]
        assert seen == sorted(seen)


def test_etcd_restart_keeps_training_and_membership(tmp_path, job):  # noqa: F811 - job is the fixture
    server = EtcdServer(tmp_path / "etcd-data")
    try:
        j = job(server=server, nnodes="2", extra=("--log-format", "json", "--lease-ttl", "5"))
        j.add_agent(script_args=("20",))
        j.add_agent(script_args=("20",))
        running = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
        j.wait_for_workers(running.number, 4)
        server.stop()
        time.sleep(3.0)
        server.start()
        j.store.close()
        from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore

        j.store = EtcdStore(EtcdOptions(endpoint=server.endpoint), j.run_id)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and j.num_nodes() < 2:
            time.sleep(0.2)
        assert j.num_nodes() == 2
        outputs = finish(j.agents, timeout=120)
        for code, text in outputs:
            assert code == 0, text[-3000:]
        texts = "\n".join(text for _, text in outputs)
        # Training went on: the workers of the first generation ran to the end, no new generation ran.
        started = [e for e in events(texts) if e.get("event") == "workers_started"]
        assert {e["generation"] for e in started} == {running.number}
        assert any(e.get("event") == "store_unreachable" for e in events(texts))
        # --log-format json through the outage: every line of every agent (events from several
        # threads, the store client's errors, its watch failures) is one whole JSON record.
        assert [line for line in texts.splitlines() if line.strip() and not _one_record(line)] == []
        final = j.generation()
        assert final.status == "succeeded" and final.number == running.number + 1
    finally:
        server.stop()
        server.log.close()


def test_two_jobs_on_one_etcd_do_not_touch_each_other(job):  # noqa: F811 - job is the fixture
    a, b = job(), job()
    for j in (a, b):
        j.add_agent(script_args=("30",))
        j.add_agent(script_args=("30",))
    first = {
        id(j): j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
        for j in (a, b)
    }
    # Both change at once: a gains an agent, b loses one.
    a.add_agent(script_args=("30",))
    b.agents[1].send_signal(signal.SIGTERM)
    grown = a.wait_for(lambda g: g.number > first[id(a)].number and g.world_size == 6, 30, "job a at 6")
    shrunk = b.wait_for(lambda g: g.number > first[id(b)].number and g.world_size == 2, 30, "job b at 2")
    assert len(grown.members) == 3 and len(shrunk.members) == 1
    assert set(grown.members).isdisjoint(first[id(b)].members) and set(shrunk.members) <= set(first[id(b)].members)
    # The leaving agent takes its record away as it exits, which may come just after the generation
    # without it is published.
    deadline = time.monotonic() + 15
    while b.num_nodes() != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert a.num_nodes() == 3 and b.num_nodes() == 1


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("shape", "w: rank 1 says global shape (9,)"),
        ("missing-key", "b: new rank 0, 2, 3 hold it but rank 1 of the same pipeline stage 0 does not"),
    ],
)
def test_a_build_that_does_not_fit_the_state_fails_the_job_naming_key_and_rank(etcd_server, tmp_path, mode, expected):
    j = Job(etcd_server, tmp_path, nnodes="1:2", extra=("--log-format", "json", "--max-restarts", "3"))
    try:
        steps_file = tmp_path / "steps.txt"
        first = launch(*j.args, str(ROOT / "tests" / "scripts" / "bad_build.py"), "600", str(steps_file), mode)
        j.agents.append(first)
        j.wait_for(lambda g: g.status == "running" and g.world_size == 2, 60, "one agent running")
        deadline = time.monotonic() + 60
        # The first generation has trained (a join before any step would find no state to migrate).
        while time.monotonic() < deadline and (not steps_file.exists() or len(steps_file.read_text().split()) < 3):
            time.sleep(0.1)
        second = launch(*j.args, str(ROOT / "tests" / "scripts" / "bad_build.py"), "600", str(steps_file), mode)
        j.agents.append(second)
        outputs = finish(j.agents, timeout=120)
        texts = "\n".join(text for _, text in outputs)
        assert [code for code, _ in outputs] == [1, 1], texts[-3000:]
        failed = j.generation()
        assert failed.status == "failed"
        # One clear reason, naming the key and the rank, and no restarts spent on it.
        assert "does not fit the migrating state" in failed.reason and expected in failed.reason, failed.reason
        assert failed.restart_count == 0
    finally:
        j.close()


def test_a_join_before_the_first_step_starts_fresh_instead_of_failing(etcd_server, tmp_path):
    """The first generation's workers are still on their way into ``job.start()`` when a second node
    joins: nothing has been trained, so the new generation builds fresh state (it used to fail the
    job with "no process holds any training state")."""
    j = Job(etcd_server, tmp_path, nnodes="1:2", extra=("--log-format", "json"))
    try:
        script = str(ROOT / "tests" / "scripts" / "slow_start.py")
        # The workers wait before job.start() until this file exists: the join lands there however
        # long the joining agent takes to start on a loaded machine.
        go = tmp_path / "go"
        j.agents.append(launch(*j.args, script, "30", str(go)))
        j.wait_for(lambda g: g.status == "running" and g.world_size == 2, 60, "one agent running")
        j.agents.append(launch(*j.args, script, "30", str(go)))
        j.wait_for(lambda g: g.world_size == 4, 60, "the generation with the joined node")
        go.touch()
        outputs = finish(j.agents, timeout=180)
        texts = "\n".join(text for _, text in outputs)
        assert [code for code, _ in outputs] == [0, 0], texts[-3000:]
        assert "no process holds any training state" not in texts
        steps = [line for line in texts.splitlines() if line.startswith("step ")]
        assert any("world 4" in line for line in steps), steps[-5:]
        assert j.generation().status == "succeeded"
    finally:
        j.close()


def test_a_crash_before_the_first_step_rebuilds_the_initial_state_instead_of_failing(etcd_server, tmp_path):
    """Rank 1 dies before any optimizer step while its range of a sharded tensor has no other copy:
    nothing was trained, so the next generation builds the initial state again and trains from step
    0 (it used to fail the job with "training state lost")."""
    j = Job(etcd_server, tmp_path, nnodes="1:1", extra=("--log-format", "json", "--max-restarts", "2"))
    try:
        script = str(ROOT / "tests" / "scripts" / "crash_before_first_step.py")
        j.agents.append(launch(*j.args, script, "3", str(tmp_path / "crashed")))
        outputs = finish(j.agents, timeout=180)
        texts = "\n".join(text for _, text in outputs)
        assert [code for code, _ in outputs] == [0], texts[-3000:]
        assert (tmp_path / "crashed").exists(), "the crash did not happen"
        assert "state lost" not in texts
        steps = [line for line in texts.splitlines() if line.startswith("step ")]
        # Three SGD steps with gradient 1 and lr 0.5 from the initial arange: every element lowered by 1.5.
        assert steps[-1] == f"step 2 world 2 z {[float(i) - 1.5 for i in range(24)]}", steps
    finally:
        j.close()


def test_forged_requests_are_refused_and_a_flood_leaves_the_job_training_and_the_agent_bounded():
    """scripts/probe_control_plane.py, bounded: from a process without the job's secret, forged store
    and control requests (generation -> succeeded, a lease-less node, leader deleted, fatal,
    finished, hello with pid 1), then 6 s of idle connections, connect/close churn and 20 MB
    unsigned lines. Every forged request is refused, the job trains to its last step and exits 0,
    the store still answers the job's own clients, and the agent's RSS comes back within 50 MB."""

    result = run_script_json(
        "probe_control_plane.py",
        "--flood-s",
        "6",
        "--idle",
        "300",
        "--churn-threads",
        "6",
        "--long-lines",
        "6",
        "--steps",
        "100",
        "--step-delay",
        "0.1",
    )
    assert result["forged_accepted"] == [] and result["forged_requests"] == 21, result
    assert result["exit_code"] == 0 and result["steps_trained"] == result["steps_expected"], result
    assert result["flood"]["idle_opened"] > 100 and result["flood"]["churn"] > 100, result
    assert result["legit_requests"] > 20 and result["legit_failures"] <= result["legit_requests"] // 10, result
    assert result["rss_after_mb"] - result["rss_before_mb"] <= 50, result


def test_a_wiped_prefix_is_a_store_failure_the_job_survives_without_reusing_a_generation_number(job):  # noqa: F811
    """Every key of the run deleted mid-run (``etcdctl del --prefix``; the agents' leases live on):
    each agent registers again, the leader says once that the records vanished and publishes the
    next generation after the last number it saw (never a number the job used), and the job ends
    with exit code 0 within seconds, not never."""
    j = job(nnodes="2", extra=("--log-format", "json", "--lease-ttl", "3"))
    j.add_agent(script_args=("6",))
    j.add_agent(script_args=("6",))
    running = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
    j.wait_for_workers(running.number, 4)
    wiped_at = time.monotonic()
    j.store.client.delete_prefix(j.store.full_key(""))  # one request, as etcdctl del --prefix does
    healed = j.wait_for(lambda g: g.number > running.number, 30, "a generation after the wipe")
    # The leader gives the agents a lease's time to put their records back: no "waiting" generation.
    assert healed.number == running.number + 1 and sorted(healed.members) == sorted(running.members), healed
    assert healed.status == "running" and healed.reason == "records vanished from the store", healed
    outputs = finish(j.agents, timeout=60)
    assert time.monotonic() - wiped_at < 30
    texts = "\n".join(text for _, text in outputs)
    for code, text in outputs:
        assert code == 0, text[-3000:]
    seen = [e for e in events(texts) if e.get("event") == "generation_seen"]
    for node in {e["node"] for e in seen}:
        numbers = [e["generation"] for e in seen if e["node"] == node]
        assert numbers == sorted(set(numbers)), numbers  # no number seen twice, never going back
    assert sum(e.get("event") == "node_record_vanished" for e in events(texts)) >= 2, texts[-3000:]
    # Said by the leader (two, for a moment, when the leader key went with the rest; one publish wins).
    assert 1 <= sum(e.get("event") == "store_records_vanished" for e in events(texts)) <= 2, texts[-3000:]


@pytest.mark.parametrize("store_back", [True, False], ids=["store-back", "store-down"])
def test_sigterm_after_a_store_timeout_ends_within_30_s_with_a_clear_exit_code(tmp_path, store_back):
    """The job's only node, the only leader candidate, gets SIGTERM while its etcd does not answer
    (SIGSTOPped past the 5 s request deadline). Nobody can publish a generation without it: the
    agent stops its workers and exits 1 (the job did not finish, said in one event) within 30 s,
    whether the store answers again 2 s after the signal or never."""
    server = EtcdServer(tmp_path / "etcd-data")
    losses = tmp_path / "losses.jsonl"
    agent = launch(
        *("--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3"),
        *("--rdzv-endpoint", server.endpoint, "--rdzv-id", "sigterm", "--local-addr", "127.0.0.1"),
        *("--lease-ttl", "2", "--reconfig-delay", "0.5", "--log-format", "json"),
        *("-m", "etc_agent.examples.gpt", "--steps", "100000", "--step-delay", "0.05", "--data", "synthetic"),
        *("--loss-log", str(losses)),
    )
    try:
        deadline = time.monotonic() + 90
        while not (losses.exists() and losses.read_text().count("\n") >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(6.0)  # past the request deadline: the agent's keepalives and reads time out
        agent.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        if store_back:
            time.sleep(2.0)
            os.kill(server.proc.pid, signal.SIGCONT)
        [(code, text)] = finish([agent], timeout=30)
        took = time.monotonic() - signalled
        assert code == 1, text[-3000:]
        assert took < 30, text[-3000:]
        unfinished = [e for e in events(text) if e.get("event") == "job_unfinished"]
        assert len(unfinished) == 1 and unfinished[0]["cause"] == "SIGTERM", text[-3000:]
        assert any(e.get("event") == "store_unreachable" for e in events(text)), text[-3000:]
    finally:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
        server.log.close()
