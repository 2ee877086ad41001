"""A running job's membership store, for the ``etc-agent`` commands that read or write it
(``status``, ``reconfigure``): their shared options and the store they name."""

from __future__ import annotations

from typing import Annotated

import typer

from etc_agent.cli._entry import UserError
from etc_agent.rendezvous.store import MembershipStore

RdzvEndpoint = Annotated[str, typer.Option("--rdzv-endpoint", help="host:port of etcd or of the embedded store.")]
RdzvId = Annotated[str, typer.Option("--rdzv-id", help="Job id.")]
RdzvBackend = Annotated[str, typer.Option("--rdzv-backend", help="etcd-v3 or embedded.")]
EtcdCaCert = Annotated[str | None, typer.Option("--etcd-ca-cert")]
EtcdCert = Annotated[str | None, typer.Option("--etcd-cert")]
EtcdKey = Annotated[str | None, typer.Option("--etcd-key")]
EtcdUser = Annotated[str | None, typer.Option("--etcd-user")]
EtcdPassword = Annotated[str | None, typer.Option("--etcd-password", envvar="ETC_AGENT_ETCD_PASSWORD")]


def open_job_store(
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_id: str,
    ca_cert: str | None,
    cert: str | None,
    key: str | None,
    user: str | None,
    password: str | None,
) -> MembershipStore:
    from etc_agent.rendezvous.embedded import EmbeddedStore
    from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore

    backend = rdzv_backend.lower()
    if backend in ("etcd", "etcd-v2", "etcd-v3"):
        return EtcdStore(
            EtcdOptions(
                endpoint=rdzv_endpoint, ca_cert=ca_cert, cert_key=key, cert_cert=cert, user=user, password=password
            ),
            rdzv_id,
        )
    if backend in ("embedded", "c10d", "static"):
        return EmbeddedStore(rdzv_endpoint, rdzv_id)
    raise UserError(f"--rdzv-backend {rdzv_backend!r}: use etcd-v3 or embedded")
