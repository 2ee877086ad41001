"""``etcrun`` end to end: several agents on one machine, over a real etcd and over the embedded store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from conftest import ROOT, _free_port

from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.records import GenerationRecord

SCRIPTS = ROOT / "tests" / "scripts"
# gloo picks its interface from the host name, which need not resolve to loopback in a sandbox.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
COMPARED = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]


def launch(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "etc_agent.cli.etcrun", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **LOOPBACK, **(env or {})},
    )


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """Wait for every agent, reading all their outputs at once: an agent whose pipe nobody drains
    blocks on a full pipe (its workers print to it too), and the others then wait for it."""
    texts: dict[int, str] = {}

    def drain(i: int, p: subprocess.Popen) -> None:
        texts[i] = p.communicate()[0]

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for p in procs:
            if p.poll() is None:
                p.kill()
        for t in threads:
            t.join(timeout=10)
        late = [i for i, p in enumerate(procs) if p.returncode is None or p.returncode < 0]
        raise AssertionError(
            f"agents {late} did not finish within {timeout} s:\n"
            + "\n".join(f"--- agent {i} ---\n{texts.get(i, '')[-3000:]}" for i in range(len(procs)))
        )
    return [(p.returncode, texts[i]) for i, p in enumerate(procs)]


SCRIPT = "tests/scripts/sleeper.py"
"""A script that exists (etcrun refuses a missing one before anything starts)."""


def run_etcrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``etcrun args`` to completion (a minute at most), output captured as text; ``env`` adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.etcrun", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env} if env else None,
    )


def rdzv_args(backend: str, request, run_id: str) -> list[str]:
    if backend == "etcd":
        server = request.getfixturevalue("etcd_server")
        return ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", server.endpoint, "--rdzv-id", run_id]
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", run_id]


def read_env(out_dir) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out_dir.glob("*.json")}


@pytest.mark.parametrize("backend", ["etcd", "embedded"])
def test_two_agents_run_a_ddp_script(backend, request, tmp_path):
    rdzv = rdzv_args(backend, request, f"ddp-{uuid.uuid4().hex[:6]}")
    # --max-restarts: gloo's teardown aborted a worker now and then on this machine (under torchrun too);
    # a restart then reruns the job, which must still end with every rank done.
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        *rdzv,
        "--local-addr",
        "127.0.0.1",
        "--reconfig-delay",
        "0.3",
        "--max-restarts",
        "2",
    ]
    procs = [launch(*common, str(SCRIPTS / "env_dump.py"), str(tmp_path)) for _ in range(2)]
    outputs = finish(procs)
    for code, text in outputs:
        assert code == 0, text[-3000:]
    env = read_env(tmp_path)
    assert sorted(env) == [0, 1, 2, 3], "\n----\n".join(text[-2000:] for _, text in outputs)
    for rank, e in env.items():
        assert e["dist_rank"] == rank and e["dist_world_size"] == 4 and e["WORLD_SIZE"] == "4"
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * 2 + int(e["LOCAL_RANK"])
        assert e["GROUP_WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" and e["OMP_NUM_THREADS"] == "1"


def test_environment_matches_torchrun(tmp_path):
    """Same job under torchrun (c10d) and etcrun (embedded, c10d flags): the same values per rank.

    One node of two workers that only record their environment (two torchrun agents with gloo workers
    hung now and then on this machine); multi-agent values are checked against the launch rules above."""
    results = {}
    for launcher in ("torchrun", "etcrun"):
        out = tmp_path / launcher
        out.mkdir()
        port = _free_port()
        args = [
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "cmp",
            "--max-restarts",
            "1",
        ]
        if launcher == "torchrun":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *args,
                str(SCRIPTS / "env_dump.py"),
                str(out),
                "--no-dist",
            ]
            procs = [
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, **LOOPBACK},
                )
            ]
        else:
            procs = [
                launch(
                    *args, "--reconfig-delay", "0.3", str(SCRIPTS / "env_dump.py"), str(out), "--no-dist", env=LOOPBACK
                )
            ]
        for code, text in finish(procs):
            assert code == 0, f"{launcher}: {text[-3000:]}"
        results[launcher] = read_env(out)
    assert sorted(results["torchrun"]) == sorted(results["etcrun"]) == [0, 1]
    for rank in range(2):
        theirs, ours = results["torchrun"][rank], results["etcrun"][rank]
        assert {k: theirs[k] for k in COMPARED} == {k: ours[k] for k in COMPARED}, rank
        for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
            assert ours[key], key
        assert ours["TORCHELASTIC_ERROR_FILE"].endswith(f"/{ours['LOCAL_RANK']}/error.json")


class Job:
    """Agents of one run on the test's etcd, with a store view to watch generations."""

    def __init__(self, etcd_server, tmp_path, nnodes="1:4", extra=()):
        self.run_id = f"job-{uuid.uuid4().hex[:6]}"
        self.store = EtcdStore(EtcdOptions(endpoint=etcd_server.endpoint), self.run_id)
        self.out = tmp_path
        self.args = [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            etcd_server.endpoint,
            "--rdzv-id",
            self.run_id,
            "--local-addr",
            "127.0.0.1",
            "--reconfig-delay",
            "0.5",
            "--lease-ttl",
            "2",
            *extra,
        ]
        self.agents: list[subprocess.Popen] = []

    def add_agent(self, script_args=("60",)) -> subprocess.Popen:
        p = launch(*self.args, str(SCRIPTS / "sleeper.py"), str(self.out), *script_args)
        self.agents.append(p)
        return p

    def generation(self) -> GenerationRecord | None:
        kv = self.store.get("generation")
        return GenerationRecord.loads(kv.value) if kv else None

    def wait_for(self, predicate, timeout: float, what: str) -> GenerationRecord:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gen = self.generation()
            if gen is not None and predicate(gen):
                return gen
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last generation: {self.generation()}")

    def wait_for_workers(self, generation: int, world: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(list(self.out.glob(f"gen{generation}_rank*.json"))) == world:
                return
            time.sleep(0.05)
        raise AssertionError(f"workers of generation {generation} did not all start")

    def num_nodes(self) -> int:
        return len(self.store.get_prefix("nodes/"))

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        self.store.close()


@pytest.fixture
def job(etcd_server, tmp_path):
    """Makes jobs on the session's etcd (or ``server``), each with its own output folder."""
    jobs = []

    def make(server=None, **kw):
        out = tmp_path / f"job{len(jobs)}" if jobs else tmp_path
        out.mkdir(parents=True, exist_ok=True)
        j = Job(server or etcd_server, out, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()


@pytest.mark.alone  # wall-clock bounds
def test_join_leave_and_kill_produce_new_generations(job):
    j = job()
    j.add_agent()
    j.add_agent()
    first = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
    j.wait_for_workers(first.number, 4)

    # A third agent joins: generation g+1 with world 6 within reconfig-delay + 2 s of its registration.
    j.add_agent()
    deadline = time.monotonic() + 60
    while j.num_nodes() < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    registered = time.monotonic()
    grown = j.wait_for(lambda g: g.world_size == 6 and g.status == "running", 30, "world of 6")
    assert time.monotonic() - registered <= 0.5 + 2.0
    assert grown.number == first.number + 1 and len(grown.members) == 3
    j.wait_for_workers(grown.number, 6)

    # SIGTERM: planned departure, a generation without that agent.
    leaving = j.agents[1]
    leaving.send_signal(signal.SIGTERM)
    shrunk = j.wait_for(
        lambda g: g.number > grown.number and g.world_size == 4, 30, "generation without the SIGTERM'd agent"
    )
    assert leaving.wait(timeout=30) == 0
    assert len(shrunk.members) == 2
    j.wait_for_workers(shrunk.number, 4)

    # kill -9: the lease lapses; detected within TTL + 1 s, then a generation without it.
    victim = j.agents[2]
    victim.kill()
    killed = time.monotonic()
    while j.num_nodes() > 1 and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert j.num_nodes() == 1 and time.monotonic() - killed <= 2.0 + 1.0
    final = j.wait_for(lambda g: g.number > shrunk.number and g.world_size == 2, 30, "generation after the kill")
    assert len(final.members) == 1
    # Workers were restarted with the new ranks every time (compat mode).
    j.wait_for_workers(final.number, 2)
    worlds = {json.loads(p.read_text())["WORLD_SIZE"] for p in j.out.glob("gen*_rank*.json")}
    assert worlds == {"4", "6", "2"}


def test_compat_mode_restarts_failed_workers_and_counts(job):
    j = job(nnodes="1", extra=("--max-restarts", "2"))
    agent = j.add_agent(script_args=("0.5", "2"))  # fails on attempts 0 and 1, succeeds on restart 2
    ((code, text),) = finish([agent], timeout=90)
    assert code == 0, text[-3000:]
    counts = sorted({json.loads(p.read_text())["TORCHELASTIC_RESTART_COUNT"] for p in j.out.glob("gen*_rank*.json")})
    assert counts == ["0", "1", "2"]
    assert "worker failure" in text


def test_compat_mode_gives_up_after_max_restarts(job):
    j = job(nnodes="1", extra=("--max-restarts", "1"))
    agent = j.add_agent(script_args=("0.5", "5"))
    ((code, text),) = finish([agent], timeout=90)
    assert code == 1, text[-3000:]
    assert "job_failed" in text and "1/1 restarts used" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "3:1", SCRIPT], "--nnodes '3:1'"),
        (["--nproc-per-node", "zero", SCRIPT], "--nproc-per-node 'zero'"),
        (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1", SCRIPT], "--rdzv-backend 'zookeeper'"),
        (["--rdzv-backend", "etcd-v3", SCRIPT], "--rdzv-endpoint is required"),
        (
            ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x", SCRIPT],
            "cannot reach etcd",
        ),
        (
            ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--etcd-ca-cert", "/nope.pem", SCRIPT],
            "not found",
        ),
        (["--standalone", "-r", "3", SCRIPT], "--redirects/--tee need --log-dir"),
        (["--standalone", "--start-method", "bogus", SCRIPT], "--start-method 'bogus': use forkserver, fork or spawn"),
        (["--no-such-flag", SCRIPT], "No such option"),
        (["--standalone", "--parallel", "auto", SCRIPT], "tp/pp auto needs --model"),
        (["--standalone", "--parallel", "tp=2,dp=many", SCRIPT], "neither an integer nor auto"),
        (["--standalone", "--parallel", "auto", "--model", "/nope.yaml", SCRIPT], "no such file"),
        (
            ["--standalone", "--nproc-per-node", "2", "--parallel", "tp=4,dp=auto", SCRIPT],
            "a TP group stays inside one node",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--parallel",
                "tp=2,pp=2,dp=2",
                SCRIPT,
            ],
            "allows at most 4",
        ),
        (
            ["--standalone", "--parallel", "auto", "--model", str(ROOT / "tests" / "bad_model.yaml"), SCRIPT],
            "bad_model.yaml",
        ),
        (["--standalone", "--worker-heartbeat-timeout", "-1", SCRIPT], "--worker-heartbeat-timeout"),
        (["--standalone", "--checkpoint-interval", "5", SCRIPT], "--checkpoint-interval needs --checkpoint-dir"),
        (
            ["--standalone", "--checkpoint-interval", "-2", "--checkpoint-dir", "/tmp", SCRIPT],
            "--checkpoint-interval: Input should be greater than or equal to 0",
        ),
        (["--standalone", "no/such/train.py"], "the training script no/such/train.py: no such file"),
        (["--standalone", "-m", "no_such_module_here"], "-m no_such_module_here: no module of that name"),
        (["--standalone", "-m", "etc_agent.no_such_part"], "-m etc_agent.no_such_part: no module of that name"),
        (["--standalone", "--no-python", "no-such-binary-here"], "--no-python no-such-binary-here: no such executable"),
        (["--standalone", "--log-dir", "pyproject.toml", SCRIPT], "--log-dir pyproject.toml: not a directory"),
        (["--config", "tests", SCRIPT], "--config tests: a directory, not a YAML file"),
        (["--config", "tests/no-such.yaml", SCRIPT], "--config tests/no-such.yaml: no such file"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:70000", SCRIPT], "port 70000 is not in 0-65535"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost", SCRIPT], "bad address 'localhost'"),
        (["--standalone", "--control-addr", "127.0.0.1:99999", SCRIPT], "port 99999 is not in 0-65535"),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.255.255.1:29400", "--rdzv-conf", "is_host=1", SCRIPT],
            "reachable from the network: give every node the job's secret",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "secret_file=/nope", SCRIPT],
            "--rdzv-conf secret_file /nope: cannot read the job's secret",
        ),
        (["--standalone", "--parallel", "tp=1,dp=100000000", SCRIPT], "needs 100000000 workers"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    p = run_etcrun(*args)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--max-restarts", "-1"], {}, "--max-restarts: Input should be greater than or equal to 0"),
        (["--reconfig-delay", "-1"], {}, "--reconfig-delay: Input should be greater than or equal to 0"),
        (["--monitor-interval", "nan"], {}, "--monitor-interval: Input should be a finite number"),
        (["--lease-ttl", "inf"], {}, "--lease-ttl: Input should be a finite number"),
        (["--log-format", "xml"], {}, "--log-format: Input should be 'text' or 'json'"),
        (["--placement", "tidy"], {}, "--placement: Input should be 'fast' or 'resilient'"),
        (
            ["--checkpoint-keep", "0", "--checkpoint-dir", "/tmp"],
            {},
            "--checkpoint-keep: Input should be greater than or equal to 1",
        ),
        (["--nproc-per-node", "0"], {}, "--nproc-per-node: Input should be greater than or equal to 1"),
        (["--control-addr", "nowhere"], {}, "--control-addr: bad address 'nowhere': expected host:port"),
        (["--rdzv-conf", "lease_ttl=0"], {}, "--rdzv-conf lease_ttl: Input should be greater than 0"),
        (["--rdzv-conf", "join_timeout=soon"], {}, "--rdzv-conf join_timeout: Input should be a valid number"),
        ([], {"PET_MAX_RESTARTS": "-1"}, "PET_MAX_RESTARTS: Input should be greater than or equal to 0"),
        (
            [],
            {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"},
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT: Input should be a valid number",
        ),
    ],
)
def test_a_rejected_agent_setting_is_one_line_naming_the_flag(args, env, message):
    """AgentConfig checks the settings; etcrun names the flag (or variable) the value came from, not the field."""
    p = run_etcrun("--standalone", *args, SCRIPT, env=env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"etcrun: error: {message}"), p.stderr
    assert "Traceback" not in p.stderr and "validation error for" not in p.stderr, p.stderr


