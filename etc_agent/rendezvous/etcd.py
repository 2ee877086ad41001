"""etcd v3 backend (gRPC through ``pyetcd``; no use of the v2 API that etcd 3.6 removed)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from etc_agent.rendezvous.store import (
    KeyValue,
    Lease,
    LeaseExpired,
    MembershipStore,
    StoreError,
    WatchEvent,
    WatchHandle,
)

log = logging.getLogger("etc_agent.rendezvous.etcd")

ENDPOINT_RETRY_S = 1.0
"""Seconds before a member that failed a request is tried again."""


class EtcdOptions(BaseModel):
    """How to reach etcd."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str = Field(
        description="host:port of the etcd members' client URLs, comma-separated as etcdctl takes them "
        "(http or https scheme prefix allowed); requests fail over between them."
    )
    ca_cert: str | None = Field(None, description="CA bundle to verify the server (enables TLS).")
    cert_key: str | None = Field(None, description="Client private key for mutual TLS.")
    cert_cert: str | None = Field(None, description="Client certificate for mutual TLS.")
    user: str | None = Field(None, description="etcd user (authentication enabled on the server).")
    password: str | None = Field(None, description="Password of ``user``.")
    timeout_s: float = Field(5.0, gt=0, description="Per-request deadline.")

    @field_validator("endpoint")
    @classmethod
    def _endpoints_parse(cls, value: str) -> str:
        _parse_endpoints(value)
        return value

    def host_ports(self) -> list[tuple[str, int]]:
        """Every member's ``(host, port)``, in the order given."""
        return _parse_endpoints(self.endpoint)


def _parse_endpoints(text: str) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for item in text.split(","):
        address = item.strip().split("://", 1)[-1].rstrip("/")
        host, sep, port = address.rpartition(":")
        host = host.strip("[]")
        # isascii: str.isdigit also takes digits that int() refuses (superscripts).
        if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535 or not host:
            raise ValueError(f"bad etcd endpoint {item.strip()!r} in {text!r}: expected host:port[,host:port...]")
        if (host, int(port)) in found:
            raise ValueError(f"etcd endpoint {host}:{port} is given twice in {text!r}")
        found.append((host, int(port)))
    return found


def _connect(options: EtcdOptions):
    import pyetcd

    for path in (options.ca_cert, options.cert_key, options.cert_cert):
        if path is not None:
            import os

            if not os.path.isfile(path):
                raise ValueError(f"TLS file {path!r} not found")
    if (options.cert_key is None) != (options.cert_cert is None):
        raise ValueError("--etcd-cert and --etcd-key go together")
    if (options.user is None) != (options.password is None):
        raise ValueError("--etcd-user and --etcd-password go together")
    if options.user is not None and options.ca_cert is None:
        raise ValueError("etcd user/password need TLS (--etcd-ca-cert): gRPC sends credentials only over TLS")
    credentials = None
    if options.ca_cert is not None:
        credentials = pyetcd.Etcd3Client.get_secure_creds(options.ca_cert, options.cert_key, options.cert_cert)
    # A failed request marks its member failed and the next request goes to another (failover); the
    # client would refuse a failed member for 300 s, but gRPC reconnects by itself, so it is tried
    # again after a second (an etcd restart, or a partition that heals, must not cost five minutes).
    endpoints = [
        pyetcd.Endpoint(
            f"[{host}]" if ":" in host else host,
            port,
            secure=credentials is not None,
            creds=credentials,
            time_retry=ENDPOINT_RETRY_S,
        )
        for host, port in options.host_ports()
    ]
    client = pyetcd.MultiEndpointEtcd3Client(
        endpoints=endpoints,
        timeout=options.timeout_s,
        user=options.user,
        password=options.password,
        failover=True,
    )
    # pyetcd starts on a random member; the first one given, as etcdctl does, makes a job's agents
    # share a member and fail over in the order the user wrote.
    client._current_endpoint_label = endpoints[0].netloc
    return client


