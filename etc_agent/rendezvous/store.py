"""The membership store interface: a small key-value store with versions, leases and prefix watches.

Two backends implement it with the same behaviour (and one test suite runs against both):
:class:`~etc_agent.rendezvous.etcd.EtcdStore` (etcd v3 over gRPC) and
:class:`~etc_agent.rendezvous.embedded.EmbeddedStore` (a store hosted by one agent). Keys are
relative to the run's prefix ``/etc-agent/<run_id>/``, so jobs with different run ids never see each
other's keys; values are JSON text.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ROOT_PREFIX = "/etc-agent/"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class StoreError(RuntimeError):
    """The store could not be reached or answered with an error."""


class LeaseExpired(StoreError):
    """A lease lapsed (its keys are gone); the holder must re-register."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    """Relative to the run prefix."""
    value: str
    version: int
    """1 when created, +1 on every update; 0 means absent (for compare-and-set)."""
    mod_revision: int
    lease: int = 0
    """The lease the key is bound to (0: none; it stays until deleted)."""


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: str | None
    revision: int


class Lease(ABC):
    id: int
    ttl: float

    @abstractmethod
    def refresh(self) -> None:
        """Keep the lease alive for another ``ttl``; raise :class:`LeaseExpired` if it already lapsed."""

    @abstractmethod
    def revoke(self) -> None:
        """End the lease now; its keys are deleted."""


class WatchHandle(ABC):
    @abstractmethod
    def cancel(self) -> None: ...


def run_prefix(run_id: str) -> str:
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"bad run id {run_id!r}: use 1-128 letters, digits, '_', '.', '-'")
    return f"{ROOT_PREFIX}{run_id}/"


class MembershipStore(ABC):
    """Versioned key-value store scoped to one run."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.prefix = run_prefix(run_id)

    def full_key(self, key: str) -> str:
        return self.prefix + key

    def relative_key(self, full: str) -> str:
        assert full.startswith(self.prefix), full
        return full[len(self.prefix) :]

    @abstractmethod
    def get(self, key: str) -> KeyValue | None: ...

    @abstractmethod
    def get_prefix(self, prefix: str = "") -> list[KeyValue]:
        """All keys under ``prefix`` (relative), sorted by key."""

    @abstractmethod
    def put(self, key: str, value: str, lease: Lease | None = None) -> None: ...

    @abstractmethod
    def compare_and_set(self, key: str, value: str, expected_version: int, lease: Lease | None = None) -> bool:
        """Write ``value`` only if the key's version is ``expected_version`` (0: only if absent)."""

    @abstractmethod
    def put_if_unchanged(self, key: str, value: str, guard_key: str, guard_revision: int) -> bool:
        """Write ``value`` (no lease) only if ``guard_key`` was last modified at ``guard_revision``, in
        one transaction: a fenced write (a checkpoint commit made in the generation published at
        that revision is refused once a newer generation exists)."""

    def create(self, key: str, value: str, lease: Lease | None = None) -> bool:
        """Write ``value`` only if the key does not exist."""
        return self.compare_and_set(key, value, 0, lease)

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def grant_lease(self, ttl: float) -> Lease: ...

    @abstractmethod
    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], on_error: Callable[[Exception], None] | None = None
    ) -> WatchHandle:
        """Call ``callback`` for every later put/delete under ``prefix`` (relative keys), from a thread."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> MembershipStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
