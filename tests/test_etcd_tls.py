"""etcd over mutual TLS: certificates made with openssl, a real etcd serving https on random ports."""

from __future__ import annotations

import pytest
from conftest import EtcdServer

from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError


@pytest.fixture(scope="module")
def tls_etcd(tls_dir, tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("tls-etcd") / "data", tls_dir=tls_dir)
    yield server, tls_dir
    server.stop()
    server.log.close()


def test_mutual_tls_works_and_missing_client_cert_is_a_clear_error(tls_etcd):
    server, d = tls_etcd
    options = EtcdOptions(
        endpoint=server.endpoint,
        ca_cert=str(d / "ca.pem"),
        cert_cert=str(d / "client.pem"),
        cert_key=str(d / "client.key"),
    )
    with EtcdStore(options, "tls-run") as store:
        store.put("nodes/a", "{}")
        assert store.get("nodes/a").value == "{}"
        lease = store.grant_lease(2)
        assert store.create("leader", "x", lease=lease)
    with pytest.raises(StoreError, match="cannot reach etcd"):
        EtcdStore(EtcdOptions(endpoint=server.endpoint, ca_cert=str(d / "ca.pem"), timeout_s=2), "tls-run")
    with pytest.raises(ValueError, match="go together"):
        EtcdStore(
            EtcdOptions(endpoint=server.endpoint, ca_cert=str(d / "ca.pem"), cert_cert=str(d / "client.pem")), "tls-run"
        )
