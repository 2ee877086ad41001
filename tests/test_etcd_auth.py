"""etcd with authentication enabled: user/password reach it, a wrong password is a clear error."""

from __future__ import annotations

import pytest
from conftest import EtcdServer

from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError


@pytest.fixture(scope="module")
def auth_etcd(tls_dir, tmp_path_factory):
    """TLS to the server (gRPC sends credentials only over TLS) and user/password authentication,
    set up through etcd's v3 Auth API (users root and trainer, role jobs on /etc-agent/)."""
    import pyetcd
    from pyetcd import etcdrpc as rpc

    server = EtcdServer(tmp_path_factory.mktemp("auth") / "data", tls_dir=tls_dir, client_cert_auth=False)
    admin = pyetcd.client(host="127.0.0.1", port=server.client_port, ca_cert=str(tls_dir / "ca.pem"), timeout=5)
    auth = admin.authstub
    auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="rootpw"), 5)
    auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), 5)
    auth.UserAdd(rpc.AuthUserAddRequest(name="trainer", password="s3cret"), 5)
    auth.RoleAdd(rpc.AuthRoleAddRequest(name="jobs"), 5)
    perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=b"/etc-agent/", range_end=b"/etc-agent0")
    auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="jobs", perm=perm), 5)
    auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="trainer", role="jobs"), 5)
    auth.AuthEnable(rpc.AuthEnableRequest(), 5)
    admin.close()
    yield server
    server.stop()
    server.log.close()


def test_user_password_and_wrong_password(auth_etcd):
    ca = str(auth_etcd.tls_dir / "ca.pem")
    with EtcdStore(
        EtcdOptions(endpoint=auth_etcd.endpoint, ca_cert=ca, user="trainer", password="s3cret"), "auth-run"
    ) as store:
        assert store.create("generation", "1")
        assert store.get("generation").value == "1"
        lease = store.grant_lease(2)
        store.put("nodes/a", "{}", lease=lease)
    with pytest.raises(StoreError, match="authentication failed|invalid"):
        EtcdStore(
            EtcdOptions(endpoint=auth_etcd.endpoint, ca_cert=ca, user="trainer", password="wrong", timeout_s=2),
            "auth-run",
        )
    with pytest.raises(ValueError, match="go together"):
        EtcdStore(EtcdOptions(endpoint=auth_etcd.endpoint, ca_cert=ca, user="trainer"), "auth-run")
    with pytest.raises(ValueError, match="need TLS"):
        EtcdStore(EtcdOptions(endpoint=auth_etcd.endpoint, user="trainer", password="s3cret"), "auth-run")
