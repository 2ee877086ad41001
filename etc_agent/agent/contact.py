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

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._answered_at = clock()
        self._failed = False
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

    def answered(self, token: int, sent_at: float) -> None:
        with self._lock:
            self._pending.pop(token, None)
            self._answered_at = max(self._answered_at, sent_at)
            self._failed = False

    def failed(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)
            self._failed = True

    def silence_s(self) -> float:
        """Seconds since the last answered request was sent, while the store is silent (a request
        failed since, or one waits longer than ``SLOW_S``); 0 while it answers."""
        with self._lock:
            now = self._clock()
            slow = any(now - at > SLOW_S for at in self._pending.values())
            return max(0.0, now - self._answered_at) if (self._failed or slow) else 0.0

    def heard_s(self) -> float:
        """Seconds since the last answered request was sent, silent or not (what peers are told)."""
        with self._lock:
            return max(0.0, self._clock() - self._answered_at)

    def call(self, fn: Callable[[], T]) -> T:
        token, at = self.sent()
        try:
            result = fn()
        except StoreError:
            self.failed(token)
            raise
        self.answered(token, at)
        return result


class _ContactedLease(Lease):
    def __init__(self, inner: Lease, contact: StoreContact) -> None:
        self._inner, self._contact = inner, contact
        self.id, self.ttl = inner.id, inner.ttl

    def refresh(self) -> None:
        self._contact.call(self._inner.refresh)

    def revoke(self) -> None:
        self._contact.call(self._inner.revoke)


class ContactedStore(MembershipStore):
    """``inner`` with every request timed into ``contact`` (see the module's docstring)."""

    def __init__(self, inner: MembershipStore, contact: StoreContact) -> None:
        super().__init__(inner.run_id)
        self.inner, self.contact = inner, contact

    def get(self, key: str) -> KeyValue | None:
        return self.contact.call(lambda: self.inner.get(key))

    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        return self.contact.call(lambda: self.inner.get_prefix(prefix))

    def put(self, key: str, value: str, lease: Lease | None = None) -> None:
        self.contact.call(lambda: self.inner.put(key, value, _unwrap(lease)))

    def compare_and_set(self, key: str, value: str, expected_version: int, lease: Lease | None = None) -> bool:
        return self.contact.call(lambda: self.inner.compare_and_set(key, value, expected_version, _unwrap(lease)))

    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        return self.contact.call(lambda: self.inner.put_if_unchanged(key, value, guard_key, guard_revision))

    def delete(self, key: str) -> bool:
        return self.contact.call(lambda: self.inner.delete(key))

    def grant_lease(self, ttl: float) -> Lease:
        return _ContactedLease(self.contact.call(lambda: self.inner.grant_lease(ttl)), self.contact)

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], on_error: Callable[[Exception], None] | None = None
    ) -> WatchHandle:
        return self.contact.call(lambda: self.inner.watch_prefix(prefix, callback, on_error))

    def close(self) -> None:
        self.inner.close()


def _unwrap(lease: Lease | None) -> Lease | None:
    return lease._inner if isinstance(lease, _ContactedLease) else lease


__all__ = ["ContactedStore", "StoreContact"]