def test_a_rejected_etcd_setting_names_its_rdzv_conf_key():
    p = run_etcrun(
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "read_timeout=0", SCRIPT
    )
    assert (
        p.returncode == 2 and p.stderr == "etcrun: error: --rdzv-conf read_timeout: Input should be greater than 0\n"
    ), p.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        ("max_restarts: -1\n", "max_restarts: Input should be greater than or equal to 0"),
        ("monitor_interval: .nan\n", "monitor_interval: Input should be a finite number"),
        ("rdzv_conf: lease_ttl=0\n", "rdzv_conf lease_ttl: Input should be greater than 0"),
    ],
)
def test_a_rejected_agent_setting_from_a_job_config_names_the_file_and_key(tmp_path, content, message):
    config = tmp_path / "job.yaml"
    config.write_text("standalone: true\n" + content)
    p = run_etcrun("--config", str(config), SCRIPT)
    assert p.returncode == 2 and p.stderr == f"etcrun: error: --config {config}: {message}\n", p.stderr

    # The same setting given as a flag wins over the file, and is the one named.
    p = run_etcrun("--config", str(config), "--max-restarts", "-2", SCRIPT)
    assert (
        p.returncode == 2 and p.stderr == "etcrun: error: --max-restarts: Input should be greater than or equal to 0\n"
    ), p.stderr


