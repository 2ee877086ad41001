"""The generation record as the agent's main loop sees it: read when a watch says it changed.

The main loop passes every ``--monitor-interval`` (0.1 s) to check the workers; reading the
generation from the store on every pass cost each agent ~10 store requests a second, which at
hundreds of agents is thousands a second for a record that changes a few times an hour. A watch on
the generation key marks it changed (and wakes the loop); an unmarked pass takes the record it
read last. The store is still read every ``REFRESH_S`` (a lost watch event costs at most that), on
every pass while the watch is broken (re-armed every ``REARM_S``), and after a failed read.
"""

from __future__ import annotations

import logging
import threading
import time

from etc_agent.agent.node import Node
from etc_agent.protocol import keys
from etc_agent.rendezvous.records import GenerationRecord
from etc_agent.rendezvous.store import StoreError, WatchEvent, WatchHandle

log = logging.getLogger("etc_agent.agent")

REFRESH_S = 1.0
"""The longest a pass takes the last record without reading the store."""

REARM_S = 5.0
"""How often a broken watch is made again."""


class GenerationWatch:
    """The main loop's view of the generation key. ``read`` is called from the main loop only; the
    watch's callbacks (another thread) only mark."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._changed = True
        self._broken = True
        self._last: GenerationRecord | None = None
        self._read_at = float("-inf")
        self._armed_at = float("-inf")
        self._handle: WatchHandle | None = None

    def arm(self) -> None:
        """Make the watch (again); a store error leaves it broken, and ``read`` tries later."""
        self._armed_at = time.monotonic()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        try:
            handle = self._node.store.watch_prefix(keys.GENERATION, self._on_event, self._on_error)
        except StoreError as err:
            log.warning("the watch on the generation key could not be made (%s): reading it every pass", err)
            return
        with self._lock:
            self._handle, self._broken, self._changed = handle, False, True

    def read(self) -> GenerationRecord | None:
        """The generation record, from the store when it may have changed; raises ``StoreError``."""
        now = time.monotonic()
        if self._broken and now - self._armed_at >= REARM_S:
            self.arm()
        with self._lock:
            due = self._changed or self._broken or now - self._read_at >= REFRESH_S
            self._changed = False  # before the read: an event during it marks it again
        if not due:
            return self._last
        try:
            self._last = self._node.read_generation()
        except StoreError:
            with self._lock:
                self._changed = True
            raise
        self._read_at = now
        return self._last

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _on_event(self, event: WatchEvent) -> None:
        # The prefix also covers every generation's own keys (generations/<n>/...), its workers'
        # store address among them.
        with self._lock:
            self._changed = True
        self._node.generation_keys_changed.set()
        self._node.wake.set()

    def _on_error(self, err: Exception) -> None:
        with self._lock:
            self._broken = True
        self._node.wake.set()
