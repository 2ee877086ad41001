"""The leader's reads of the store: everything one decision uses, read in one place into a
:class:`~etc_agent.agent.snapshot.Snapshot` (:meth:`StoreRead.snapshot`), and the node records and
statuses other parts of the agent ask the leader for."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from etc_agent.agent.records import RecordReader
from etc_agent.agent.snapshot import NodeEntry, Settings, Snapshot
from etc_agent.layout.config import ParallelSpec
from etc_agent.protocol import keys
from etc_agent.rendezvous.records import AbandonRecord, GenerationRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import MembershipStore

log = logging.getLogger("etc_agent.agent")


class StoreRead:
    """Reads for one leader (``latest``: the newest generation its agent read)."""

    def __init__(
        self,
        store: MembershipStore,
        reader: RecordReader,
        settings: Settings,
        latest: Callable[[], GenerationRecord | None],
    ):
        self.store, self.reader, self.settings, self._latest = store, reader, settings, latest
        self._leaseless_seen: set[str] = set()
        """Node records without a lease already logged."""

    def statuses(self, generation: int) -> dict[str, NodeStatus]:
        """Node id -> the status its agent reported for ``generation`` (foreign values left out)."""
        statuses = {}
        for skv in self.store.get_prefix(keys.statuses(generation)):
            status = self.reader.parse(NodeStatus, skv)
            if status is not None:
                statuses[keys.node_of(skv.key)] = status
        return statuses

    def nodes(self) -> tuple[NodeEntry, ...]:
        """Every node record registered under a lease (group order: :func:`~etc_agent.agent.snapshot.ordered_nodes`)."""
        entries = []
        for kv in self.store.get_prefix(keys.NODES):
            if not kv.lease:
                # Every agent registers under its lease; a record without one outlives any process
                # and is not a member (a leftover, or written by hand).
                if kv.key not in self._leaseless_seen:
                    self._leaseless_seen.add(kv.key)
                    log.warning("%s has no lease: not a member of the job (agents register under a lease)", kv.key)
                continue
            record = self.reader.parse(NodeRecord, kv)
            if record is not None:
                entries.append(NodeEntry(record, kv.mod_revision))
        return tuple(entries)

    def requested_spec(self) -> ParallelSpec | None:
        """A layout asked for at run time (``etc-agent reconfigure``), which wins over ``--parallel``."""
        kv = self.store.get(keys.REQUESTED_PARALLEL)
        if kv is None:
            return None
        try:
            return ParallelSpec.parse(json.loads(kv.value)["spec"])
        except (ValueError, KeyError, TypeError) as err:
            self.reader.reject(kv, f"{type(err).__name__}: {err}")
            return None

    def snapshot(self) -> Snapshot:
        """One read of everything the decision uses: the only place the decision reads the store."""
        kv = self.store.get(keys.GENERATION)
        current = self.reader.parse(GenerationRecord, kv) if kv else None
        latest = self._latest()
        if current is not None and current.status in ("failed", "succeeded"):
            return Snapshot(self.settings, time.time(), kv.version if kv else 0, current, latest)  # the job is over
        used_numbers: tuple[int, ...] = ()
        if kv is not None and current is None:
            used = (keys.generation_number(k.key) for k in self.store.get_prefix(keys.GENERATIONS))
            used_numbers = tuple(n for n in used if n is not None)
        statuses: dict[str, NodeStatus] = {}
        abandoned: list[AbandonRecord] = []
        num_peer_failed, migration_done = 0, False
        if current is not None and current.status == "running":
            # The statuses first, then the node records: a node that reported a worker failure took
            # itself out of the membership before, so the records read after it show that too.
            statuses = self.statuses(current.number)
            parsed = (
                self.reader.parse(AbandonRecord, akv) for akv in self.store.get_prefix(keys.abandons(current.number))
            )
            abandoned = [r for r in parsed if r is not None]
            num_peer_failed = len(self.store.get_prefix(keys.peer_failures(current.number)))
            migration_done = self.store.get(keys.migration(current.number)) is not None
        return Snapshot(
            settings=self.settings,
            now=time.time(),
            generation_version=kv.version if kv else 0,
            current=current,
            latest=latest,
            used_numbers=used_numbers,
            nodes=self.nodes(),
            statuses=statuses,
            abandoned=tuple(abandoned),
            num_peer_failed=num_peer_failed,
            migration_done=migration_done,
            live_job=self.store.get(keys.ELASTIC) is not None,
            requested_spec=self.requested_spec(),
        )
