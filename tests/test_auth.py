"""The request/reply protocol of the embedded store and the control channel: authentication and limits."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from conftest import TEST_SECRET

from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer, StoreLimits
from etc_agent.rendezvous.store import StoreError
from etc_agent.utils import auth
from etc_agent.utils.auth import Key
from etc_agent.utils.jsonline import (
    JsonLineServer,
    ServerLimits,
    Unauthenticated,
    parse_address,
    request,
)

JOB = Key("job", TEST_SECRET)


@pytest.fixture
def server():
    server = EmbeddedStoreServer(secret=TEST_SECRET)
    yield server
    server.stop()


def _raw(address, line: bytes, timeout: float = 5) -> bytes:
    """Send ``line`` after reading the challenge; the server's answer (b"" if it closed)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.recv(4096)
        sock.sendall(line)
        return sock.recv(1 << 16)


def test_unsigned_wrongly_signed_and_replayed_requests_are_refused(server):
    address = parse_address(server.endpoint)
    store = EmbeddedStore(server.endpoint, "r", secret=TEST_SECRET)
    store.put("generation", "0")
    forged = {"op": "put", "key": "/etc-agent/r/generation", "value": '{"status": "succeeded"}'}
    with pytest.raises(Unauthenticated, match="unknown key"):
        request(address, forged, 5, Key("admin", TEST_SECRET))
    with pytest.raises(Unauthenticated, match="bad signature"):
        request(address, forged, 5, Key("job", b"not the job's secret, but long"))
    body = json.dumps(forged).encode()
    assert b"unauthenticated" in _raw(address, body + b"\n")  # no header at all

    # A request seen on the wire, sent again on a new connection: its challenge is not this one's.
    with socket.create_connection(address, timeout=5) as sock:
        nonce = json.loads(sock.recv(4096))["challenge"].encode()
        signed = b"job " + JOB.sign(nonce, body).encode() + b" " + body + b"\n"
    assert b"bad signature" in _raw(address, signed)
    # Altered on the way: signed for one body, another sent.
    with socket.create_connection(address, timeout=5) as sock:
        nonce = json.loads(sock.recv(4096))["challenge"].encode()
        sock.sendall(b"job " + JOB.sign(nonce, b"{}").encode() + b" " + body + b"\n")
        assert b"bad signature" in sock.recv(4096)
    assert store.get("generation").value == "0"


def test_a_client_refuses_a_reply_not_signed_with_the_job_key():
    """A server impersonating the store (say, one that took its port) cannot feed a client records."""
    impostor = JsonLineServer(lambda req, _: {"kv": None}, keys=lambda _: Key("job", b"the impostor's own secret"))
    try:
        with pytest.raises(Unauthenticated):
            request(parse_address(impostor.address), {"op": "get", "key": "k"}, 5, JOB)
    finally:
        impostor.stop()


