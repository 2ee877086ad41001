"""``torchrun --rdzv-backend etcd-v3``: torch's dynamic rendezvous on etcd v3.

torch's own etcd backends speak only the v2 API, which etcd 3.6 removed. This module gives
``torchrun`` users a v3 backend: a :class:`RendezvousBackend` (the rendezvous state under
compare-and-set, fenced by the key's version) and a c10d ``Store`` for the agents' bootstrap data,
both on :class:`~etc_agent.rendezvous.etcd.EtcdStore` (keys under ``/etc-agent/<run_id>/torch/``).
It is found by torchrun through the ``torchrun.handlers`` entry point of this package.

Rendezvous options (``--rdzv-conf``): ``read_timeout`` (s), ``ca_cert``, ``ssl_cert``,
``ssl_cert_key``, ``user``, ``password``.
"""

from __future__ import annotations

import time
from base64 import b64decode, b64encode
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError

STATE_KEY = "torch/rendezvous/state"
STORE_PREFIX = "torch/store/"


class EtcdV3RendezvousBackend(RendezvousBackend):
    def __init__(self, store: EtcdStore):
        self.store = store

    @property
    def name(self) -> str:
        return "etcd-v3"

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self.store.get(STATE_KEY)
        except StoreError as err:
            raise RendezvousConnectionError(str(err)) from err
        if kv is None:
            return None
        try:
            return b64decode(kv.value, validate=True), kv.version
        except ValueError as err:
            raise RendezvousStateError(f"rendezvous state in etcd is corrupt: {err}") from err

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        try:
            expected = int(token) if token else 0
        except (TypeError, ValueError):
            current = self.get_state()
            return (*current, False) if current else None
        try:
            ok = self.store.compare_and_set(STATE_KEY, b64encode(state).decode(), expected)
        except StoreError as err:
            raise RendezvousConnectionError(str(err)) from err
        current = self.get_state()
        if current is None:
            return None
        return (*current, ok)


class EtcdV3C10dStore(dist.Store):
    """A c10d ``Store`` on etcd v3 (enough for torchrun's agents: set/get/add/wait/check)."""

    def __init__(self, store: EtcdStore, timeout_s: float = 300.0):
        super().__init__()
        self.store = store
        self._wait_timeout = timedelta(seconds=timeout_s)

    def _key(self, key: str) -> str:
        return STORE_PREFIX + b64encode(key.encode()).decode().replace("/", "_")

    def set(self, key, value) -> None:
        data = value if isinstance(value, (bytes, bytearray)) else str(value).encode()
        self.store.put(self._key(key), b64encode(bytes(data)).decode())

    def get(self, key) -> bytes:
        self.wait([key])
        kv = self.store.get(self._key(key))
        if kv is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"key {key!r} was deleted from etcd while it was read")
        return b64decode(kv.value)

    def add(self, key, num: int) -> int:
        full = self._key(key)
        while True:
            kv = self.store.get(full)
            current = int(b64decode(kv.value)) if kv else 0
            if self.store.compare_and_set(
                full, b64encode(str(current + num).encode()).decode(), kv.version if kv else 0
            ):
                return current + num

    def check(self, keys) -> bool:
        return all(self.store.get(self._key(k)) is not None for k in keys)

    def wait(self, keys, override_timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (override_timeout or self._wait_timeout).total_seconds()
        delay = 0.01
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(
                    f"keys {list(keys)} did not appear in etcd within {(override_timeout or self._wait_timeout).total_seconds()} s"
                )
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    def set_timeout(self, timeout: timedelta) -> None:
        self._wait_timeout = timeout


def create_handler(params: RendezvousParameters):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic

    options = EtcdOptions(
        endpoint=params.endpoint,
        ca_cert=params.get("ca_cert"),
        cert_cert=params.get("ssl_cert"),
        cert_key=params.get("ssl_cert_key"),
        user=params.get("user"),
        password=params.get("password"),
        timeout_s=float(params.get("read_timeout", 60)),
    )
    try:
        store = EtcdStore(options, params.run_id)
    except StoreError as err:
        raise RendezvousConnectionError(str(err)) from err
    return create_dynamic(EtcdV3C10dStore(store), EtcdV3RendezvousBackend(store), params)


def get_handler():
    """The ``torchrun.handlers`` entry point: torch calls this and registers what it returns."""
    return create_handler
