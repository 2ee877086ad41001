import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TEST_SECRET = b"the job secret of the store tests"
"""The secret of the embedded stores the tests start themselves (etcrun makes its own)."""
ROOT = Path(__file__).resolve().parent.parent
# Agents started by the tests say every event on their console (the tests read them there); a
# user's console is quieter (docs/cli.md), which tests/test_plain.py checks without this.
os.environ.setdefault("LOGLEVEL", "INFO")
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Before any process is forked from multiprocessing's fork server (dist_harness, the demo's reference
# runs): it keeps the sys.path it started with, and its children import their functions from these.
sys.path.insert(0, str(ROOT / "scripts"))
MODELS = ROOT / "configs" / "models"
LEAVE_SPREAD_S = 5.0
"""The most a crash's survivors may take to leave their collectives one after another in an end-to-end
test (a migration record's ``leave_spread_s``). Each leaves at once, and on a quiet machine the
spread is a fraction of a second (``scripts/bench_crash.py``); with two end-to-end tests at once on
two cores it reached 3.8 s. What the bound catches is a survivor that waits for a collective's
timeout (60 s and more) instead of leaving. Tests marked ``alone`` keep the 2 s bound."""

# Every test is in exactly one layer (markers registered in pyproject.toml; docs/development.md):
#   unit       in this process: no subprocess, no agents, no etcd. The fast layer: python -m pytest -m unit
#   multiproc  starts Python processes of its own: torch.distributed workers over gloo
#              (dist_harness.run_workers), fresh interpreters
#   e2e        runs the package's commands in a subprocess (etcrun, etc-agent, the examples), agents,
#              or a real etcd server
# A file's layer, then the tests of that file that belong to another one. A pattern is a test's name,
# which takes in all its parametrizations, or its name with the [id]; * stands for any characters.
# A test marked @pytest.mark.unit/multiproc/e2e in its file keeps that mark.
TEST_LAYERS: dict[str, tuple[str, dict[str, list[str]]]] = {
    "test_ahead.py": ("unit", {}),
    "test_auth.py": ("unit", {}),
    "test_backends.py": ("unit", {}),
    "test_boundary.py": ("unit", {"multiproc": ["test_ranks_with_different_paces_vote_at_the_same_boundaries"]}),
    "test_checkpoint_baseline.py": ("multiproc", {}),
    "test_cli.py": ("e2e", {}),
    "test_cluster.py": (
        "e2e",
        {},
    ),  # also marked cluster: hosts made of network namespaces  # etc-agent plan in a subprocess, about 2 s each
    "test_control_plane.py": ("e2e", {}),
    "test_control_poll.py": ("unit", {}),
    "test_controlauth.py": ("unit", {}),
    "test_decision.py": ("unit", {}),
    "test_dependencies.py": ("unit", {"e2e": ["test_the_cuda_lock_pins_every_package_the_cuda_wheel_pulls"]}),
    "test_elastic.py": ("e2e", {}),
    "test_etcd_auth.py": ("e2e", {}),
    "test_etcd_tls.py": ("e2e", {}),
    "test_endpoints.py": ("unit", {}),
    "test_endwatch.py": ("unit", {}),
    "test_etcrun.py": ("e2e", {"unit": ["test_the_example_job_configs_are_valid"]}),
    "test_faults.py": ("e2e", {}),
    "test_forkserver.py": (
        "multiproc",
        {"e2e": ["test_etcrun_forks_its_workers_from_the_fork_server_by_default", "test_etcrun_start_method_spawn_*"]},
    ),
    "test_failures.py": ("unit", {"multiproc": ["test_the_agent_does_not_import_torch"]}),
    "test_gone.py": ("unit", {}),
    "test_spares.py": ("e2e", {"multiproc": ["test_a_spare_*"]}),
    "test_genwatch.py": ("unit", {}),  # the embedded store serves from a thread of this process
    "test_leader.py": ("unit", {}),
    "test_timeline.py": ("unit", {}),
    "test_metrics.py": (
        "unit",
        {"e2e": ["test_agents_metrics_logs_and_timeline_*", "test_a_flood_on_the_metrics_port_*"]},
    ),
    "test_netaddr.py": ("unit", {}),
    "test_node_state.py": ("unit", {}),
    "test_settings.py": ("unit", {}),
    "test_groups.py": (
        "multiproc",
        {
            "unit": [
                "test_destroy_all_groups_replaces_function_defaults_that_hold_the_group_and_frees_it",
                "test_release_defaults_leaves_modules_outside_torch_and_other_defaults_alone",
                "test_after_a_formation_that_failed_inside_init_process_group_the_next_one_uses_the_same_group_names",
            ]
        },
    ),
    "test_k8s.py": ("e2e", {}),  # etcrun --help in a subprocess
    "test_layers.py": ("unit", {}),
    "test_layout.py": ("unit", {}),
    "test_llama.py": ("e2e", {}),
    "test_megatron.py": (
        "multiproc",
        {
            "unit": [
                "test_layer_numbers_go_into_the_key_and_swiglu_boxes_fold_into_one",
                "test_megatron_parallel_state_takes_tp_and_pp_from_the_job_only",
            ],
            "e2e": ["test_megatron_gpt_trains_through_join_leave_reconfigure_and_crash_under_etcrun"],
        },
    ),
    "test_fsdp.py": ("multiproc", {"unit": ["test_a_strided_shard_that_is_not_fsdp_over_tp_is_refused_by_name"]}),
    "test_migrate.py": ("multiproc", {"unit": ["test_case_matrix_covers_the_required_transitions"]}),
    "test_migrate_module.py": ("multiproc", {}),
    "test_planner.py": ("unit", {"multiproc": ["test_plan_hash_is_the_same_in_fresh_processes"]}),
    "test_planner_scale.py": ("unit", {}),
    "test_plain.py": ("e2e", {}),
    "test_prepare.py": ("unit", {}),
    "test_protocol.py": ("unit", {}),
    "test_reach.py": ("unit", {}),
    "test_fence.py": ("unit", {}),
    "test_data.py": ("unit", {}),
    "test_data_elastic.py": ("e2e", {}),
    "test_restore.py": ("multiproc", {}),
    "test_sever.py": ("unit", {}),  # real sockets of this process, no other process
    "test_sim.py": (
        "unit",
        {"e2e": ["test_simulate_bench_suite_json_and_comparison", "test_simulate_bad_input_is_one_line_and_exit_2"]},
    ),
    "test_store.py": ("unit", {"e2e": ["*[etcd]"]}),  # the embedded store serves from a thread of this process
    "test_torchrun_conformance.py": (
        "e2e",
        {"unit": ["test_every_torchrun_option_is_an_etcrun_option_read_from_its_PET_variable"]},
    ),
    "test_worldgroups.py": ("multiproc", {}),
    "test_worker.py": ("unit", {"e2e": ["test_plain_python_runs_the_example_as_a_world_of_one"]}),
}
LAYER_MARKS = ("unit", "multiproc", "e2e")


