"""``etc-agent plan`` through a real subprocess: JSON contract, tables, plot, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS, ROOT

JSON_FIELDS = {
    "from",
    "to",
    "devices_old",
    "devices_new",
    "assignment",
    "state_bytes",
    "need_bytes",
    "resident_bytes",
    "bytes_moved",
    "bytes_moved_inter_node",
    "lower_bound_bytes",
    "naive_bytes_moved",
    "checkpoint_bytes",
    "num_messages",
    "num_rounds",
    "transfers",
    "plan_seconds",
    "estimated_seconds",
    "plan_hash",
}


def etc_agent(*args, check=False):
    return subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.main", *args], capture_output=True, text=True, cwd=ROOT, check=check
    )


def plan_args(model="llama-7b", frm="tp=4,pp=2,dp=2", old="n0:8,n1:8", to="tp=4,pp=2,dp=1", new="n0:8"):
    return ["plan", "--model", str(MODELS / f"{model}.yaml"), "--from", frm, "--old", old, "--to", to, "--new", new]


def test_plan_json_contract():
    out = etc_agent(*plan_args(), "--json", check=True)
    data = json.loads(out.stdout)
    assert JSON_FIELDS <= set(data)
    assert data["from"] == {"tp": 4, "pp": 2, "dp": 2, "zero": 0, "dp_shard": 1}
    assert data["to"] == {"tp": 4, "pp": 2, "dp": 1, "zero": 0, "dp_shard": 1}
    assert data["devices_new"] == [f"n0:{i}" for i in range(8)]
    assert set(data["assignment"]) == {str(r) for r in range(8)}
    assert set(data["need_bytes"]) == set(data["devices_new"])
    assert data["bytes_moved"] == sum(t["bytes"] for t in data["transfers"])
    assert {"src", "dst", "bytes", "round", "num_regions"} <= set(data["transfers"][0])
    assert data["lower_bound_bytes"] <= data["bytes_moved"] <= data["naive_bytes_moved"]
    # Stage 1 only lives on n1: all of it crosses nodes; stage 0 is resident on n0.
    assert data["bytes_moved_inter_node"] == data["bytes_moved"] > 0
    assert sum(data["resident_bytes"].values()) + data["bytes_moved"] == sum(data["need_bytes"].values())
    assert data["checkpoint_bytes"] > data["bytes_moved"]


def test_plan_reports_failure_domains_and_single_node_loss():
    """tp=4,pp=2,dp=2 on 2x8 planned to itself: the default (fast) keeps Megatron's order, where each
    node holds both replicas of a stage, moves nothing and says what a node loss would lose and what
    the resilient placement would move to avoid it; --placement resilient applies it."""
    same = plan_args(to="tp=4,pp=2,dp=2", new="n0:8,n1:8")
    fast_out = json.loads(etc_agent(*same, "--json", check=True).stdout)
    fast = fast_out["failure_domains"]
    resilient_out = json.loads(etc_agent(*same, "--json", "--placement", "resilient", check=True).stdout)
    resilient = resilient_out["failure_domains"]
    assert resilient["single_domain_shards"] == 0 and resilient["worst_node_loss"]["bytes_lost"] == 0
    assert resilient["worst_node_loss"]["bytes_from_peers"] > 0
    assert (
        fast_out["bytes_moved"] == 0 and fast["single_domain_shards"] > 0 and fast["worst_node_loss"]["bytes_lost"] > 0
    )
    assert sum(n["bytes_lost"] for n in fast["node_loss"]) == fast["single_domain_bytes"]
    advice = fast_out["resilient_alternative"]
    assert advice["bytes_moved"] == resilient_out["bytes_moved"] > 0 and advice["single_domain_bytes"] == 0
    assert resilient_out["resilient_alternative"] is None
    table = etc_agent(*same, check=True).stdout
    assert "shards with one failure" in table and "worst single node loss" in table
    assert "loss of n0" in table and "loss of n1" in table and "resilient placement would" in table


@pytest.mark.parametrize(
    "new", ["n0:8,n1:8", "n1:8,n0:8", "n1:[4-7,0-3],n0:8"], ids=["same", "nodes-permuted", "devices-permuted"]
)
def test_a_plan_to_the_same_layout_on_the_same_devices_moves_nothing_by_default(new):
    """The first figure a user sees must not contradict locality: same config, same devices (in any
    order) -> 0 bytes with default flags."""
    data = json.loads(etc_agent(*plan_args(to="tp=4,pp=2,dp=2", new=new), "--json", check=True).stdout)
    assert data["bytes_moved"] == 0 and data["num_messages"] == 0
    assert sorted(data["assignment"].values()) == sorted(data["devices_new"])


def test_plan_tables_and_plot(tmp_path):
    png = tmp_path / "heat.png"
    out = etc_agent(
        *plan_args(model="gpt-tiny", frm="tp=2,dp=2", old="n0:4", to="tp=4", new="n0:4"), "--plot", str(png), check=True
    )
    assert "moved, total" in out.stdout and "lower bound" in out.stdout and "assignment" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_auto_prints_candidates_and_reason():
    out = etc_agent(*plan_args(to="auto", new="n0:8"), "--device-memory-gib", "80", check=True)
    assert "candidate configurations" in out.stdout and "winner" in out.stdout
    data = json.loads(etc_agent(*plan_args(to="auto", new="n0:8"), "--json", check=True).stdout)
    assert data["policy"]["reason"]
    winner = data["to"]
    assert winner["tp"] * winner["pp"] * winner["dp"] <= 8


@pytest.mark.parametrize(
    "args, message",
    [
        (plan_args(model="nope"), "not found"),
        (plan_args(to="tp=4,pp=2,dp=2"), "needs tp*pp*dp = 16 devices, but the device set has 8"),
        (plan_args(to="tp=3", new="n0:3"), "does not divide"),
        (plan_args(to="tp=4", new="n0:2,n1:2"), "must stay in one node"),
        (plan_args(to="tp=4,foo=1"), "bad parallel config"),
        (plan_args(new="n0:x"), "bad device set"),
        (plan_args(to="auto", new="n0:1"), "no parallel configuration fits"),
        (plan_args(frm="tp=4,pp=2,dp=2", old="n0:8,n1:8", to="tp=4", new="n0:4") + ["--failed", "n1"], "state lost"),
        (plan_args()[:-2], "Missing option '--new'"),
        (plan_args() + ["--mem-cap", "0"], "--mem-cap must be positive"),
        (plan_args(frm="tp=1,dp=100000000", old="n0:100000000"), "exceeds 1048576 devices"),
        (plan_args(old="n0:[0-99999999]"), "more than 1048576 devices"),
        (plan_args(model="../../tests/huge_model"), "exceed 1e+15 (1 PB"),
        (plan_args() + ["--plot", "no/such/dir/heat.png"], "--plot no/such/dir/heat.png: no directory no/such/dir"),
        (["simulate", "--plot", "no/such/dir/sim.png"], "--plot no/such/dir/sim.png: no directory"),
        (["status", "--rdzv-backend", "embedded", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "r"], "cannot reach"),
        (["status", "--rdzv-backend", "embedded", "--rdzv-endpoint", "127.0.0.1:99999", "--rdzv-id", "r"], "99999"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = etc_agent(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etc-agent: error: ") and message in lines[0], out.stderr


def test_reconfigure_refuses_a_layout_the_job_cannot_take_and_a_store_without_the_secret_refuses_it(monkeypatch):
    from conftest import TEST_SECRET

    from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer
    from etc_agent.rendezvous.records import GenerationRecord

    server = EmbeddedStoreServer(secret=TEST_SECRET)
    store = EmbeddedStore(server.endpoint, "job", secret=TEST_SECRET)
    record = GenerationRecord(number=3, status="running", members=["a", "b"], num_devices=[2, 2], parallel="tp=2")
    store.put("generation", record.dumps())
    common = ["--rdzv-backend", "embedded", "--rdzv-endpoint", server.endpoint, "--rdzv-id", "job"]
    try:
        monkeypatch.setenv("ETC_AGENT_SECRET", TEST_SECRET.decode())
        for parallel, message in [
            ("tp=8,dp=auto", "does not fit the job's 4 devices"),
            ("tp=1,pp=1,dp=8", "does not fit the job's 4 devices"),
            ("tp=4", "a TP group stays inside one node"),
            ("tp=auto", "tp and pp must be given"),
        ]:
            out = etc_agent("reconfigure", "--parallel", parallel, *common)
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 2 and len(lines) == 1 and message in lines[0], (parallel, out.stderr)
        assert store.get("parallel") is None
        assert etc_agent("reconfigure", "--parallel", "tp=1,pp=2,dp=auto", *common).returncode == 0
        assert json.loads(store.get("parallel").value) == {"spec": "tp=1,pp=2,dp=auto,zero=0"}

        monkeypatch.setenv("ETC_AGENT_SECRET", "a guess at the job's secret")
        out = etc_agent("reconfigure", "--parallel", "tp=2,dp=auto", *common)
        assert out.returncode == 2 and "unauthenticated" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert json.loads(store.get("parallel").value)["spec"] == "tp=1,pp=2,dp=auto,zero=0"
    finally:
        store.close()
        server.stop()


def test_etc_agent_console_script_is_installed():
    # The script pip installed beside this interpreter, whether or not its environment is activated.
    script = Path(sys.executable).parent / "etc-agent"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "plan" in out.stdout
