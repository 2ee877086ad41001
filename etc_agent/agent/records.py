"""Reading the agent's records from the store: foreign or malformed values are skipped and named once."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from etc_agent.rendezvous.records import Record
from etc_agent.rendezvous.store import KeyValue

R = TypeVar("R", bound=Record)


class RecordReader:
    """``parse`` store values into records; each rejected (key, revision) is reported once."""

    def __init__(self, emit: Callable[[str, dict], None]):
        self.emit = emit
        self._rejected: set[tuple[str, int]] = set()

    def parse(self, cls: type[R], kv: KeyValue) -> R | None:
        """``cls.loads(kv.value)``, or None for a foreign or malformed value, logged once per key revision."""
        try:
            return cls.loads(kv.value)
        except ValueError as err:
            self.reject(kv, str(err))
            return None

    def reject(self, kv: KeyValue, reason: str) -> None:
        if (kv.key, kv.mod_revision) not in self._rejected:
            self._rejected.add((kv.key, kv.mod_revision))
            self.emit("rejected_record", {"key": kv.key, "reason": reason})


def where(err: BaseException) -> str:
    """file:line of the innermost frame of ``err`` (for one-line logs)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}" if tb else "?"
