"""How this node finds the others: the ``--rdzv-*``, ``--master-*``, ``--etcd-*`` and
``--standalone`` flags resolved (:class:`Rendezvous`), and the membership store they name opened
(etcd, or the embedded store, hosted here when this agent is its host; torchrun's static
rendezvous through node 0's TCPStore).
"""

from __future__ import annotations

import errno
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from etc_agent.cli.etcrun_flags import EtcrunFlags, parse_rdzv_conf
from etc_agent.cli.options import build_model
from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer, host_secret
from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import MembershipStore, StoreError
from etc_agent.utils.jsonline import parse_address

if TYPE_CHECKING:
    from torch.distributed import TCPStore

ETCD_BACKENDS = {"etcd", "etcd-v2", "etcd-v3"}
EMBEDDED_BACKENDS = {"embedded", "c10d", "static"}
STATIC_ENDPOINT_KEY = "etc_agent/membership_store"
"""Key in the static rendezvous' TCPStore that names the embedded membership store's address."""
ETCD_OPTION_FLAGS = {
    "endpoint": "--rdzv-endpoint",
    "ca_cert": "--etcd-ca-cert",
    "cert_key": "--etcd-key",
    "cert_cert": "--etcd-cert",
    "user": "--etcd-user",
    "password": "--etcd-password",
    "timeout_s": "--rdzv-conf read_timeout",
}
"""EtcdOptions field -> the flag that sets it, for the one line that rejects its value."""


@dataclass
class Rendezvous:
    """How this node finds the others: the --rdzv-*, --master-*, --etcd-* and --standalone flags, resolved."""

    backend: str
    endpoint: str
    run_id: str
    conf: dict[str, str]
    host_store: bool | None = None
    etcd: EtcdOptions | None = None

    @property
    def first_host(self) -> str | None:
        """The host of the (first) endpoint: the agent advertises the address its route there takes."""
        first = self.endpoint.split(",")[0].strip()
        if "://" in first:
            first = first.split("://", 1)[1]
        host = first.rpartition(":")[0] if ":" in first else first
        return host.strip("[]") or None

    @property
    def secret_file(self) -> str | None:
        """``--rdzv-conf secret_file``: the job's secret for the embedded store (docs/security.md)."""
        return self.conf.get("secret_file")


def resolve_rendezvous(f: EtcrunFlags) -> Rendezvous:
    backend = f.rdzv_backend.strip().lower()
    if backend not in ETCD_BACKENDS | EMBEDDED_BACKENDS:
        raise ValueError(f"--rdzv-backend {f.rdzv_backend!r}: use etcd-v3 or embedded (c10d, static)")
    rdzv = Rendezvous(backend, f.rdzv_endpoint, f.rdzv_id, parse_rdzv_conf(f.rdzv_conf))
    if f.standalone:
        rdzv.backend, rdzv.run_id, rdzv.host_store = "embedded", f"standalone-{uuid.uuid4().hex[:8]}", True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rdzv.endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    elif backend == "static":
        rdzv.endpoint, rdzv.host_store = f"{f.master_addr}:{f.master_port}", f.node_rank == 0
    elif not rdzv.endpoint:
        raise ValueError(f"--rdzv-endpoint is required with --rdzv-backend {f.rdzv_backend}")
    if "is_host" in rdzv.conf:
        rdzv.host_store = rdzv.conf["is_host"].lower() in ("1", "true", "yes")
    if rdzv.backend in ETCD_BACKENDS:
        rdzv.etcd = build_model(
            EtcdOptions,
            dict(
                endpoint=rdzv.endpoint,
                ca_cert=f.etcd_ca_cert,
                cert_key=f.etcd_key,
                cert_cert=f.etcd_cert,
                user=f.etcd_user,
                password=f.etcd_password,
                timeout_s=rdzv.conf.get("read_timeout", 5),
            ),
            names=ETCD_OPTION_FLAGS,
        )
    return rdzv


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    try:
        names = {socket.gethostname(), socket.getfqdn()}
        addrs = {info[4][0] for name in names for info in socket.getaddrinfo(name, None)}
        return host in names or host in addrs or socket.gethostbyname(host) in addrs
    except OSError:
        return False


