"""Embedded membership store: no etcd needed.

One agent (node rank 0, or the one whose host matches the endpoint) runs :class:`EmbeddedStoreServer`
in a thread; every agent, the host included, talks to it with :class:`EmbeddedStore` over TCP with
one JSON line per request and per reply. Semantics follow etcd's: per-key versions and a global
revision, compare-and-set, leases whose keys vanish when no heartbeat (``lease_refresh``) arrived
within the TTL, and prefix watches (long polls on an event log).

This module is the client, and the job's secret that both sides need; the server is
:mod:`~etc_agent.rendezvous.embedded_server` (requests, replies, the serving thread), its data and
quotas :mod:`~etc_agent.rendezvous.embedded_state`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from etc_agent.rendezvous.embedded_server import EmbeddedStoreServer
from etc_agent.rendezvous.embedded_state import StoreLimits
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
from etc_agent.utils.jsonline import JsonLineError, Unauthenticated, parse_address, request

log = logging.getLogger(__name__)
SAY_WAITING_AFTER_S = 5.0
"""A client still without its store after this long says why once (its wait may last minutes)."""

__all__ = ["EmbeddedStore", "EmbeddedStoreServer", "StoreLimits", "host_secret", "is_loopback", "store_secret"]


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
        started = time.monotonic()
        deadline = started + connect_timeout_s
        said = False
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
                if not said and time.monotonic() - started >= SAY_WAITING_AFTER_S:
                    # A wait of minutes must not be a silent one (a missing secret is a setup mistake).
                    log.warning("%s; trying again for up to %.0f s more", err, deadline - time.monotonic())
                    said = True
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

    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        req = {
            "op": "put_if",
            "key": self.full_key(key),
            "value": value,
            "guard": self.full_key(guard_key),
            "revision": guard_revision,
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