def test_agent_settings_help_is_agent_config_s_field_description():
    """One text per setting: the flag's help is AgentConfig's field description (and its default the field's)."""
    import typer

    from etc_agent.agent.config import AgentConfig
    from etc_agent.cli.etcrun import SETTING_FLAGS, SHARED_FLAG_PARAMS, app

    fields = AgentConfig.model_fields
    assert all(field.description and field.description.strip() for field in fields.values())
    assert set(SETTING_FLAGS) | set(SHARED_FLAG_PARAMS) == set(fields)
    params = {param.name: param for param in typer.main.get_command(app).params}
    by_flag = {opt: param for param in params.values() for opt in param.opts}
    for field, flag in SETTING_FLAGS.items():
        assert by_flag[flag].help == fields[field].description, flag
        if field not in (
            "run_id",
            "node_rank",
            "shutdown_timeout",
        ):  # etcrun's defaults: "none", 0 (static), the variable or 30
            assert by_flag[flag].default == fields[field].default, flag
    for field, param in SHARED_FLAG_PARAMS.items():  # one flag, several values: the help names each field's meaning
        assert fields[field].description in params[param].help, (field, param)
    p = run_etcrun("--help")
    shown = "".join(p.stdout.split())  # as printed, wrapped lines joined
    for field, flag in SETTING_FLAGS.items():
        assert "".join(fields[field].description.split()) in shown, flag