def _matches(pattern: str, item: pytest.Item) -> bool:
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return any(re.fullmatch(regex, name) for name in (item.name, getattr(item, "originalname", item.name)))


def layer_of_test(item: pytest.Item) -> str:
    """The layer ``item`` belongs to by ``TEST_LAYERS``; a usage error for a file the table lacks."""
    relative = item.path.relative_to(Path(__file__).resolve().parent).as_posix()
    if relative not in TEST_LAYERS:
        raise pytest.UsageError(
            f"{relative} is in no test layer: add it to TEST_LAYERS in tests/conftest.py "
            f"({', '.join(LAYER_MARKS)}; see docs/development.md)"
        )
    layer, overrides = TEST_LAYERS[relative]
    for other, patterns in overrides.items():
        if any(_matches(pattern, item) for pattern in patterns):
            return other
    return layer


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    for relative, (layer, overrides) in TEST_LAYERS.items():
        unknown = {layer, *overrides} - set(LAYER_MARKS)
        if unknown:
            raise pytest.UsageError(f"TEST_LAYERS[{relative!r}] names {sorted(unknown)}; the layers are {LAYER_MARKS}")
    for item in items:
        if not any(item.get_closest_marker(mark) for mark in LAYER_MARKS):
            item.add_marker(getattr(pytest.mark, layer_of_test(item)))
    items.sort(key=_run_order)


def _run_order(item: pytest.Item) -> int:
    """Under the README's two xdist workers, handed out one at a time in this order: the ``alone``
    tests first (each waits only for the other worker's first test, not for whatever long test it
    is in the middle of), then the end-to-end layer, the multi-process one and the unit tests last
    (the run's tail is short tests, not one worker idle beside a minute-long scenario). The sort is
    stable: within a group, files and tests keep their order."""
    if item.get_closest_marker("alone") is not None:
        return 0
    for rank, layer in enumerate(("e2e", "multiproc"), start=1):
        if item.get_closest_marker(layer) is not None:
            return rank
    return 3


