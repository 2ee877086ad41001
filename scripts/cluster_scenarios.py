"""Scenarios on hosts made of network namespaces (``scripts/netlab.py``), shared by
``tests/test_cluster.py`` (which asserts on them) and ``scripts/bench_cluster.py`` (which times them).

Each runs the example GPT in data parallel, one worker per host, through one fault, and returns
what happened as plain data: the survivors' stall, when the fault was detected, the steps trained
once / twice / never, the bytes a join moved and at what rate, every agent's exit code, and whether
the final state equals an uninterrupted run's, bitwise.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastic_demo import Cluster, compare_states, json_line_event, leader_of, migrations, reference_losses
from netlab import NetLab

STEP_DELAY_S = 0.1


@dataclass
class Outcome:
    """What one scenario run showed."""

    scenario: str
    codes: list[int | None]
    stall_s: float | None = None
    """From the fault to the survivors' first step without the lost member (or, with nothing lost, the
    longest gap between two steps after the fault)."""
    detect_s: float | None = None
    """From the fault to the leader's ``agent_gone`` (the decision to go on without the host)."""
    rejoin_s: float | None = None
    """From the heal to the first step with the host back."""
    steps_trained_twice: int = 0
    """Steps with two records in the loss log (rank 0 writes one per step trained)."""
    steps_missing: int = 0
    """Steps without a record. The bitwise state says whether each step was applied exactly once;
    this says whether rank 0 reported it."""
    steps_during_cut_at_old_size: int = 0
    generations: int = 0
    bytes_moved: int = 0
    rate_mbit: float | None = None
    """A join's transfer: the record's ``inter_node_gbit_s`` (bytes between hosts over its transfer
    phase), in Mbit/s."""
    state_matches: bool = False
    logs: str = ""
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "logs"}


