"""One suite, both membership-store backends: a real etcd (started by the fixture) and the embedded one."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from conftest import TEST_SECRET

from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer
from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import LeaseExpired, StoreError


@pytest.fixture(scope="module")
def embedded_server():
    server = EmbeddedStoreServer(secret=TEST_SECRET)
    yield server
    server.stop()


@pytest.fixture(params=["etcd", "embedded"])
def make_store(request):
    """Factory of stores of one backend: ``make_store(run_id=None)``."""
    stores = []

    def make(run_id: str | None = None):
        run_id = run_id or f"t-{uuid.uuid4().hex[:8]}"
        if request.param == "etcd":
            server = request.getfixturevalue("etcd_server")
            store = EtcdStore(EtcdOptions(endpoint=server.endpoint), run_id)
        else:
            server = request.getfixturevalue("embedded_server")
            store = EmbeddedStore(server.endpoint, run_id, secret=TEST_SECRET)
        stores.append(store)
        return store

    make.backend = request.param
    yield make
    for s in stores:
        s.close()


def test_put_get_prefix(make_store):
    store = make_store()
    assert store.get("nodes/a") is None
    store.put("nodes/a", '{"x": 1}')
    store.put("nodes/b", '{"x": 2}')
    store.put("other", "3")
    kv = store.get("nodes/a")
    assert kv.value == '{"x": 1}' and kv.version == 1 and kv.key == "nodes/a"
    store.put("nodes/a", '{"x": 5}')
    assert store.get("nodes/a").version == 2
    assert [kv.key for kv in store.get_prefix("nodes/")] == ["nodes/a", "nodes/b"]
    assert store.delete("nodes/b") and not store.delete("nodes/b")
    assert [kv.key for kv in store.get_prefix("")] == ["nodes/a", "other"]


def test_compare_and_set_conflicts(make_store):
    store = make_store()
    assert store.create("generation", "1")
    assert not store.create("generation", "1b")
    version = store.get("generation").version
    assert store.compare_and_set("generation", "2", version)
    assert not store.compare_and_set("generation", "2b", version)  # stale version loses
    assert store.get("generation").value == "2"
    # Many writers racing on one version: exactly one wins.
    version = store.get("generation").version
    wins = []
    barrier = threading.Barrier(6)

    def race(i):
        barrier.wait()
        if store.compare_and_set("generation", f"w{i}", version):
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(wins) == 1 and store.get("generation").value == f"w{wins[0]}"


def test_a_write_fenced_on_a_revision_is_refused_once_the_guard_changed(make_store):
    """A checkpoint commit made in the generation published at revision R: written while the
    generation key is still at R, refused (nothing written) once a newer generation replaced it."""
    store = make_store()
    store.put("generation", "g1")
    revision = store.get("generation").mod_revision
    assert store.put_if_unchanged("checkpoint", "step 10 in g1", "generation", revision)
    assert store.get("checkpoint").value == "step 10 in g1"
    store.put("generation", "g2")
    assert not store.put_if_unchanged("checkpoint", "step 12 in g1", "generation", revision)
    assert store.get("checkpoint").value == "step 10 in g1"
    assert store.put_if_unchanged("checkpoint", "step 12 in g2", "generation", store.get("generation").mod_revision)
    assert not store.put_if_unchanged("other", "x", "absent-key", revision)
    assert store.get("other") is None


def test_lease_expiry_removes_the_node_within_ttl_plus_one_second(make_store):
    store = make_store()
    ttl = 2.0
    lease = store.grant_lease(ttl)
    store.put("nodes/n1", "{}", lease=lease)
    kept = store.grant_lease(ttl)
    store.put("nodes/n2", "{}", lease=kept)
    store.put("nodes/n3", "{}")
    # A record names its lease (the leader admits no node without one).
    assert store.get("nodes/n1").lease != 0 and store.get("nodes/n1").lease != store.get("nodes/n2").lease
    assert [kv.lease != 0 for kv in store.get_prefix("nodes/")] == [True, True, False]
    started = time.monotonic()
    for _ in range(6):  # keep n2 alive with heartbeats, let n1 lapse
        time.sleep(0.5)
        kept.refresh()
        if store.get("nodes/n1") is None:
            break
    gone_after = time.monotonic() - started
    assert store.get("nodes/n1") is None, "lease did not expire"
    assert gone_after <= lease.ttl + 1.0, gone_after
    assert store.get("nodes/n2") is not None
    with pytest.raises(LeaseExpired):
        lease.refresh()
    kept.revoke()
    assert store.get("nodes/n2") is None


def test_watch_sees_joins_and_leaves(make_store):
    store = make_store()
    events, seen = [], threading.Event()

    def on_event(e):
        events.append((e.kind, e.key))
        if len(events) >= 3:
            seen.set()

    handle = store.watch_prefix("nodes/", on_event)
    time.sleep(0.3)
    lease = store.grant_lease(2)
    store.put("nodes/a", "{}", lease=lease)
    store.put("not-a-node", "{}")
    store.put("nodes/b", "{}")
    lease.revoke()
    assert seen.wait(10), events
    handle.cancel()
    assert ("put", "nodes/a") in events and ("put", "nodes/b") in events and ("delete", "nodes/a") in events
    assert all(k.startswith("nodes/") for _, k in events)


def test_two_run_ids_do_not_see_each_other(make_store):
    a, b = make_store("job-a-" + uuid.uuid4().hex[:6]), make_store("job-b-" + uuid.uuid4().hex[:6])
    events = []
    handle = b.watch_prefix("", lambda e: events.append(e))
    time.sleep(0.3)
    a.put("nodes/x", "1")
    assert a.create("generation", "1") and b.create("generation", "1")
    assert b.get("nodes/x") is None and b.get_prefix("") == [b.get("generation")]
    time.sleep(0.5)
    handle.cancel()
    assert [e.key for e in events] == ["generation"]


def test_unreachable_store_is_a_clear_error(make_store):
    with pytest.raises(StoreError, match="cannot reach"):
        if make_store.backend == "etcd":
            EtcdStore(EtcdOptions(endpoint="127.0.0.1:1", timeout_s=1), "x")
        else:
            EmbeddedStore("127.0.0.1:1", "x")


def test_bad_run_id_and_endpoint():
    with pytest.raises(ValueError, match="bad run id"):
        EmbeddedStore("127.0.0.1:1", "a/b")
    with pytest.raises(ValueError, match="bad etcd endpoint"):
        EtcdOptions(endpoint="nohost").host_port()
    with pytest.raises(ValueError, match="not found"):
        EtcdStore(EtcdOptions(endpoint="127.0.0.1:2379", ca_cert="/nope/ca.pem"), "x")


def test_embedded_store_rejects_malformed_requests_and_keeps_serving(embedded_server):
    """The store listens on the network: every request is validated (pydantic) before it is handled."""
    import socket

    from etc_agent.utils.auth import Key
    from etc_agent.utils.jsonline import JsonLineError, parse_address, request

    address = parse_address(embedded_server.endpoint)
    key = Key("job", TEST_SECRET)
    for bad, reason in [
        ({"op": "put", "key": "k"}, "value"),  # missing field
        ({"op": "put", "key": "k", "value": 3}, "value"),  # wrong type
        ({"op": "cas", "key": "k", "value": "v", "expected": -1}, "expected"),
        ({"op": "lease_grant", "ttl": -5}, "ttl"),
        ({"op": "wait", "prefix": "", "after": 0, "timeout": 1e9}, "timeout"),
        ({"op": "drop_everything"}, "op"),
        ({"op": "get", "key": "k", "extra": 1}, "extra"),
        ({"no_op": 1}, "op"),
    ]:
        with pytest.raises(JsonLineError, match="invalid request") as err:
            request(address, bad, timeout=5, key=key)
        assert reason in str(err.value), (bad, str(err.value))
    with socket.create_connection(address, timeout=5) as sock:  # signed, but not JSON at all
        challenge = sock.recv(4096).split(b'"')[3]
        body = b"\x80not json"
        sock.sendall(b"job " + key.sign(challenge, body).encode() + b" " + body + b"\n")
        assert b"error" in sock.recv(4096)
    store = EmbeddedStore(embedded_server.endpoint, "after-bad", secret=TEST_SECRET)
    store.put("k", "v")
    assert store.get("k").value == "v"
