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
import threading
import time
from collections.abc import Callable
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
from etc_agent.utils.jsonline import JsonLineError, JsonLineServer, parse_address, request

log = logging.getLogger("etc_agent.rendezvous.embedded")
EVENT_LOG_SIZE = 10_000
REAP_INTERVAL_S = 0.1


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

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.data: dict[str, dict[str, Any]] = {}
        self.revision = 0
        self.leases: dict[int, dict[str, Any]] = {}
        self.lease_ids = itertools.count(1)
        self.events: collections.deque[tuple[int, str, str, str | None]] = collections.deque(maxlen=EVENT_LOG_SIZE)

    def _record(self, kind: str, key: str, value: str | None) -> int:
        self.revision += 1
        self.events.append((self.revision, kind, key, value))
        self.cond.notify_all()
        return self.revision

    def _put(self, key: str, value: str, lease: int | None) -> None:
        if lease is not None and lease not in self.leases:
            raise KeyError(f"lease {lease} not found")
        old = self.data.get(key)
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
        if item["lease"] is not None and item["lease"] in self.leases:
            self.leases[item["lease"]]["keys"].discard(key)
        self._record("delete", key, None)
        return True

    def handle(self, req: _Op) -> dict[str, Any]:
        with self.cond:
            if isinstance(req, _Get):
                item = self.data.get(req.key)
                return {"kv": None if item is None else [req.key, item["value"], item["version"], item["mod"]]}
            if isinstance(req, _GetPrefix):
                return {
                    "kvs": [
                        [k, v["value"], v["version"], v["mod"]]
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
    """The store process-side: serve on ``host:port`` (port 0 picks a free one) until :meth:`stop`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.state = _State()
        self.server = JsonLineServer(self.state.handle, host, port, name="etc-store", schema=STORE_REQUEST)
        self.host, self.port = self.server.host, self.server.port
        self._stop = threading.Event()
        self._reaper_thread = threading.Thread(target=self._reaper, name="etc-store-reaper", daemon=True)
        self._reaper_thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _reaper(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            self.state.reap()

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()


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


class EmbeddedStore(MembershipStore):
    """Client of an :class:`EmbeddedStoreServer` at ``endpoint`` (``host:port``)."""

    def __init__(self, endpoint: str, run_id: str, timeout_s: float = 5.0, connect_timeout_s: float = 0.0):
        super().__init__(run_id)
        self.address = parse_address(endpoint)
        self.timeout_s = timeout_s
        self._watches: list[_EmbeddedWatch] = []
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._request({"op": "ping"})
                break
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _request(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            return request(self.address, req, timeout or self.timeout_s)
        except JsonLineError as err:
            raise StoreError(f"embedded store at {self.address[0]}:{self.address[1]}: {err}") from err

    def get(self, key: str) -> KeyValue | None:
        kv = self._request({"op": "get", "key": self.full_key(key)})["kv"]
        return None if kv is None else KeyValue(self.relative_key(kv[0]), kv[1], kv[2], kv[3])

    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        kvs = self._request({"op": "get_prefix", "prefix": self.full_key(prefix)})["kvs"]
        return [KeyValue(self.relative_key(k), v, ver, mod) for k, v, ver, mod in kvs]

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