def _records(path: Path) -> list[dict]:
    """The example's per-step records (rank 0's), in the order written."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate: Callable[[], object], timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{cluster.tail(40)}")


def _events(cluster: Cluster, name: str, agent: int | None = None) -> list[dict]:
    """Every agent's ``name`` events (``agent``: that agent's only)."""
    outputs = cluster.outputs if agent is None else [cluster.outputs[agent]]
    return [
        e
        for lines in outputs
        for line in list(lines)
        if f'"{name}"' in line and (e := json_line_event(line)) is not None and e.get("event") == name
    ]


class _Run:
    """One job on the lab's hosts: the example's arguments, the agents, the records."""

    def __init__(
        self,
        lab: NetLab,
        work: Path,
        steps: int,
        hosts: list[str],
        rdzv_endpoint: str,
        extra: list[str],
        model_args: list[str] | None = None,
    ):
        self.work, self.steps = work, steps
        self.example_args = ["--elementwise", *(model_args or [])]
        self.loss_log, self.state_file = work / "loss.jsonl", work / "state.pt"
        script = ["--steps", str(steps), "--parallel", "tp=1,pp=1,dp=auto", "--step-delay", str(STEP_DELAY_S)]
        script += ["--loss-log", str(self.loss_log), "--dump-state", str(self.state_file), *self.example_args]
        rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", uuid.uuid4().hex[:8]]
        placed = [(lab.prefix(h), lab.addr(h)) for h in hosts]
        self.cluster = Cluster(
            rdzv, 1, "tp=1,pp=1,dp=auto", script, work, False, max_nodes=len(hosts), min_nodes=2, hosts=placed
        )
        # etcrun's own defaults for the lease and the liveness probes: what a user gets.
        self.cluster.extra = ["--lease-ttl", "5", *extra]

    def records(self) -> list[dict]:
        return _records(self.loss_log)

    def start(self, num_agents: int) -> None:
        for _ in range(num_agents):
            self.cluster.add_agent()

    def wait_steps_at(self, dp: int, count: int, after: float = 0.0, timeout: float = 120) -> list[dict]:
        def found() -> list[dict]:
            return [r for r in self.records() if r["wall"] > after and f"dp={dp}," in r["config"]]

        _wait(lambda: len(found()) >= count, timeout, f"{count} steps at dp={dp}", self.cluster)
        return found()

    def finish(self, outcome: Outcome) -> Outcome:
        try:
            outcome.codes = self.cluster.finish(timeout=120)
        finally:
            for agent in self.cluster.agents:
                if agent.poll() is None:
                    agent.kill()
            for i, lines in enumerate(self.cluster.outputs):
                (self.work / f"agent-{i}.log").write_text("".join(lines))
        steps = [r["step"] for r in self.records()]
        outcome.steps_trained_twice = len(steps) - len(set(steps))
        missing = sorted(set(range(self.steps)) - set(steps))
        outcome.steps_missing = len(missing)
        outcome.extra["records_missing_for_steps"] = missing[:20]
        outcome.generations = len({r["generation"] for r in self.records()})
        outcome.logs = self.cluster.tail(60)
        _, reference = reference_losses(self.steps, self.work, self.example_args)
        outcome.state_matches = self.state_file.exists() and compare_states(self.state_file, reference) == []
        return outcome


def silent_cut(work: Path, whom: str = "non-leader", cut_s: float = 20.0, steps: int = 300) -> Outcome:
    """Three hosts; ``whom`` (``non-leader``: one that neither leads nor holds rank 0, or ``leader``)
    cut off silently for ``cut_s``, then healed."""
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        run = _Run(lab, work, steps, ["h1", "h2", "h3"], lab.etcd_endpoints, [])
        outcome = Outcome(f"cut {whom}", [])
        try:
            run.start(3)
            run.wait_steps_at(3, 5)
            leader = leader_of(run.cluster)
            assert leader is not None
            target = leader if whom == "leader" else next(i for i in (2, 1) if i != leader)
            cut_at = time.time()
            lab.cut(f"h{target + 1}")
            outcome.stall_s = run.wait_steps_at(2, 1, after=cut_at, timeout=60)[0]["wall"] - cut_at
            gone = [e for e in _events(run.cluster, "agent_gone") if e["ts"] > cut_at]
            outcome.detect_s = gone[0]["ts"] - cut_at if gone else None
            published = [e for e in _events(run.cluster, "generation_published") if e["ts"] > cut_at]
            outcome.extra["layout_s"] = published[0].get("layout_s") if published else None
            _wait(lambda: time.time() - cut_at >= cut_s, cut_s + 5, "the end of the cut", run.cluster)
            healed_at = time.time()
            lab.heal()
            outcome.rejoin_s = run.wait_steps_at(3, 1, after=healed_at, timeout=60)[0]["wall"] - healed_at
            during = [r for r in run.records() if cut_at + outcome.stall_s < r["wall"] < healed_at]
            outcome.steps_during_cut_at_old_size = sum("dp=3," in r["config"] for r in during)
            outcome.extra.update(target=target, leader=leader)
        finally:
            run.finish(outcome)
        return outcome


def etcd_leader_loss(work: Path, steps: int = 150) -> Outcome:
    """Two hosts, a 3-member etcd given leader first: the etcd leader killed for good mid-run."""
    with NetLab(num_hosts=2, num_etcd=3) as lab:
        etcd_leader = lab.wait_etcd_healthy()
        order = [etcd_leader, *(m for m in lab.etcd_members if m != etcd_leader)]
        endpoints = ",".join(f"{lab.etcd_members[m].addr}:2379" for m in order)
        run = _Run(lab, work, steps, ["h1", "h2"], endpoints, [])
        outcome = Outcome("etcd leader lost", [])
        try:
            run.start(2)
            _wait(lambda: len(run.records()) >= 20, 120, "20 steps", run.cluster)
            killed_at = time.time()
            lab.kill_etcd(etcd_leader)
            outcome.extra.update(killed=etcd_leader)
        finally:
            run.finish(outcome)
        records = run.records()
        gaps = [b["wall"] - a["wall"] for a, b in zip(records, records[1:]) if b["wall"] > killed_at]
        outcome.stall_s = max(gaps) if gaps else None
        return outcome


def shaped_join(work: Path, rate: str = "100mbit", steps: int = 120, model_args: list[str] | None = None) -> Outcome:
    """Two hosts train; a third, whose link is shaped to ``rate`` (tc tbf both ways), joins: the
    state it receives crosses the shaped link."""
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        lab.shape("h3", rate, burst="32kb")
        run = _Run(lab, work, steps, ["h1", "h2", "h3"], lab.etcd_endpoints, [], model_args)
        outcome = Outcome(f"join over {rate}", [])
        try:
            run.start(2)
            run.wait_steps_at(2, 5)
            joined_at = time.time()
            run.cluster.add_agent()
            run.wait_steps_at(3, 1, after=joined_at)
        finally:
            run.finish(outcome)
        joins = [m for m in migrations(run.cluster) if m["new_world_size"] == 3]
        if joins:
            join = joins[0]
            outcome.bytes_moved = join["bytes_moved"]
            if join.get("inter_node_gbit_s"):
                outcome.rate_mbit = round(join["inter_node_gbit_s"] * 1000, 1)
            outcome.stall_s = join.get("total_stall_s")
            outcome.extra.update(transfer_s=join.get("transfer_s"), rate=rate)
        return outcome


def _agent_of_node(cluster: Cluster, node_id: str) -> int:
    """The index of the agent whose events carry ``node_id``."""
    for k, lines in enumerate(cluster.outputs):
        if any(f'"node": "{node_id}"' in line for line in list(lines)):
            return k
    raise AssertionError(f"no agent logged node {node_id}\n{cluster.tail(20)}")


def etcd_cut(work: Path, cut_s: float = 10.0, steps: int = 260, checkpoint_interval: int = 5) -> Outcome:
    """Three hosts in dp with periodic checkpoints; the host of training rank 0 is cut off from etcd
    alone (it still reaches its peers) for ``cut_s``, then healed. It should fence itself before its
    lease can expire, the others go on without it, the checkpoint it wrote meanwhile is refused when
    it asks again after the heal (its generation was replaced), and it rejoins."""
    checkpoints = work / "checkpoints"
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        extra = ["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", str(checkpoint_interval)]
        run = _Run(lab, work, steps, ["h1", "h2", "h3"], lab.etcd_endpoints, extra)
        outcome = Outcome("cut from etcd", [])
        try:
            run.start(3)
            first = run.wait_steps_at(3, 5)[0]
            target = _agent_of_node(run.cluster, first["node"])
            cut_at = time.time()
            lab.cut(f"h{target + 1}", only="etcd")
            outcome.stall_s = run.wait_steps_at(2, 1, after=cut_at, timeout=60)[0]["wall"] - cut_at
            _wait(lambda: time.time() - cut_at >= cut_s, cut_s + 5, "the end of the cut", run.cluster)
            healed_at = time.time()
            lab.heal()
            back = run.wait_steps_at(3, 1, after=healed_at, timeout=60)[0]["wall"]
            fenced = [e["ts"] for e in _events(run.cluster, "fenced", target) if e["ts"] > cut_at]
            answered = [e["ts"] for e in _events(run.cluster, "unfenced", target) if e["ts"] > healed_at]
            outcome.detect_s = fenced[0] - cut_at if fenced else None
            outcome.rejoin_s = back - (answered[0] if answered else healed_at)
            published = [
                e["ts"]
                for e in _events(run.cluster, "generation_published")
                if e.get("members") == 3 and e["ts"] > healed_at
            ]
            during = [r for r in run.records() if cut_at + outcome.stall_s < r["wall"] < healed_at]
            outcome.steps_during_cut_at_old_size = sum("dp=3," in r["config"] for r in during)
            refused = _events(run.cluster, "checkpoint_commit_refused", target)
            outcome.extra.update(
                target=target,
                fenced_after_s=outcome.detect_s,
                republished_after_answer_s=(published[0] - answered[0]) if published and answered else None,
                refused=[(e["step"], e["generation"]) for e in refused],
                refused_after_heal=all(e["ts"] > healed_at for e in refused),
            )
        finally:
            run.finish(outcome)
        from etc_agent.protocol.checkpoints import checkpoint_path, complete_checkpoints

        complete = complete_checkpoints(checkpoints)
        outcome.extra.update(
            refused_dirs_left=[
                str(checkpoint_path(checkpoints, step, gen))
                for step, gen in outcome.extra.get("refused", [])
                if checkpoint_path(checkpoints, step, gen).exists()
            ],
            complete=[(c.step, c.generation) for c in complete],
        )
        return outcome


def quorum_loss(work: Path, outage_s: float = 20.0, steps: int = 330, checkpoint_interval: int = 20) -> Outcome:
    """Two hosts in dp with periodic checkpoints, a 3-member etcd, the agents given every member:
    two members are cut off silently for ``outage_s`` (no quorum: nothing can be written, the member
    left has no leader). Training should go on, the checkpoints due meanwhile are written but
    committed only once etcd answers again, and nothing restarts."""
    checkpoints = work / "checkpoints"
    with NetLab(num_hosts=2, num_etcd=3) as lab:
        lab.wait_etcd_healthy()
        extra = ["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", str(checkpoint_interval)]
        run = _Run(lab, work, steps, ["h1", "h2"], lab.etcd_endpoints, extra)
        outcome = Outcome("etcd quorum lost", [])
        try:
            run.start(2)
            _wait(lambda: len(run.records()) >= 30, 120, "30 steps", run.cluster)
            cut_at = time.time()
            members = list(lab.etcd_members)
            for member in members[1:]:
                lab.cut(member)
            _wait(lambda: time.time() - cut_at >= outage_s, outage_s + 5, "the end of the outage", run.cluster)
            healed_at = time.time()
            lab.heal()
            _wait(
                lambda: any(e["ts"] > healed_at for e in _events(run.cluster, "checkpoint_committed")),
                60,
                "a checkpoint committed after the outage",
                run.cluster,
            )
        finally:
            run.finish(outcome)
        records = run.records()
        gaps = [b["wall"] - a["wall"] for a, b in zip(records, records[1:]) if cut_at < b["wall"] < healed_at + 5]
        outcome.stall_s = max(gaps) if gaps else None
        committed = _events(run.cluster, "checkpoint_committed")
        outcome.extra.update(
            steps_during_outage=sum(cut_at < r["wall"] < healed_at for r in records),
            commits_during_outage=[e["step"] for e in committed if cut_at + 1.0 < e["ts"] < healed_at],
            commits_after=[(e["step"], round(e["waited_s"], 2)) for e in committed if e["ts"] >= healed_at],
            waiting=[e["step"] for e in _events(run.cluster, "checkpoint_commit_waiting") if e["ts"] > cut_at],
            shared=len(_events(run.cluster, "store_outage_shared")),
            fenced=len(_events(run.cluster, "fenced")),
            restarts=len([e for e in _events(run.cluster, "workers_started") if e["ts"] > cut_at]),
        )
        return outcome