class _Reconnect:
    """A fresh connection to an etcd member whose requests time out or find it unreachable.

    A partition leaves the channel's TCP connection dead but open: the kernel retransmits on it with
    a backoff that reaches seconds, and gRPC reconnects a failed channel with its own backoff, so a
    member can answer again seconds before the client notices. After such a failure the member's
    channel is replaced (at most once per ``ENDPOINT_RETRY_S``): the next request connects anew and
    goes through as soon as the network does. Leases and watches go through the client's stubs,
    which pyetcd rebuilds on the new channel."""

    def __init__(self, client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._renewed_at: dict[str, float] = {}

    def after(self, endpoint, err: BaseException) -> None:
        """``endpoint`` (the one the failed request used) failed with ``err``."""
        import pyetcd.exceptions as errors

        if not isinstance(err, (errors.ConnectionTimeoutError, errors.ConnectionFailedError)):
            return
        with self._lock:
            now = time.monotonic()
            if now - self._renewed_at.get(endpoint.netloc, float("-inf")) < ENDPOINT_RETRY_S:
                return
            self._renewed_at[endpoint.netloc] = now
            old = endpoint.channel
            endpoint.channel = endpoint._mkchannel(None)  # pyetcd's own constructor of a member's channel
            self.client._clear_old_stubs()
        old.close()


class _EtcdLease(Lease):
    def __init__(self, lease, ttl: float, reconnect: _Reconnect):
        self._lease = lease
        self.id = lease.id
        self.ttl = ttl
        self._reconnect = reconnect

    def refresh(self) -> None:
        endpoint = self._reconnect.client.endpoint_in_use
        try:
            responses = self._lease.refresh()
        except Exception as err:
            self._reconnect.after(endpoint, err)
            raise StoreError(f"etcd lease refresh failed: {err}") from err
        if not responses or responses[0].TTL <= 0:
            raise LeaseExpired(f"etcd lease {self.id:x} expired")

    def revoke(self) -> None:
        try:
            self._lease.revoke()
        except Exception as err:
            raise StoreError(f"etcd lease revoke failed: {err}") from err


class _EtcdWatch(WatchHandle):
    def __init__(self, client, watch_id):
        self.client, self.watch_id = client, watch_id

    def cancel(self) -> None:
        try:
            self.client.cancel_watch(self.watch_id)
        except Exception:  # noqa: BLE001 - the connection may already be gone
            pass


class EtcdStore(MembershipStore):
    """Membership store on etcd v3: keys under ``/etc-agent/<run_id>/``."""

    def __init__(self, options: EtcdOptions, run_id: str):
        super().__init__(run_id)
        self.options = options
        try:
            self.client = _connect(options)
        except ValueError:
            raise
        except Exception as err:
            raise StoreError(f"cannot reach etcd at {options.endpoint}: {_short(err)}") from err
        try:
            self.client.status()
        except Exception as err:
            raise StoreError(f"cannot reach etcd at {options.endpoint}: {_short(err)}") from err
        self._reconnect = _Reconnect(self.client)

    def _call(self, what: str, fn, *args, **kwargs):
        endpoint = self.client.endpoint_in_use
        try:
            return fn(*args, **kwargs)
        except StoreError:
            raise
        except Exception as err:
            self._reconnect.after(endpoint, err)
            if "auth token" in _short(err).lower() and self.options.user is not None:
                # A restarted etcd forgot the simple token: authenticate again, the caller retries.
                try:
                    self.client = _connect(self.options)
                    self._reconnect = _Reconnect(self.client)
                except Exception:  # noqa: BLE001
                    pass
            raise StoreError(f"etcd {what} failed ({self.options.endpoint}): {_short(err)}") from err

    def _kv(self, value: bytes, meta) -> KeyValue:
        return KeyValue(
            self.relative_key(meta.key.decode()),
            value.decode(),
            int(meta.version),
            int(meta.mod_revision),
            int(getattr(meta, "lease_id", 0) or getattr(meta, "lease", 0) or 0),
        )

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call("get", self.client.get, self.full_key(key))
        return None if value is None else self._kv(value, meta)

    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        items = self._call("get_prefix", lambda: list(self.client.get_prefix(self.full_key(prefix))))
        return sorted((self._kv(v, m) for v, m in items), key=lambda kv: kv.key)

    def put(self, key: str, value: str, lease: Lease | None = None) -> None:
        self._call("put", self.client.put, self.full_key(key), value, lease=lease.id if lease else None)

    def compare_and_set(self, key: str, value: str, expected_version: int, lease: Lease | None = None) -> bool:
        full = self.full_key(key)
        tx = self.client.transactions
        ok, _ = self._call(
            "transaction",
            self.client.transaction,
            compare=[tx.version(full) == expected_version],
            success=[tx.put(full, value, lease=lease.id if lease else None)],
            failure=[],
        )
        return bool(ok)

    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        tx = self.client.transactions
        ok, _ = self._call(
            "transaction",
            self.client.transaction,
            compare=[tx.mod(self.full_key(guard_key)) == guard_revision],
            success=[tx.put(self.full_key(key), value)],
            failure=[],
        )
        return bool(ok)

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", self.client.delete, self.full_key(key)))

    def grant_lease(self, ttl: float) -> Lease:
        # etcd leases are whole seconds (and at least the server's minimum, usually 2 s).
        lease = self._call("lease grant", self.client.lease, max(1, math.ceil(ttl)))
        return _EtcdLease(lease, float(lease.ttl), self._reconnect)

    def watch_prefix(self, prefix, callback: Callable[[WatchEvent], None], on_error=None) -> WatchHandle:
        import pyetcd.events as events

        def on_response(response) -> None:
            if isinstance(response, Exception):
                log.warning("etcd watch on %s failed: %s", self.full_key(prefix), _short(response))
                if on_error is not None:
                    on_error(response)
                return
            for event in response.events:
                full = event.key.decode()
                if not full.startswith(self.prefix):
                    continue
                if isinstance(event, events.PutEvent):
                    callback(WatchEvent("put", self.relative_key(full), event.value.decode(), int(event.mod_revision)))
                else:
                    callback(WatchEvent("delete", self.relative_key(full), None, int(response.header.revision)))

        watch_id = self._call("watch", self.client.add_watch_prefix_callback, self.full_key(prefix), on_response)
        return _EtcdWatch(self.client, watch_id)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


def _short(err: BaseException) -> str:
    details = getattr(err, "details", None)
    if callable(details):
        try:
            text = details()
            if text:
                return text
        except Exception:  # noqa: BLE001
            pass
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