class _RunAlone:
    """The suite runs on two pytest-xdist workers (the README's test command); most end-to-end tests
    spend their time waiting on paced steps, so two at once roughly halve the wall time. A test
    marked ``alone`` asserts wall-clock bounds that a second test's CPU load would eat into: it
    holds this lock exclusively and the other worker waits, every other test holds it shared. The
    turnstile keeps shared holders from starving an exclusive one (each acquire passes through it,
    and an exclusive waiter keeps it until it has the lock)."""

    def __init__(self, run_id: str):
        base = Path(os.environ.get("TMPDIR", "/tmp")) / f"etc-agent-tests-{run_id}"
        self._turnstile = open(f"{base}.turnstile", "a+")  # held for the session
        self._lock = open(f"{base}.lock", "a+")  # held for the session

    def acquire(self, exclusive: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def _run_alone_lock():
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    yield _RunAlone(run_id) if run_id else None


@pytest.fixture(autouse=True)
def _one_at_a_time_where_asked(request, _run_alone_lock):
    if _run_alone_lock is None:  # not under xdist: every test runs alone anyway
        yield
        return
    _run_alone_lock.acquire(exclusive=request.node.get_closest_marker("alone") is not None)
    try:
        yield
    finally:
        _run_alone_lock.release()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdExited(RuntimeError):
    """etcd ended before it served; ``log_tail`` is the end of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


class EtcdServer:
    """A real etcd on 127.0.0.1 with random ports and a temporary data dir."""

    def __init__(self, data_dir, tls_dir=None, client_cert_auth=True):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server; .ci/run does it)")
        self.data_dir = data_dir
        self.tls_dir = tls_dir
        self.client_cert_auth = client_cert_auth
        self.proc = None
        self.log = None
        # A port found free can be taken by a parallel test before etcd binds it: etcd then exits
        # at once, and a fresh pair of ports is the cure.
        for attempt in range(3):
            self._choose_ports()
            try:
                self.start()
                return
            except EtcdExited as exc:
                if attempt == 2 or "address already in use" not in exc.log_tail:
                    raise

    def _choose_ports(self) -> None:
        if self.log is not None:
            self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)  # a failed start may have recorded its old peer URL
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log = open(self.data_dir.parent / f"etcd-{self.client_port}.log", "w")
        scheme = "https" if self.tls_dir else "http"
        self.args = [
            self.binary,
            "--name",
            "test",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            f"{scheme}://127.0.0.1:{self.client_port}",
            "--advertise-client-urls",
            f"{scheme}://127.0.0.1:{self.client_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{self.peer_port}",
        ]
        if self.tls_dir:
            self.args += [
                "--cert-file",
                str(self.tls_dir / "server.pem"),
                "--key-file",
                str(self.tls_dir / "server.key"),
            ]
            if self.client_cert_auth:  # a trusted CA file alone already makes etcd demand client certificates
                self.args += ["--client-cert-auth", "--trusted-ca-file", str(self.tls_dir / "ca.pem")]

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                log_tail = open(self.log.name).read()[-1500:]
                raise EtcdExited(
                    f"etcd exited with {self.proc.returncode}; {self.log.name} ends:\n{log_tail}", log_tail
                )
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    pass
                import pyetcd

                tls = {}
                if self.tls_dir:
                    tls = {
                        "ca_cert": str(self.tls_dir / "ca.pem"),
                        "cert_cert": str(self.tls_dir / "client.pem"),
                        "cert_key": str(self.tls_dir / "client.key"),
                    }
                    if not self.client_cert_auth:
                        tls = {"ca_cert": tls["ca_cert"]}
                c = pyetcd.client(host="127.0.0.1", port=self.client_port, timeout=1, **tls)
                c.status()
                c.close()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        raise RuntimeError(f"etcd did not come up within {timeout_s} s on {self.endpoint}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def run_script_json(script: str, *args: str, timeout: float = 300) -> dict:
    """Run ``scripts/<script>`` with ``args`` to completion; its last stdout line, a JSON object
    (every benchmark and probe ends with one). A non-zero exit fails with the script's output."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cli(*args: str, timeout: float = 120):
    """``python -m etc_agent.cli.main ARGS`` (the ``etc-agent`` command) to completion, output as text."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def etcd_rdzv(etcd_server, name: str) -> list[str]:
    """etcrun's rendezvous flags for a new job called ``name-<random>`` on the test's etcd."""
    run_id = f"{name}-{uuid.uuid4().hex[:6]}"
    return ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    server.stop()
    server.log.close()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed for the TLS tests (apt-get install openssl; .ci/run does it)")
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            "san.cnf",
            cwd=d,
        )
    return d


def make_assignment(**fields):
    """An :class:`~etc_agent.protocol.control.Assignment` of one process, for tests: a member of a
    one-rank generation unless ``fields`` say otherwise."""
    from etc_agent.protocol.control import Assignment

    defaults = dict(
        generation=1,
        pg_rank=0,
        pg_world_size=1,
        rank=0,
        world_size=1,
        parallel="tp=1,pp=1,dp=1,zero=0",
        store_addr="127.0.0.1",
        store_port=1,
        devices=["n0:0"],
        leaving=False,
        started=True,
        trained=True,
        published_at=0.0,
        node_id="n0",
    )
    return Assignment(**{**defaults, **fields})
