"""The main loop's generation record (etc_agent.agent.genwatch) against the embedded store: read
when its key changes, at most ``REFRESH_S`` apart otherwise, every pass while the watch is broken;
a member waiting for its generation's workers' store address reads it as soon as it is put."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from conftest import TEST_SECRET

from etc_agent.agent import genwatch
from etc_agent.agent.genwatch import GenerationWatch
from etc_agent.protocol import keys
from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer
from etc_agent.rendezvous.records import GenerationRecord
from etc_agent.rendezvous.store import StoreError


class _Node:
    """What the watch uses of a node: its store, its wake event, its read of the generation (counted)."""

    def __init__(self, store: EmbeddedStore) -> None:
        self.store, self.wake, self.num_reads = store, threading.Event(), 0
        self.generation_keys_changed = threading.Event()
        self.fail_next = False

    def read_generation(self) -> GenerationRecord | None:
        self.num_reads += 1
        if self.fail_next:
            self.fail_next = False
            raise StoreError("the store did not answer")
        kv = self.store.get(keys.GENERATION)
        return GenerationRecord.model_validate_json(kv.value) if kv is not None else None


@pytest.fixture
def node():
    server = EmbeddedStoreServer(secret=TEST_SECRET)
    store = EmbeddedStore(server.endpoint, f"g-{uuid.uuid4().hex[:8]}", secret=TEST_SECRET)
    yield _Node(store)
    store.close()
    server.stop()


def _publish(node: _Node, number: int) -> None:
    node.wake.clear()
    node.store.put(keys.GENERATION, GenerationRecord(number=number, status="running", members=["a"]).dumps())
    assert node.wake.wait(5), "the watch did not wake the loop"


def test_the_generation_is_read_when_it_changes_and_not_on_every_pass(node, monkeypatch):
    monkeypatch.setattr(genwatch, "REFRESH_S", 60.0)
    watch = GenerationWatch(node)  # type: ignore[arg-type]
    watch.arm()
    assert watch.read() is None and node.num_reads == 1
    for _ in range(20):
        assert watch.read() is None
    assert node.num_reads == 1
    _publish(node, 3)
    gen = watch.read()
    assert gen is not None and gen.number == 3 and node.num_reads == 2
    assert watch.read() is gen and node.num_reads == 2
    # A failed read is tried again on the next pass.
    _publish(node, 4)
    node.fail_next = True
    with pytest.raises(StoreError):
        watch.read()
    gen = watch.read()
    assert gen is not None and gen.number == 4 and node.num_reads == 4
    watch.close()


def test_unwatched_the_store_is_still_read_every_refresh(node, monkeypatch):
    monkeypatch.setattr(genwatch, "REFRESH_S", 0.2)
    watch = GenerationWatch(node)  # type: ignore[arg-type]
    watch.arm()
    watch.read()
    watch.read()
    assert node.num_reads == 1
    time.sleep(0.25)
    watch.read()
    assert node.num_reads == 2
    watch.close()


def test_a_broken_watch_means_a_read_every_pass_until_it_is_made_again(node, monkeypatch):
    monkeypatch.setattr(genwatch, "REFRESH_S", 60.0)
    monkeypatch.setattr(genwatch, "REARM_S", 0.3)
    watch = GenerationWatch(node)  # type: ignore[arg-type]
    watch.arm()
    watch.read()
    watch._on_error(OSError("the watch's stream ended"))
    assert node.wake.is_set()
    for expected in (2, 3, 4):
        watch.read()
        assert node.num_reads == expected
    time.sleep(0.35)
    watch.read()  # re-armed before this read
    reads = node.num_reads
    watch.read()
    assert node.num_reads == reads
    _publish(node, 7)  # the new watch works
    gen = watch.read()
    assert gen is not None and gen.number == 7
    watch.close()


def test_a_member_reads_the_workers_store_address_as_soon_as_the_first_member_puts_it(node, monkeypatch):
    """Without the watch's event the member would read the address only at its next poll."""
    from test_fence import _node

    from etc_agent.agent import generations
    from etc_agent.rendezvous.records import MasterRecord

    monkeypatch.setattr(generations, "MASTER_POLL_S", 60.0)
    member = _node(node.store, [])  # node "a", a member after "z", which hosts the workers' store
    watch = GenerationWatch(member)
    watch.arm()
    gen = GenerationRecord(number=2, status="running", members=["z", "a"])
    node.store.put(keys.GENERATION, gen.dumps())
    got: list[MasterRecord] = []
    waiting = threading.Thread(target=lambda: got.append(generations.Generations(member, None, None).master(gen)))  # type: ignore[arg-type]
    waiting.start()
    time.sleep(0.5)  # the member read no address yet and waits
    assert not got
    put_at = time.monotonic()
    node.store.put(keys.master(2), MasterRecord(addr="127.0.0.1", port=29511).dumps())
    waiting.join(10)
    assert got and got[0].port == 29511
    assert time.monotonic() - put_at < 2.0
    watch.close()
