"""A cluster on one machine (``scripts/netlab.py``): hosts made of network namespaces, each with its
own address, one agent per host, a real etcd in namespaces of its own. Every scenario checks the
training state bitwise against an uninterrupted run.

Marked ``cluster``; skipped with the reason where the machine cannot make namespaces (not root, no
``ip`` / ``nft`` / ``tc``)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from elastic_demo import Cluster, compare_states, json_line_event, leader_of, reference_losses, run_scenario
from netlab import NetLab, unavailable

_WHY_NOT = unavailable()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network lab: {_WHY_NOT}")]

STEPS = 40


def _registered(lines: list[str]) -> dict:
    return next(e for line in lines if (e := json_line_event(line)) and e.get("event") == "registered")


def test_hosts_with_their_own_addresses_join_and_leave_live_with_local_addr_alone(tmp_path):
    """Three hosts, ``--local-addr`` alone (no GLOO_SOCKET_IFNAME or other interface variable): the
    agents advertise their hosts' addresses, the workers' groups bind to the hosts' interfaces, and
    a join and a planned leave migrate live; the final state is the uninterrupted run's, bitwise."""
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        hosts = [(lab.prefix(name), lab.addr(name)) for name in ("h1", "h2", "h3")]
        rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", lab.etcd_endpoints, "--rdzv-id", uuid.uuid4().hex[:8]]
        result = run_scenario(
            "tp=1,pp=1,dp=auto",
            1,
            STEPS,
            0.1,
            tmp_path,
            echo=False,
            rdzv=rdzv,
            events=("join", "leave"),
            extra_script_args=["--elementwise"],
            hosts=hosts,
        )
        logs = result["cluster"].tail(40)
        assert result["codes"] == [0, 0, 0], f"agents exited {result['codes']}\n{logs}"
        for (_, addr), lines in zip(hosts, result["cluster"].outputs, strict=True):
            registered = _registered(lines)
            assert registered["host"] == addr and registered["interface"] == "eth0", registered
        records = sorted(result["migrations"], key=lambda m: m["generation"])
        assert [(r["old_world_size"], r["new_world_size"]) for r in records] == [(2, 3), (3, 2)], records
        assert records[0]["bytes_moved"] > 0, records  # the joining host got a replica over its link
        assert sorted(result["losses"]) == list(range(STEPS)), logs
        _, reference_state = reference_losses(STEPS, tmp_path, ["--elementwise"])
        assert compare_states(result["state_file"], reference_state) == [], logs


def _records(path: Path) -> list[dict]:
    """The example's per-step records (rank 0's), in the order written."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{cluster.tail(40)}")


CUT_S = 20.0
CUT_STEPS = 300  # 0.1 s a step (0.11 s here): the cut, the rejoin and 60+ steps after it


@pytest.mark.parametrize("whom", ["non-leader", "leader"])
def test_a_host_cut_off_silently_costs_the_survivors_at_most_3_s_and_rejoins_after_the_heal(tmp_path, whom):
    """Three hosts in dp; one is cut off silently (packets dropped both ways, no reset) for 20 s
    mid-run: one that neither leads nor holds rank 0, or the leader's (another agent takes the
    leader key over once the leader's port is silent). Default liveness flags: the survivors train
    again within 3 s, no step runs at the old world size while it is cut, it rejoins after the heal,
    every agent exits 0 and the final state is the uninterrupted run's, bitwise."""
    loss_log, state_file = tmp_path / "loss.jsonl", tmp_path / "state.pt"
    script = ["--steps", str(CUT_STEPS), "--parallel", "tp=1,pp=1,dp=auto", "--step-delay", "0.1"]
    script += ["--loss-log", str(loss_log), "--dump-state", str(state_file), "--elementwise"]
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", lab.etcd_endpoints, "--rdzv-id", uuid.uuid4().hex[:8]]
        hosts = [(lab.prefix(name), lab.addr(name)) for name in ("h1", "h2", "h3")]
        # Default --lease-ttl and --peer-timeout: what a user gets (Cluster's own default is 3 s).
        cluster = Cluster(rdzv, 1, "tp=1,pp=1,dp=auto", script, tmp_path, False, max_nodes=3, min_nodes=2, hosts=hosts)
        cluster.extra = ["--lease-ttl", "5"]
        try:
            for _ in hosts:
                cluster.add_agent()
            at_three = lambda: [r for r in _records(loss_log) if "dp=3" in r["config"]]  # noqa: E731
            _wait(lambda: len(at_three()) >= 5, 120, "5 steps at dp=3", cluster)
            leader = leader_of(cluster)
            assert leader is not None
            target = leader if whom == "leader" else next(i for i in (2, 1) if i != leader)
            cut_at = time.time()
            lab.cut(f"h{target + 1}")
            after = lambda: [r for r in _records(loss_log) if r["wall"] > cut_at and "dp=2" in r["config"]]  # noqa: E731
            _wait(lambda: after(), 60, "a step at dp=2 after the cut", cluster)
            stall = after()[0]["wall"] - cut_at
            _wait(lambda: time.time() - cut_at >= CUT_S, CUT_S + 5, "the end of the cut", cluster)
            healed_at = time.time()
            lab.heal()
            back = lambda: [r for r in _records(loss_log) if r["wall"] > healed_at and "dp=3" in r["config"]]  # noqa: E731
            _wait(lambda: back(), 60, "the cut host back at dp=3", cluster)
            rejoined = back()[0]["wall"] - healed_at
            codes = cluster.finish(timeout=120)
        finally:
            for agent in cluster.agents:
                if agent.poll() is None:
                    agent.kill()
            for i, lines in enumerate(cluster.outputs):
                (tmp_path / f"agent-{i}.log").write_text("".join(lines))
        logs = cluster.tail(60)
        print(f"{whom} cut: survivors' stall {stall:.2f} s, rejoined {rejoined:.2f} s after the heal")
        assert codes == [0, 0, 0], f"agents exited {codes}\n{logs}"
        assert stall <= 3.0, f"the survivors trained again {stall:.2f} s after the cut\n{logs}"
        during = [r for r in _records(loss_log) if cut_at < r["wall"] < healed_at]
        assert during and all("dp=2" in r["config"] for r in during), "a step at dp=3 while a host was cut"
        steps = [r["step"] for r in _records(loss_log)]
        assert sorted(set(steps)) == list(range(CUT_STEPS)), logs
        cut_text = "".join(cluster.outputs[target])
        assert '"agent_gone"' in "".join("".join(lines) for lines in cluster.outputs), logs
        deciders = [i for i in range(3) if i != target] if whom == "leader" else [leader]
        assert any("unreachable" in "".join(cluster.outputs[i]) for i in deciders), logs
        _, reference_state = reference_losses(CUT_STEPS, tmp_path, ["--elementwise"])
        assert compare_states(state_file, reference_state) == [], cut_text[-3000:]