def test_agent_config_checks_its_settings_without_etcrun():
    """What etcrun checked before building AgentConfig, AgentConfig now checks for any caller."""
    from pydantic import ValidationError

    from etc_agent.agent.config import AgentConfig

    assert AgentConfig(run_id="j", nproc_per_node=2, parallel="tp=2,dp=auto").parallel == "tp=2,pp=1,dp=auto,zero=0"
    assert AgentConfig(run_id="j", parallel="").parallel is None
    for values in (
        dict(min_nodes=3, max_nodes=1),
        dict(migration="checkpoint"),
        dict(checkpoint_interval=5),
        dict(monitor_interval=float("nan")),
        dict(join_timeout=float("inf")),
        dict(log_format="xml"),
        dict(placement="tidy"),
        dict(control_addr="nowhere"),
        dict(parallel="auto"),
        dict(parallel="tp=2,dp=auto"),
        dict(parallel="tp=2,pp=1,dp=2", nproc_per_node=2),
        dict(parallel="tp=1,pp=1,dp_replicate=4,dp_shard=4", nproc_per_node=4, max_nodes=2),  # 16 > 8 workers
        dict(model="/nope.yaml"),
        dict(model=str(ROOT / "tests" / "bad_model.yaml")),
    ):
        with pytest.raises(ValidationError):
            AgentConfig(run_id="j", **values)


