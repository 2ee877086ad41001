"""How long the store has been silent to this agent, measured on every request of every thread.

:class:`ContactedStore` wraps the agent's :class:`~etc_agent.rendezvous.store.MembershipStore` and
its leases: each request is timed into one :class:`StoreContact`. The store is *silent* when a
request failed since the last answer, or when one has waited longer than ``SLOW_S`` (an etcd
request waits up to its 5 s deadline before it fails, and a partition drops packets silently, so
failures alone come too late). A main loop that is merely busy makes no request and so never makes
the store look silent.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from etc_agent.rendezvous.store import KeyValue, Lease, MembershipStore, StoreError, WatchEvent, WatchHandle

SLOW_S = 1.0
"""A request unanswered this long counts as the store's silence (a healthy etcd answers in ms)."""

T = TypeVar("T")


class StoreContact:
    """When the store last answered this agent; thread-safe."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, observe: Callable[[str, float, bool], None] | None = None
    ) -> None:
        """``observe(op, seconds, ok)`` sees every request's latency and outcome (the agent's metrics)."""
        self._clock = clock
        self._observe = observe
        self._lock = threading.Lock()
        self._answered_at = clock()
        self._lease_confirmed_at = self._answered_at
        self._failed_at: float | None = None
        """The first failure since the last answer."""
        self._pending: dict[int, float] = {}
        self._tokens = itertools.count()

    def now(self) -> float:
        return self._clock()

    def sent(self) -> tuple[int, float]:
        """A request goes out now: its token and send time."""
        with self._lock:
            token, at = next(self._tokens), self._clock()
            self._pending[token] = at
            return token, at

    def answered(self, token: int, sent_at: float, lease: bool = False) -> None:
        """``lease``: the request kept the lease alive (it lives ``ttl`` from ``sent_at`` at least)."""
        with self._lock:
            self._pending.pop(token, None)
            self._answered_at = max(self._answered_at, sent_at)
            if lease:
                self._lease_confirmed_at = max(self._lease_confirmed_at, sent_at)
            self._failed_at = None

    def failed(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)
            if self._failed_at is None:
                self._failed_at = self._clock()

    def silent_since(self) -> float | None:
        """When the store was first known silent (a request failed since the last answer, or one has
        waited ``SLOW_S``); None while it answers."""
        with self._lock:
            return self._silent_since_locked()

    def _silent_since_locked(self) -> float | None:
        known = [at + SLOW_S for at in self._pending.values() if at + SLOW_S <= self._clock()]
        if self._failed_at is not None:
            known.append(self._failed_at)
        return min(known) if known else None

    def silence_s(self) -> float:
        """Seconds since the last answered request was sent, while the store is silent; 0 while it answers."""
        with self._lock:
            silent = self._silent_since_locked() is not None
            return max(0.0, self._clock() - self._answered_at) if silent else 0.0

    def lease_age_s(self) -> float:
        """Seconds since the request that last kept the lease alive was sent."""
        with self._lock:
            return max(0.0, self._clock() - self._lease_confirmed_at)

    def heard_s(self) -> float:
        """Seconds since the last answered request was sent, silent or not (what peers are told)."""
        with self._lock:
            return max(0.0, self._clock() - self._answered_at)

    def call(self, fn: Callable[[], T], lease: bool = False, op: str = "request") -> T:
        token, at = self.sent()
        try:
            result = fn()
        except StoreError:
            self.failed(token)
            self._observed(op, at, False)
            raise
        self.answered(token, at, lease)
        self._observed(op, at, True)
        return result

    def _observed(self, op: str, sent_at: float, ok: bool) -> None:
        if self._observe is not None:
            self._observe(op, self._clock() - sent_at, ok)


class _ContactedLease(Lease):
    def __init__(self, inner: Lease, contact: StoreContact) -> None:
        self._inner, self._contact = inner, contact
        self.id, self.ttl = inner.id, inner.ttl

    def refresh(self) -> None:
        self._contact.call(self._inner.refresh, lease=True, op="lease_refresh")

    def revoke(self) -> None:
        self._contact.call(self._inner.revoke, op="lease_revoke")


class ContactedStore(MembershipStore):
    """``inner`` with every request timed into ``contact`` (see the module's docstring)."""

    def __init__(self, inner: MembershipStore, contact: StoreContact) -> None:
        super().__init__(inner.run_id)
        self.inner, self.contact = inner, contact

    def get(self, key: str) -> KeyValue | None:
        return self.contact.call(lambda: self.inner.get(key), op="get")

    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        return self.contact.call(lambda: self.inner.get_prefix(prefix), op="get_prefix")

    def put(self, key: str, value: str, lease: Lease | None = None) -> None:
        self.contact.call(lambda: self.inner.put(key, value, _unwrap(lease)), op="put")

    def compare_and_set(self, key: str, value: str, expected_version: int, lease: Lease | None = None) -> bool:
        return self.contact.call(
            lambda: self.inner.compare_and_set(key, value, expected_version, _unwrap(lease)), op="compare_and_set"
        )

    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        return self.contact.call(
            lambda: self.inner.put_if_unchanged(key, value, guard_key, guard_revision), op="put_if_unchanged"
        )

    def delete(self, key: str) -> bool:
        return self.contact.call(lambda: self.inner.delete(key), op="delete")

    def grant_lease(self, ttl: float) -> Lease:
        return _ContactedLease(
            self.contact.call(lambda: self.inner.grant_lease(ttl), lease=True, op="grant_lease"), self.contact
        )

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], on_error: Callable[[Exception], None] | None = None
    ) -> WatchHandle:
        # Not timed: a watch is set up on the client's side (etcd's stream opens lazily), so its
        # return says nothing of the store; a re-armed watch counted as an answer would end an outage.
        return self.inner.watch_prefix(prefix, callback, on_error)

    def close(self) -> None:
        self.inner.close()


def _unwrap(lease: Lease | None) -> Lease | None:
    return lease._inner if isinstance(lease, _ContactedLease) else lease


__all__ = ["ContactedStore", "StoreContact"]
