"""Embedded membership store: no etcd needed.

One agent (node rank 0, or the one whose host matches the endpoint) runs :class:`EmbeddedStoreServer`
in a thread; every agent, the host included, talks to it with :class:`EmbeddedStore` over TCP with
one JSON line per request and per reply. Semantics follow etcd's: per-key versions and a global
revision, compare-and-set, leases whose keys vanish when no heartbeat (``lease_refresh``) arrived
within the TTL, and prefix watches (long polls on an event log).
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from etc_agent.rendezvous.store import (
    KeyValue,
    Lease,
    LeaseExpired,
    MembershipStore,
    StoreError,
    WatchEvent,
    WatchHandle,
)
from etc_agent.utils import auth
from etc_agent.utils.auth import Key
from etc_agent.utils.jsonline import (
    JsonLineError,
    JsonLineServer,
    ServerLimits,
    Unauthenticated,
    parse_address,
    request,
)

log = logging.getLogger("etc_agent.rendezvous.embedded")
REAP_INTERVAL_S = 0.1


@dataclass(frozen=True)
class StoreLimits:
    """Quotas of the embedded store (etcd has its own: ``--quota-backend-bytes``, 1.5 MiB requests)."""

    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 20
    """A generation record of a few thousand devices is ~1 MB; etcd's default request limit is 1.5 MiB."""
    max_keys: int = 100_000
    max_total_bytes: int = 64 << 20
    """Keys and values together; a put beyond it is refused (etcd: ``mvcc: database space exceeded``)."""
    max_leases: int = 10_000
    max_event_log: int = 10_000
    """Watch events kept for long polls; a watcher further behind re-reads the prefix."""
    max_event_log_bytes: int = 16 << 20
    """The event log is bounded by bytes too: deleted values do not stay in memory through it."""


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Get(_Op):
    op: Literal["get"]
    key: str


class _GetPrefix(_Op):
    op: Literal["get_prefix"]
    prefix: str


class _Put(_Op):
    op: Literal["put"]
    key: str
    value: str
    lease: int | None = None


class _Cas(_Op):
    op: Literal["cas"]
    key: str
    value: str
    expected: int = Field(ge=0, description="The key's version the caller saw (0: absent).")
    lease: int | None = None


class _Delete(_Op):
    op: Literal["delete"]
    key: str


class _LeaseGrant(_Op):
    op: Literal["lease_grant"]
    ttl: float = Field(gt=0, le=3600)


class _LeaseRefresh(_Op):
    op: Literal["lease_refresh"]
    lease: int


class _LeaseRevoke(_Op):
    op: Literal["lease_revoke"]
    lease: int


class _Wait(_Op):
    op: Literal["wait"]
    prefix: str
    after: int = Field(ge=0)
    timeout: float = Field(ge=0, le=60)


class _Ping(_Op):
    op: Literal["ping"]


STORE_REQUEST: TypeAdapter = TypeAdapter(
    Annotated[
        _Get | _GetPrefix | _Put | _Cas | _Delete | _LeaseGrant | _LeaseRefresh | _LeaseRevoke | _Wait | _Ping,
        Field(discriminator="op"),
    ]
)
"""Every request the store server accepts (validated before it is handled)."""