def test_help_lists_torchrun_flags():
    p = run_etcrun("--help")
    assert p.returncode == 0
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv-conf",
        "--standalone",
        "--max-restarts",
        "--monitor-interval",
        "--start-method",
        "--role",
        "--module",
        "--no-python",
        "--run-path",
        "--log-dir",
        "--redirects",
        "--tee",
        "--local-ranks-filter",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--local-addr",
        "--shutdown-timeout",
        "--parallel",
        "--model",
        "--reconfig-delay",
        "--etcd-ca-cert",
    ):
        assert flag in p.stdout, flag


def test_status_shows_members_and_generation(job):
    j = job()
    j.add_agent()
    j.add_agent()
    gen = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
    endpoint = j.args[j.args.index("--rdzv-endpoint") + 1]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "etc_agent.cli.main",
            "status",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            j.run_id,
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["generation"]["number"] == gen.number and data["generation"]["members"] == gen.members
    assert len(data["nodes"]) == 2 and data["leader"] in gen.members
    p = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.main", "status", "--rdzv-endpoint", endpoint, "--rdzv-id", j.run_id],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"generation {gen.number} running, world size 4" in p.stdout and "leader" in p.stdout


def test_plain_torchrun_gains_an_etcd_v3_backend(etcd_server, tmp_path):
    """Unmodified torchrun with --rdzv-backend etcd-v3 (this package's torchrun.handlers plugin)."""
    args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--rdzv-id",
        f"tr-{uuid.uuid4().hex[:6]}",
        "--rdzv-conf",
        "last_call_timeout=1",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *args,
        str(SCRIPTS / "env_dump.py"),
        str(tmp_path),
        "--no-dist",
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **LOOPBACK}
        )
        for _ in range(2)
    ]
    for code, text in finish(procs, timeout=120):
        assert code == 0, text[-3000:]
    env = read_env(tmp_path)
    assert sorted(env) == [0, 1, 2, 3]
    assert {e["GROUP_RANK"] for e in env.values()} == {"0", "1"} and {e["WORLD_SIZE"] for e in env.values()} == {"4"}
    store = EtcdStore(EtcdOptions(endpoint=etcd_server.endpoint), env[0]["TORCHELASTIC_RUN_ID"])
    assert store.get("torch/rendezvous/state") is not None  # the state lived in etcd v3, under our prefix
    store.close()