ETCD_STEPS = 150


def test_losing_the_etcd_leader_costs_training_at_most_2_s_and_restarts_nothing(tmp_path):
    """A 3-member etcd, two hosts in dp, the agents given every member (the leader first, so the
    member they talk to is the one that dies): the etcd leader is killed for good mid-run. The
    agents fail over to the other members; training never waits more than 2 s between steps, no
    generation follows, the finished job is reported finished (exit 0) and the final state is the
    uninterrupted run's."""
    loss_log, state_file = tmp_path / "loss.jsonl", tmp_path / "state.pt"
    script = ["--steps", str(ETCD_STEPS), "--parallel", "tp=1,pp=1,dp=auto", "--step-delay", "0.1"]
    script += ["--loss-log", str(loss_log), "--dump-state", str(state_file), "--elementwise"]
    with NetLab(num_hosts=2, num_etcd=3) as lab:
        leader = lab.wait_etcd_healthy()
        members = [leader, *(m for m in lab.etcd_members if m != leader)]
        endpoints = ",".join(f"{lab.etcd_members[m].addr}:2379" for m in members)
        rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoints, "--rdzv-id", uuid.uuid4().hex[:8]]
        hosts = [(lab.prefix(name), lab.addr(name)) for name in ("h1", "h2")]
        cluster = Cluster(rdzv, 1, "tp=1,pp=1,dp=auto", script, tmp_path, False, max_nodes=2, min_nodes=2, hosts=hosts)
        try:
            for _ in hosts:
                cluster.add_agent()
            _wait(lambda: len(_records(loss_log)) >= 20, 120, "20 steps", cluster)
            killed_at = time.time()
            lab.kill_etcd(leader)
            codes = cluster.finish(timeout=120)
        finally:
            for agent in cluster.agents:
                if agent.poll() is None:
                    agent.kill()
            for i, lines in enumerate(cluster.outputs):
                (tmp_path / f"agent-{i}.log").write_text("".join(lines))
        logs = cluster.tail(40)
        records = _records(loss_log)
        after = [r for r in records if r["wall"] > killed_at]
        gaps = [b["wall"] - a["wall"] for a, b in zip(records, records[1:]) if b["wall"] > killed_at]
        print(
            f"etcd leader {leader} killed at step {records[-len(after)]['step']}: longest step gap after it {max(gaps):.2f} s"
        )
        assert codes == [0, 0], f"agents exited {codes}\n{logs}"
        assert after and max(gaps) <= 2.0, f"a {max(gaps):.2f} s gap between steps after the kill\n{logs}"
        assert {r["generation"] for r in records} == {0}, "a generation followed the loss of the etcd leader"
        assert sorted(r["step"] for r in records) == list(range(ETCD_STEPS)), logs
        text = "".join("".join(lines) for lines in cluster.outputs)
        assert "job_unfinished" not in text and '"status": "succeeded"' in text, logs
        _, reference_state = reference_losses(ETCD_STEPS, tmp_path, ["--elementwise"])
        assert compare_states(state_file, reference_state) == [], logs