def open_stores(
    rdzv: Rendezvous, f: EtcrunFlags, wait_s: float
) -> tuple[MembershipStore, EmbeddedStoreServer | None, TCPStore | None]:
    """``(membership store, its server when this agent hosts it, the workers' TCPStore of the static
    rendezvous on node 0)``."""
    if rdzv.backend == "static" and "is_host" not in rdzv.conf:
        return open_static_store(
            f.master_addr, f.master_port, f.node_rank, rdzv.run_id, wait_s=wait_s, secret_file=rdzv.secret_file
        )
    store, server = open_store(
        rdzv.backend,
        rdzv.endpoint,
        rdzv.run_id,
        rdzv.host_store,
        rdzv.etcd,
        wait_s=wait_s,
        secret_file=rdzv.secret_file,
    )
    return store, server, None


def open_store(
    backend: str,
    endpoint: str,
    run_id: str,
    host_store: bool | None,
    etcd: EtcdOptions | None,
    wait_s: float,
    secret_file: str | None = None,
) -> tuple[MembershipStore, EmbeddedStoreServer | None]:
    """The membership store for this agent (and, for the embedded backend, the server when we host it)."""
    if backend in ETCD_BACKENDS:
        assert etcd is not None
        return EtcdStore(etcd, run_id), None
    host, _, port = endpoint.rpartition(":")
    parse_address(endpoint)  # a port out of range is the user's mistake, said in one line
    if host_store is None:
        host_store = _is_local(host)
    server = None
    if host_store:
        secret, fresh = host_secret(endpoint, secret_file)
        try:
            bind = host if host not in ("", "localhost") else "127.0.0.1"
            server = EmbeddedStoreServer(bind, int(port), secret=secret)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            server = None  # another local agent hosts it (torchrun's c10d does the same)
        else:
            if fresh:  # a loopback store: its secret goes to this user's private file
                server.publish_local_secret(endpoint, run_id, secret)
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret_file=secret_file), server


def open_static_store(
    master_addr: str, master_port: int, node_rank: int, run_id: str, wait_s: float, secret_file: str | None = None
) -> tuple[MembershipStore, EmbeddedStoreServer | None, TCPStore | None]:
    """torchrun's static rendezvous: node rank 0 hosts a TCPStore on ``--master-addr:--master-port``,
    the store the workers reach at ``MASTER_ADDR:MASTER_PORT`` (``env://`` and ``tcp://`` inits
    alike). The membership store (embedded) listens on a free port beside it, and other nodes read
    its address from that TCPStore: the job needs no port but ``--master-port``.

    Returns ``(membership store, its server or None, the workers' TCPStore on node 0 or None)``.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    if node_rank == 0:
        return _host_static_store(master_addr, master_port, run_id, wait_s, secret_file)
    try:
        bootstrap = TCPStore(
            master_addr, master_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait_s)
        )
        endpoint = bootstrap.get(STATIC_ENDPOINT_KEY).decode()
    except RuntimeError as err:
        raise StoreError(
            f"static rendezvous: node rank 0 did not answer at {master_addr}:{master_port} within {wait_s:.0f} s "
            f"({str(err).splitlines()[0]})"
        ) from None
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret_file=secret_file), None, None


def _host_static_store(
    master_addr: str, master_port: int, run_id: str, wait_s: float, secret_file: str | None
) -> tuple[MembershipStore, EmbeddedStoreServer, TCPStore]:
    """Node rank 0's part of :func:`open_static_store`: the workers' TCPStore and the membership store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        workers_store = TCPStore(
            master_addr, master_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=wait_s)
        )
    except RuntimeError as err:
        raise ValueError(
            f"--master-port {master_port}: cannot listen on it ({str(err).splitlines()[0]}); is another job using it?"
        ) from None
    bind = "127.0.0.1" if master_addr in ("", "localhost") else master_addr
    if not _is_local(bind):
        bind = "0.0.0.0"
    secret, fresh = host_secret(f"{bind}:0", secret_file)
    server = EmbeddedStoreServer(bind, 0, secret=secret)
    endpoint = f"{master_addr}:{server.port}"
    if fresh:
        server.publish_local_secret(endpoint, run_id, secret)
    workers_store.set(STATIC_ENDPOINT_KEY, endpoint)
    store = EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret=secret)
    return store, server, workers_store