def test_embedded_store_host_leaving_keeps_the_job_alive(tmp_path):
    """SIGTERM to the agent hosting the embedded store: its workers leave, the store stays up."""
    port = _free_port()
    args = [
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "host-leaves",
        "--local-addr",
        "127.0.0.1",
        "--reconfig-delay",
        "0.3",
        "--lease-ttl",
        "2",
    ]
    host = launch(*args, "--rdzv-conf", "is_host=true", str(SCRIPTS / "sleeper.py"), str(tmp_path), "60")
    time.sleep(3)
    other = launch(*args, "--rdzv-conf", "is_host=false", str(SCRIPTS / "sleeper.py"), str(tmp_path), "60")
    from etc_agent.rendezvous.embedded import EmbeddedStore

    store = EmbeddedStore(f"127.0.0.1:{port}", "host-leaves", connect_timeout_s=10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kv = store.get("generation")
        if (
            kv
            and GenerationRecord.loads(kv.value).world_size == 2
            and GenerationRecord.loads(kv.value).status == "running"
        ):
            break
        time.sleep(0.1)
    before = GenerationRecord.loads(store.get("generation").value)
    assert before.world_size == 2
    host.send_signal(signal.SIGTERM)
    while time.monotonic() < deadline:
        gen = GenerationRecord.loads(store.get("generation").value)
        if gen.number > before.number and gen.world_size == 1 and gen.status == "running":
            break
        time.sleep(0.1)
    assert gen.world_size == 1 and len(gen.members) == 1
    while time.monotonic() < deadline and len(store.get_prefix("nodes/")) > 1:
        time.sleep(0.1)  # the host's departure is done once its record is gone
    time.sleep(1)
    assert host.poll() is None  # still serving the store
    assert other.poll() is None  # and the remaining agent goes on
    other.send_signal(signal.SIGTERM)
    (code_other, other_text), (code_host, host_text) = finish([other, host], timeout=60)
    # The host left while another node went on (0); the other was the last, so SIGTERM ended an
    # unfinished job, which torchrun's exit code says (1).
    assert code_host == 0 and code_other == 1, other_text[-3000:]
    assert "store_host_staying" in host_text and "job_unfinished" in other_text
    store.close()


def test_below_min_nodes_the_job_waits_then_resumes(job):
    j = job(nnodes="2:3")
    j.add_agent()
    j.add_agent()
    running = j.wait_for(lambda g: g.status == "running" and g.world_size == 4, 60, "two agents running")
    j.agents[0].kill()
    waiting = j.wait_for(lambda g: g.number > running.number and g.status == "waiting", 30, "waiting below MIN")
    assert len(waiting.members) == 1
    j.add_agent()
    j.wait_for(lambda g: g.number > waiting.number and g.status == "running" and g.world_size == 4, 30, "running again")


def test_json_logs_and_redirected_worker_output(tmp_path):
    log_dir = tmp_path / "logs"
    p = launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-format",
        "json",
        "--log-dir",
        str(log_dir),
        "-r",
        "0:1",
        "-t",
        "1:1",
        str(SCRIPTS / "env_dump.py"),
        str(tmp_path),
        "--no-dist",
    )
    ((code, text),) = finish([p], timeout=60)
    assert code == 0, text
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert {"registered", "generation_published", "workers_started", "workers_succeeded"} <= {
        e["event"] for e in events
    }
    # rank 0's stdout went to its file only; rank 1's went to its file and to the console, prefixed.
    stdout_files = sorted(log_dir.rglob("stdout.log"))
    assert [f.parent.name for f in stdout_files] == ["0", "1"]
    assert stdout_files[0].read_text() == "rank 0 done\n" and stdout_files[1].read_text() == "rank 1 done\n"
    assert "[default1]:rank 1 done" in text and "rank 0 done" not in text