class _State:
    """The data of the store; every method runs under ``self.cond``."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.cond = threading.Condition()
        self.data: dict[str, dict[str, Any]] = {}
        self.data_bytes = 0
        self.revision = 0
        self.leases: dict[int, dict[str, Any]] = {}
        self.lease_ids = itertools.count(1)
        self.events: collections.deque[tuple[int, str, str, str | None]] = collections.deque()
        self.event_bytes = 0

    def _record(self, kind: str, key: str, value: str | None) -> int:
        self.revision += 1
        self.events.append((self.revision, kind, key, value))
        self.event_bytes += len(key) + len(value or "")
        while len(self.events) > self.limits.max_event_log or (
            self.event_bytes > self.limits.max_event_log_bytes and len(self.events) > 1
        ):
            _, _, old_key, old_value = self.events.popleft()
            self.event_bytes -= len(old_key) + len(old_value or "")
        self.cond.notify_all()
        return self.revision

    def _check_quota(self, key: str, value: str, old: dict[str, Any] | None) -> None:
        limits = self.limits
        if len(key) > limits.max_key_bytes:
            raise ValueError(f"key longer than {limits.max_key_bytes} bytes")
        if len(value) > limits.max_value_bytes:
            raise ValueError(f"value of {len(value)} bytes: the limit is {limits.max_value_bytes}")
        if old is None and len(self.data) >= limits.max_keys:
            raise ValueError(f"the store holds {limits.max_keys} keys already")
        grows = len(key) + len(value) - (len(key) + len(old["value"]) if old else 0)
        if self.data_bytes + grows > limits.max_total_bytes:
            raise ValueError(f"the store would exceed {limits.max_total_bytes} bytes of keys and values")

    def _put(self, key: str, value: str, lease: int | None) -> None:
        if lease is not None and lease not in self.leases:
            raise KeyError(f"lease {lease} not found")
        old = self.data.get(key)
        self._check_quota(key, value, old)
        self.data_bytes += len(key) + len(value) - (len(key) + len(old["value"]) if old else 0)
        if old and old["lease"] is not None and old["lease"] in self.leases:
            self.leases[old["lease"]]["keys"].discard(key)
        revision = self._record("put", key, value)
        self.data[key] = {
            "value": value,
            "version": (old["version"] + 1) if old else 1,
            "mod": revision,
            "lease": lease,
        }
        if lease is not None:
            self.leases[lease]["keys"].add(key)

    def _delete(self, key: str) -> bool:
        item = self.data.pop(key, None)
        if item is None:
            return False
        self.data_bytes -= len(key) + len(item["value"])
        if item["lease"] is not None and item["lease"] in self.leases:
            self.leases[item["lease"]]["keys"].discard(key)
        self._record("delete", key, None)
        return True

    def handle(self, req: _Op) -> dict[str, Any]:
        with self.cond:
            if isinstance(req, _Get):
                item = self.data.get(req.key)
                if item is None:
                    return {"kv": None}
                return {"kv": [req.key, item["value"], item["version"], item["mod"], item["lease"] or 0]}
            if isinstance(req, _GetPrefix):
                return {
                    "kvs": [
                        [k, v["value"], v["version"], v["mod"], v["lease"] or 0]
                        for k, v in sorted(self.data.items())
                        if k.startswith(req.prefix)
                    ]
                }
            if isinstance(req, _Put):
                self._put(req.key, req.value, req.lease)
                return {}
            if isinstance(req, _Cas):
                item = self.data.get(req.key)
                if (item["version"] if item else 0) != req.expected:
                    return {"ok": False}
                self._put(req.key, req.value, req.lease)
                return {"ok": True}
            if isinstance(req, _Delete):
                return {"ok": self._delete(req.key)}
            if isinstance(req, _LeaseGrant):
                if len(self.leases) >= self.limits.max_leases:
                    raise ValueError(f"the store holds {self.limits.max_leases} leases already")
                lease = next(self.lease_ids)
                self.leases[lease] = {"ttl": req.ttl, "deadline": time.monotonic() + req.ttl, "keys": set()}
                return {"lease": lease}
            if isinstance(req, _LeaseRefresh):
                item = self.leases.get(req.lease)
                if item is None:
                    return {"expired": True}
                item["deadline"] = time.monotonic() + item["ttl"]
                return {"expired": False}
            if isinstance(req, _LeaseRevoke):
                item = self.leases.pop(req.lease, None)
                for key in sorted(item["keys"]) if item else []:
                    self._delete(key)
                return {}
            if isinstance(req, _Wait):
                return self._wait(req.prefix, req.after, req.timeout)
            assert isinstance(req, _Ping), req
            return {"revision": self.revision}

    def _wait(self, prefix: str, after: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            oldest = self.events[0][0] if self.events else self.revision + 1
            if after + 1 < oldest and after < self.revision:
                return {"compacted": True, "revision": self.revision}
            found = [list(e) for e in self.events if e[0] > after and e[2].startswith(prefix)]
            if found or time.monotonic() >= deadline:
                return {"events": found, "revision": self.revision}
            self.cond.wait(timeout=max(0.0, deadline - time.monotonic()))

    def reap(self) -> None:
        with self.cond:
            now = time.monotonic()
            for lease, item in list(self.leases.items()):
                if item["deadline"] <= now:
                    del self.leases[lease]
                    for key in sorted(item["keys"]):
                        self._delete(key)


class EmbeddedStoreServer:
    """The store process-side: serve on ``host:port`` (port 0 picks a free one) until :meth:`stop`,
    answering only requests signed with ``secret`` (the job's secret, see :func:`store_secret`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes,
        limits: ServerLimits | None = None,
        store_limits: StoreLimits | None = None,
    ):
        self.state = _State(store_limits or StoreLimits())
        key = Key(auth.STORE_KEY_ID, secret)
        self.server = JsonLineServer(
            lambda req, _key_id: self.state.handle(req),
            host,
            port,
            name="etc-store",
            schema=STORE_REQUEST,
            keys=lambda key_id: key if key_id == key.id else None,
            limits=limits or ServerLimits(),
        )
        self.host, self.port = self.server.host, self.server.port
        self._stop = threading.Event()
        self._local_secret: tuple[str, str] | None = None
        self._reaper_thread = threading.Thread(target=self._reaper, name="etc-store-reaper", daemon=True)
        self._reaper_thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _reaper(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            self.state.reap()

    def publish_local_secret(self, endpoint: str, run_id: str, secret: bytes) -> None:
        """Write the secret for this user's other processes; removed again by :meth:`stop`."""
        auth.write_local_secret(endpoint, run_id, secret)
        self._local_secret = (endpoint, run_id)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
        if self._local_secret is not None:
            auth.remove_local_secret(*self._local_secret)


class _EmbeddedLease(Lease):
    def __init__(self, store: EmbeddedStore, lease_id: int, ttl: float):
        self.store, self.id, self.ttl = store, lease_id, ttl

    def refresh(self) -> None:
        if self.store._request({"op": "lease_refresh", "lease": self.id})["expired"]:
            raise LeaseExpired(f"lease {self.id} expired")

    def revoke(self) -> None:
        self.store._request({"op": "lease_revoke", "lease": self.id})


class _EmbeddedWatch(WatchHandle):
    def __init__(self, store: EmbeddedStore, prefix: str, callback, on_error):
        self.store, self.prefix, self.callback, self.on_error = store, prefix, callback, on_error
        self._stop = threading.Event()
        self.after = store._request({"op": "ping"})["revision"]
        self.thread = threading.Thread(target=self._loop, name=f"etc-watch-{prefix}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self.store._request(
                    {"op": "wait", "prefix": self.prefix, "after": self.after, "timeout": 1.0}, timeout=5.0
                )
            except StoreError as err:
                if self._stop.is_set():
                    return
                if self.on_error:
                    self.on_error(err)
                self._stop.wait(0.5)
                continue
            if reply.get("compacted"):
                if self.on_error:
                    self.on_error(StoreError("watch fell behind the event log; re-read the prefix"))
                self.after = reply["revision"]
                continue
            for revision, kind, key, value in reply["events"]:
                self.after = max(self.after, revision)
                if self._stop.is_set():
                    return
                self.callback(WatchEvent(kind, self.store.relative_key(key), value, revision))

    def cancel(self) -> None:
        self._stop.set()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _require_loopback(endpoint: str) -> None:
    host = endpoint.rpartition(":")[0].strip("[]")
    if not is_loopback(host):
        raise auth.AuthError(
            f"the embedded store at {endpoint} is reachable from the network: give every node the job's secret "
            f"({auth.SECRET_ENV}=..., {auth.SECRET_FILE_ENV}=PATH or --rdzv-conf secret_file=PATH), "
            f"at least {auth.MIN_SECRET_BYTES} characters"
        )


def store_secret(endpoint: str, run_id: str, secret_file: str | None = None) -> bytes | None:
    """The job's secret for the embedded store at ``endpoint``: the one the user gave, else (a store on
    loopback only) the one in this user's private file, which the agent hosting the store writes
    (:func:`host_secret`); None while that file is not there yet.

    A store reachable from the network needs a secret the user gave on every node: without one the
    job is refused (:class:`~etc_agent.utils.auth.AuthError`, one line).
    """
    configured = auth.configured_secret(secret_file)
    if configured is not None:
        return configured
    _require_loopback(endpoint)
    return auth.read_local_secret(endpoint, run_id)


def host_secret(endpoint: str, secret_file: str | None = None) -> tuple[bytes, bool]:
    """The secret the agent hosting the store at ``endpoint`` serves with, and whether it is a fresh
    one (a loopback store without a configured secret) that :func:`auth.write_local_secret` must
    publish once the server listens."""
    configured = auth.configured_secret(secret_file)
    if configured is not None:
        return configured, False
    _require_loopback(endpoint)
    return auth.new_secret().hex().encode(), True


class EmbeddedStore(MembershipStore):
    """Client of an :class:`EmbeddedStoreServer` at ``endpoint`` (``host:port``).

    ``secret``: the job's secret; None reads the loopback store's private file (:func:`store_secret`),
    again on every connect attempt until the hosting agent has written it.
    """

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 0.0,
        secret: bytes | None = None,
        secret_file: str | None = None,
    ):
        super().__init__(run_id)
        self.address = parse_address(endpoint)
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._watches: list[_EmbeddedWatch] = []
        self._key: Key | None = Key(auth.STORE_KEY_ID, secret) if secret else None
        deadline = time.monotonic() + connect_timeout_s
        while True:
            if self._key is None:
                found = store_secret(endpoint, run_id, secret_file)
                self._key = Key(auth.STORE_KEY_ID, found) if found else None
            try:
                if self._key is None:
                    self._probe()
                    raise StoreError(
                        f"embedded store at {endpoint}: no secret for it here (the agent hosting a loopback "
                        f"store writes {auth.local_secret_path(endpoint, run_id)}; else set {auth.SECRET_ENV})"
                    )
                self._request({"op": "ping"})
                break
            except StoreError as err:
                if isinstance(err.__cause__, Unauthenticated) and secret is None:
                    self._key = None  # a stale file of an earlier run: read it again
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _probe(self) -> None:
        """A store that is not there is said as such, before any word about its secret."""
        try:
            socket.create_connection(self.address, timeout=self.timeout_s).close()
        except OSError as err:
            raise StoreError(f"embedded store at {self.endpoint}: cannot reach {self.endpoint}: {err}") from None

    def _request(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        assert self._key is not None
        try:
            return request(self.address, req, timeout or self.timeout_s, self._key)
        except JsonLineError as err:
            raise StoreError(f"embedded store at {self.address[0]}:{self.address[1]}: {err}") from err

    def get(self, key: str) -> KeyValue | None:
        kv = self._request({"op": "get", "key": self.full_key(key)})["kv"]
        return None if kv is None else KeyValue(self.relative_key(kv[0]), *kv[1:])

    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        kvs = self._request({"op": "get_prefix", "prefix": self.full_key(prefix)})["kvs"]
        return [KeyValue(self.relative_key(kv[0]), *kv[1:]) for kv in kvs]

    def put(self, key: str, value: str, lease: Lease | None = None) -> None:
        self._request({"op": "put", "key": self.full_key(key), "value": value, "lease": lease.id if lease else None})

    def compare_and_set(self, key: str, value: str, expected_version: int, lease: Lease | None = None) -> bool:
        req = {
            "op": "cas",
            "key": self.full_key(key),
            "value": value,
            "expected": expected_version,
            "lease": lease.id if lease else None,
        }
        return bool(self._request(req)["ok"])

    def delete(self, key: str) -> bool:
        return bool(self._request({"op": "delete", "key": self.full_key(key)})["ok"])

    def grant_lease(self, ttl: float) -> Lease:
        return _EmbeddedLease(self, self._request({"op": "lease_grant", "ttl": ttl})["lease"], ttl)

    def watch_prefix(self, prefix: str, callback: Callable[[WatchEvent], None], on_error=None) -> WatchHandle:
        watch = _EmbeddedWatch(self, self.full_key(prefix), callback, on_error)
        self._watches.append(watch)
        return watch

    def close(self) -> None:
        for w in self._watches:
            w.cancel()
