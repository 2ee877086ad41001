"""The embedded store's server: the requests it accepts on the wire (one pydantic model per ``op``,
validated before anything is handled), the reply to each, and the thread that serves them and
expires leases. The data and its quotas are :class:`~etc_agent.rendezvous.embedded_state.StoreState`.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from etc_agent.rendezvous.embedded_state import Entry, StoreLimits, StoreState
from etc_agent.utils import auth
from etc_agent.utils.auth import Key
from etc_agent.utils.jsonline import JsonLineServer, ServerLimits

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


class _PutIf(_Op):
    op: Literal["put_if"]
    key: str
    value: str
    guard: str
    revision: int = Field(ge=0, description="The guard key's modification revision the caller saw.")


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
        _Get | _GetPrefix | _Put | _Cas | _PutIf | _Delete | _LeaseGrant | _LeaseRefresh | _LeaseRevoke | _Wait | _Ping,
        Field(discriminator="op"),
    ]
)
"""Every request the store server accepts (validated before it is handled)."""


def _kv(key: str, entry: Entry) -> list[Any]:
    """A key on the wire: ``[key, value, version, mod revision, lease or 0]``."""
    return [key, entry.value, entry.version, entry.mod_revision, entry.lease or 0]


def handle_request(state: StoreState, req: _Op) -> dict[str, Any]:
    """The reply to one validated request (a ValueError or KeyError is the client's error line)."""
    with state.cond:
        match req:
            case _Get():
                entry = state.data.get(req.key)
                return {"kv": None if entry is None else _kv(req.key, entry)}
            case _GetPrefix():
                return {"kvs": [_kv(key, entry) for key, entry in state.get_prefix(req.prefix)]}
            case _Put():
                state.put(req.key, req.value, req.lease)
                return {}
            case _Cas():
                return {"ok": state.compare_and_set(req.key, req.value, req.expected, req.lease)}
            case _PutIf():
                return {"ok": state.put_if_unchanged(req.key, req.value, req.guard, req.revision)}
            case _Delete():
                return {"ok": state.delete(req.key)}
            case _LeaseGrant():
                return {"lease": state.grant_lease(req.ttl)}
            case _LeaseRefresh():
                return {"expired": not state.refresh_lease(req.lease)}
            case _LeaseRevoke():
                state.revoke_lease(req.lease)
                return {}
            case _Wait():
                found = state.wait(req.prefix, req.after, req.timeout)
                if found is None:
                    return {"compacted": True, "revision": state.revision}
                return {"events": [list(event) for event in found], "revision": state.revision}
        assert isinstance(req, _Ping), req
        return {"revision": state.revision}


class EmbeddedStoreServer:
    """The store process-side: serve on ``host:port`` (port 0 picks a free one) until :meth:`stop`,
    answering only requests signed with ``secret`` (the job's secret, see
    :func:`~etc_agent.rendezvous.embedded.store_secret`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes,
        limits: ServerLimits | None = None,
        store_limits: StoreLimits | None = None,
    ):
        self.state = StoreState(store_limits or StoreLimits())
        key = Key(auth.STORE_KEY_ID, secret)
        self.server = JsonLineServer(
            lambda req, _key_id: handle_request(self.state, req),
            host,
            port,
            name="etc-store",
            schema=STORE_REQUEST,
            keys=lambda key_id: key if key_id == key.id else None,
            limits=limits or ServerLimits(),
        )
        self.host, self.port = self.server.host, self.server.port
        self._stop = threading.Event()
        self._local_secret: tuple[str, str] | None = None
        self._reaper_thread = threading.Thread(target=self._reaper, name="etc-store-reaper", daemon=True)
        self._reaper_thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _reaper(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            self.state.reap()

    def publish_local_secret(self, endpoint: str, run_id: str, secret: bytes) -> None:
        """Write the secret for this user's other processes; removed again by :meth:`stop`."""
        auth.write_local_secret(endpoint, run_id, secret)
        self._local_secret = (endpoint, run_id)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
        if self._local_secret is not None:
            auth.remove_local_secret(*self._local_secret)