def test_workers_reach_their_agent_over_the_control_channel(tmp_path):
    p = launch("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "ask_agent.py"), str(tmp_path))
    ((code, text),) = finish([p], timeout=60)
    assert code == 0, text
    answers = read_env(tmp_path)
    assert sorted(answers) == [0, 1]
    for a in answers.values():
        assert a["running"] == int(a["env_generation"]) == a["hello"]["generation"] and a["world_size"] == 2
        assert a["node_id"] == a["hello"]["node_id"]
        # Malformed requests are refused by the pydantic models, each naming what is wrong.
        local_rank, steps, record, unknown, extra = (
            a["errors"][0],
            a["errors"][2],
            a["errors"][3],
            a["errors"][4],
            a["errors"][5],
        )
        assert "invalid request" in local_rank and "local_rank" in local_rank, a["errors"]
        assert "not a worker of this node" in a["errors"][1], a["errors"]
        assert "step" in steps and "record" in record and "reboot" in unknown and "invalid request" in extra, a[
            "errors"
        ]
        # Signed requests that do not fit what the agent knows: another pid, another rank's name,
        # rank 0's reports from a worker that is not training rank 0 (or a record of no generation).
        pid, other_rank, report = a["errors"][6:9]
        assert "pid 1 is not the worker this agent started" in pid, a["errors"]
        assert "names local rank" in other_rank, a["errors"]
        assert "training rank 0's report" in report or "invalid request" in report, a["errors"]
        # Requests without this worker's key never reach the agent's handlers.
        assert [("bad signature" if i == 0 else "unknown key") in e for i, e in enumerate(a["unsigned"])] == [
            True
        ] * 3, a["unsigned"]


def test_waiting_for_min_nodes_times_out_with_a_clear_reason(job):
    j = job(nnodes="2", extra=("--rdzv-conf", "join_timeout=3"))
    agent = j.add_agent()
    ((code, text),) = finish([agent], timeout=60)
    assert code == 1 and "join_timeout" in text and "needed=2" in text


def test_a_job_config_file_gives_the_flags_and_the_command_line_wins(tmp_path):
    """``etcrun --config job.yaml``: the file's options and script run the job; a flag on the command
    line replaces the file's value (here 2 workers instead of 1); the script's own ``--config`` is its own."""
    out = tmp_path / "env"
    out.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(
        f"standalone: true\nnproc_per_node: 1\nmax_restarts: 1\nrole: trainer\n"
        f"script: {SCRIPTS / 'env_dump.py'}\nscript_args: [{str(out)!r}, --no-dist]\n"
    )
    ((code, text),) = finish([launch("--config", str(config), "--nproc-per-node", "2", env=LOOPBACK)])
    assert code == 0, text[-3000:]
    env = read_env(out)
    assert sorted(env) == [0, 1], text[-3000:]
    assert (
        env[0]["ROLE_NAME"] == "trainer" and env[0]["WORLD_SIZE"] == "2" and env[0]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    )

    # A script named on the command line comes with its own arguments, not the file's.
    out2 = tmp_path / "env2"
    out2.mkdir()
    ((code, text),) = finish(
        [launch("--config", str(config), str(SCRIPTS / "env_dump.py"), str(out2), "--no-dist", env=LOOPBACK)]
    )
    assert code == 0, text[-3000:]
    assert sorted(read_env(out2)) == [0] and not list(out.glob("*.tmp"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("nproc_per_node: 2\nnprocs: 3\n", "nprocs: Extra inputs are not permitted; keys are etcrun's long options"),
        ("max_restarts: many\n", "max_restarts: Input should be a valid integer"),
        ("- a\n- b\n", "expected a mapping of etcrun options"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_a_bad_job_config_is_one_line_and_exit_2(tmp_path, content, message):
    config = tmp_path / "job.yaml"
    config.write_text(content)
    p = run_etcrun("--config", str(config), SCRIPT)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and message in lines[0] and str(config) in lines[0], p.stderr


def test_the_example_job_configs_are_valid():
    from etc_agent.cli.etcrun import etcrun
    from etc_agent.cli.jobconfig import load_job_config

    for path in sorted((ROOT / "configs" / "jobs").glob("*.yaml")):
        values = load_job_config(path, etcrun)
        assert values["training_script"] and values["parallel"], path
