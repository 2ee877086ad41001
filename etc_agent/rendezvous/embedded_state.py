"""The embedded store's data, on the server: keys with etcd's per-key versions and global revision,
leases whose keys vanish when no heartbeat arrived within their TTL, the event log that watches
long-poll, and the quotas that bound all of them. No network here: the server
(:mod:`etc_agent.rendezvous.embedded_server`) calls it under :attr:`StoreState.cond`.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field


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


@dataclass(slots=True)
class Entry:
    """One key's value, as etcd keeps it."""

    value: str
    version: int
    """Puts since the key was created (1 for the first); compare-and-set compares it."""
    mod_revision: int
    """The store's revision of the last put."""
    lease: int | None


@dataclass(slots=True)
class LeaseEntry:
    ttl: float
    deadline: float
    """``time.monotonic()`` after which the lease and its keys are gone unless refreshed."""
    keys: set[str] = field(default_factory=set)


Event = tuple[int, str, str, str | None]
"""``(revision, "put" or "delete", key, value or None)``: one change, as watches receive it."""


class StoreState:
    """The data of the store; every method but :meth:`reap` runs with ``self.cond`` held by the caller."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.cond = threading.Condition()
        self.data: dict[str, Entry] = {}
        self.data_bytes = 0
        self.revision = 0
        self.leases: dict[int, LeaseEntry] = {}
        self.lease_ids = itertools.count(1)
        self.events: collections.deque[Event] = collections.deque()
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

    def _check_quota(self, key: str, value: str, old: Entry | None) -> None:
        limits = self.limits
        if len(key) > limits.max_key_bytes:
            raise ValueError(f"key longer than {limits.max_key_bytes} bytes")
        if len(value) > limits.max_value_bytes:
            raise ValueError(f"value of {len(value)} bytes: the limit is {limits.max_value_bytes}")
        if old is None and len(self.data) >= limits.max_keys:
            raise ValueError(f"the store holds {limits.max_keys} keys already")
        grows = len(key) + len(value) - (len(key) + len(old.value) if old else 0)
        if self.data_bytes + grows > limits.max_total_bytes:
            raise ValueError(f"the store would exceed {limits.max_total_bytes} bytes of keys and values")

    def get_prefix(self, prefix: str) -> list[tuple[str, Entry]]:
        return [(key, entry) for key, entry in sorted(self.data.items()) if key.startswith(prefix)]

    def put(self, key: str, value: str, lease: int | None) -> None:
        if lease is not None and lease not in self.leases:
            raise KeyError(f"lease {lease} not found")
        old = self.data.get(key)
        self._check_quota(key, value, old)
        self.data_bytes += len(key) + len(value) - (len(key) + len(old.value) if old else 0)
        if old and old.lease is not None and old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        revision = self._record("put", key, value)
        self.data[key] = Entry(value, (old.version + 1) if old else 1, revision, lease)
        if lease is not None:
            self.leases[lease].keys.add(key)

    def compare_and_set(self, key: str, value: str, expected_version: int, lease: int | None) -> bool:
        entry = self.data.get(key)
        if (entry.version if entry else 0) != expected_version:
            return False
        self.put(key, value, lease)
        return True

    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        guard = self.data.get(guard_key)
        if (guard.mod_revision if guard else 0) != guard_revision:
            return False
        self.put(key, value, None)
        return True

    def delete(self, key: str) -> bool:
        entry = self.data.pop(key, None)
        if entry is None:
            return False
        self.data_bytes -= len(key) + len(entry.value)
        if entry.lease is not None and entry.lease in self.leases:
            self.leases[entry.lease].keys.discard(key)
        self._record("delete", key, None)
        return True

    def grant_lease(self, ttl: float) -> int:
        if len(self.leases) >= self.limits.max_leases:
            raise ValueError(f"the store holds {self.limits.max_leases} leases already")
        lease = next(self.lease_ids)
        self.leases[lease] = LeaseEntry(ttl, time.monotonic() + ttl)
        return lease

    def refresh_lease(self, lease: int) -> bool:
        """Whether the lease was still there (and is now good for another TTL)."""
        entry = self.leases.get(lease)
        if entry is None:
            return False
        entry.deadline = time.monotonic() + entry.ttl
        return True

    def revoke_lease(self, lease: int) -> None:
        entry = self.leases.pop(lease, None)
        for key in sorted(entry.keys) if entry else []:
            self.delete(key)

    def wait(self, prefix: str, after: int, timeout: float) -> list[Event] | None:
        """The events under ``prefix`` after revision ``after``, waiting up to ``timeout`` s for one;
        None when the log no longer reaches back to ``after`` (the watcher must re-read the prefix)."""
        deadline = time.monotonic() + timeout
        while True:
            oldest = self.events[0][0] if self.events else self.revision + 1
            if after + 1 < oldest and after < self.revision:
                return None
            found = [event for event in self.events if event[0] > after and event[2].startswith(prefix)]
            if found or time.monotonic() >= deadline:
                return found
            self.cond.wait(timeout=max(0.0, deadline - time.monotonic()))

    def reap(self) -> None:
        """Drop the leases past their deadline, and their keys."""
        with self.cond:
            now = time.monotonic()
            for lease, entry in list(self.leases.items()):
                if entry.deadline <= now:
                    del self.leases[lease]
                    for key in sorted(entry.keys):
                        self.delete(key)
