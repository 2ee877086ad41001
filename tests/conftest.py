import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
MODELS = ROOT / "configs" / "models"


import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """A real etcd on 127.0.0.1 with random ports and a temporary data dir."""

    def __init__(self, data_dir, tls_dir=None, client_cert_auth=True):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server; .ci/run does it)")
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.data_dir = data_dir
        self.log = open(data_dir.parent / f"etcd-{self.client_port}.log", "w")
        scheme = "https" if tls_dir else "http"
        self.tls_dir = tls_dir
        self.args = [
            binary, "--name", "test", "--data-dir", str(data_dir),
            "--listen-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
        ]
        if tls_dir:
            self.args += ["--cert-file", str(tls_dir / "server.pem"), "--key-file", str(tls_dir / "server.key")]
            if client_cert_auth:  # a trusted CA file alone already makes etcd demand client certificates
                self.args += ["--client-cert-auth", "--trusted-ca-file", str(tls_dir / "ca.pem")]
        self.proc = None
        self.client_cert_auth = client_cert_auth
        self.start()

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    pass
                import pyetcd

                tls = {}
                if self.tls_dir:
                    tls = {"ca_cert": str(self.tls_dir / "ca.pem"), "cert_cert": str(self.tls_dir / "client.pem"),
                           "cert_key": str(self.tls_dir / "client.key")}
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
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                 "-days", "1", "-extfile", "san.cnf", cwd=d)
    return d
