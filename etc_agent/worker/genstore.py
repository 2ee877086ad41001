"""The store a generation's process groups form through: its waits give up once a newer generation exists.

Forming a gloo group blocks in the store until every rank published its address. A process that
died after it arrived never publishes, and the others would sit in that C++ wait for the whole
``ETC_AGENT_TIMEOUT`` although the leader published the generation after it seconds later. This
store answers ``get`` and ``wait`` itself, in short slices of ``check`` on the job's TCPStore, and
between slices asks ``superseded()``; torch calls it from C++ through its Python store trampoline,
and the error raised here comes out of ``init_process_group`` / ``ProcessGroupGloo`` as a
``RuntimeError`` the switch handles as a peer failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

POLL_S = 0.01
"""Seconds between two checks of the awaited keys."""


class ForwardingStore(dist.Store):
    """A Python store that hands every call to ``inner`` through :meth:`_forward` (a subclass's one
    place to observe them); torch calls it from C++ through its Python store trampoline."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def _forward(self, method: str, *args: Any) -> Any:
        return getattr(self.inner, method)(*args)

    def set(self, key: str, value) -> None:
        self._forward("set", key, value)

    def get(self, key: str) -> bytes:
        return self._forward("get", key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._forward("wait", keys)
        else:
            self._forward("wait", keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self._forward("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._forward("check", keys)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._forward("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._forward("delete_key", key)

    def num_keys(self) -> int:
        return self._forward("num_keys")

    def append(self, key: str, value) -> None:
        self._forward("append", key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._forward("multi_get", keys)

    def multi_set(self, keys: list[str], values) -> None:
        self._forward("multi_set", keys, values)

    def has_extended_api(self) -> bool:
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        self._forward("set_timeout", timeout)


class GenerationStore(ForwardingStore):
    """``inner`` for generation ``generation``, whose waits end when ``superseded()`` names a newer one
    (it returns that generation's number, or None) or after ``timeout_s`` (naming the missing keys)."""

    def __init__(
        self, inner: dist.Store, generation: int, superseded: Callable[[], int | None], timeout_s: float
    ) -> None:
        super().__init__(inner)
        self.generation = generation
        self.superseded = superseded
        self.timeout_s = timeout_s

    # ---- waits ------------------------------------------------------------------------------------
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # The caller's timeout is the group's own (meant for gloo's pairwise connect and its
        # collectives); a wait here is for peers still building their state, which a newer
        # generation ends, so it keeps the switch's own bound.
        del timeout
        limit_s = self.timeout_s
        deadline = time.monotonic() + limit_s
        while not self.inner.check(keys):
            newer = self.superseded()
            if newer is not None:
                raise RuntimeError(
                    f"generation {self.generation} superseded by generation {newer} while its process group "
                    f"was forming (a peer did not come: store keys {self._missing(keys)})"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"generation {self.generation}: timed out after {limit_s:.0f} s forming its process group; "
                    f"missing store keys {self._missing(keys)} (the peers that publish them did not come)"
                )
            time.sleep(POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def _missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self.inner.check([k])]

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
