"""etcd over mutual TLS: certificates made with openssl, a real etcd serving https on random ports."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import EtcdServer

from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed for the TLS test (apt-get install openssl; .ci/run does it)")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                 "-days", "1", "-extfile", "san.cnf", cwd=d)
    server = EtcdServer(d / "data", tls_dir=d)
    yield server, d
    server.stop()
    server.log.close()


def test_mutual_tls_works_and_missing_client_cert_is_a_clear_error(tls_etcd):
    server, d = tls_etcd
    options = EtcdOptions(endpoint=server.endpoint, ca_cert=str(d / "ca.pem"), cert_cert=str(d / "client.pem"), cert_key=str(d / "client.key"))
    with EtcdStore(options, "tls-run") as store:
        store.put("nodes/a", "{}")
        assert store.get("nodes/a").value == "{}"
        lease = store.grant_lease(2)
        assert store.create("leader", "x", lease=lease)
    with pytest.raises(StoreError, match="cannot reach etcd"):
        EtcdStore(EtcdOptions(endpoint=server.endpoint, ca_cert=str(d / "ca.pem"), timeout_s=2), "tls-run")
    with pytest.raises(ValueError, match="go together"):
        EtcdStore(EtcdOptions(endpoint=server.endpoint, ca_cert=str(d / "ca.pem"), cert_cert=str(d / "client.pem")), "tls-run")