def test_a_store_that_listens_on_the_network_needs_a_secret_and_a_loopback_one_finds_its_file(
    monkeypatch, tmp_path, caplog
):
    from etc_agent.rendezvous.embedded import host_secret, store_secret

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(auth.AuthError, match="reachable from the network.*ETC_AGENT_SECRET"):
        host_secret("10.1.2.3:29400")
    with pytest.raises(auth.AuthError, match="at least 16"):
        monkeypatch.setenv(auth.SECRET_ENV, "short")
        store_secret("10.1.2.3:29400", "r")
    monkeypatch.setenv(auth.SECRET_ENV, "x" * 20)
    assert store_secret("10.1.2.3:29400", "r") == b"x" * 20
    monkeypatch.delenv(auth.SECRET_ENV)

    secret, fresh = host_secret("127.0.0.1:0")
    assert fresh and len(secret) >= 32
    server = EmbeddedStoreServer(secret=secret)
    server.publish_local_secret(server.endpoint, "r", secret)
    path = auth.local_secret_path(server.endpoint, "r")
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    client = EmbeddedStore(server.endpoint, "r")  # no secret given: reads this user's file
    client.put("k", "v")
    assert client.get("k").value == "v"
    with pytest.raises(StoreError, match="no secret"):
        EmbeddedStore(server.endpoint, "another-run")
    # A client that may wait (its join timeout) says why once it has waited a while, not silently.
    import logging

    import etc_agent.rendezvous.embedded as embedded

    monkeypatch.setattr(embedded, "SAY_WAITING_AFTER_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="etc_agent.rendezvous.embedded"):
        with pytest.raises(StoreError, match="no secret"):
            EmbeddedStore(server.endpoint, "another-run", connect_timeout_s=0.6)
    [said] = [r.getMessage() for r in caplog.records if r.name == "etc_agent.rendezvous.embedded"]
    assert "no secret for it here" in said and "ETC_AGENT_SECRET" in said and "trying again" in said
    server.stop()
    assert not path.exists()


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def test_request_size_connection_count_and_slow_clients_are_bounded():
    # The request timeout is long enough for four connections to be accepted on a loaded machine
    # before the first of them times out; the test waits for those timeouts by reading, not sleeping.
    limits = ServerLimits(max_connections=4, max_request_bytes=1000, request_timeout_s=2.0, backlog=8)
    server = JsonLineServer(lambda req, _: {"ok": True}, keys=lambda i: JOB if i == "job" else None, limits=limits)
    address = parse_address(server.address)
    try:
        assert b"longer than 1000" in _raw(address, b"job " + b"x" * 5000 + b"\n")
        _until(lambda: server.num_open == 0, 5, "the oversized request's connection to close")
        idle = [socket.create_connection(address, timeout=5) for _ in range(4)]
        _until(lambda: server.num_open == 4, 5, "the four idle connections to be accepted")
        evicted = server.num_evicted  # 0 unless a slot was still being freed as the fourth came
        # Every slot held by a connection that sent nothing: the oldest gives way to a new one.
        assert request(address, {"op": "x"}, 2, JOB) == {"ok": True}
        assert server.num_evicted == evicted + 1
        for sock in idle:  # the others send no request in time: each is closed, its slot free again
            assert sock.recv(4096).startswith(b'{"challenge"')
            assert sock.recv(4096) == b""
            sock.close()
        assert request(address, {"op": "x"}, 2, JOB) == {"ok": True}
        _until(lambda: server.num_open == 0, 5, "every connection closed")  # the server closes after replying
    finally:
        server.stop()


def test_store_quotas_refuse_what_would_exceed_them_and_deleted_values_leave_the_event_log():
    limits = StoreLimits(max_value_bytes=1000, max_keys=5, max_total_bytes=3000, max_leases=2, max_event_log_bytes=4000)
    server = EmbeddedStoreServer(secret=TEST_SECRET, store_limits=limits)
    store = EmbeddedStore(server.endpoint, "q", secret=TEST_SECRET)
    try:
        with pytest.raises(StoreError, match="value of 1001 bytes"):
            store.put("big", "x" * 1001)
        with pytest.raises(StoreError, match="key longer"):
            store.put("k" * 2000, "v")
        for i in range(3):
            store.put(f"v{i}", "x" * 900)
        with pytest.raises(StoreError, match="exceed 3000 bytes"):
            store.put("v3", "x" * 900)
        store.put("v0", "y" * 900)  # replacing a value counts only the difference
        store.put("a", "1")
        store.put("b", "1")
        with pytest.raises(StoreError, match="5 keys"):
            store.put("c", "1")
        for _ in range(2):
            store.grant_lease(10)
        with pytest.raises(StoreError, match="2 leases"):
            store.grant_lease(10)
        for i in range(3):
            store.delete(f"v{i}")
        store.put("c", "1")
        state = server.state
        assert state.data_bytes == sum(len(k) + len(v.value) for k, v in state.data.items())
        assert state.event_bytes <= limits.max_event_log_bytes
        assert sum(len(e[2]) + len(e[3] or "") for e in state.events) == state.event_bytes
    finally:
        store.close()
        server.stop()


def test_a_flood_of_connections_does_not_starve_the_store():
    """Idle connections and connect/close churn at the connection limit: a client's request still
    gets through (retrying while every slot is taken) and the open connections fall back to zero."""
    server = EmbeddedStoreServer(secret=TEST_SECRET, limits=ServerLimits(max_connections=32, request_timeout_s=1.0))
    address = parse_address(server.endpoint)
    store = EmbeddedStore(server.endpoint, "flood", secret=TEST_SECRET)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            try:
                socket.create_connection(address, timeout=1).close()
            except OSError:
                pass

    idle = []
    for _ in range(200):
        try:
            idle.append(socket.create_connection(address, timeout=1))
        except OSError:
            break
    threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        latencies = []
        for i in range(20):
            started = time.monotonic()
            while True:
                try:
                    store.put(f"k{i}", "v")
                    break
                except StoreError:
                    time.sleep(0.05)
            latencies.append(time.monotonic() - started)
        assert max(latencies) < 3.0, latencies
    finally:
        stop.set()
        for t in threads:
            t.join()
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while server.server.num_open and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.server.num_open == 0
    store.close()
    server.stop()
