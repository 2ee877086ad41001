"""The workers' poll of their agent is held: a change comes back in the agent's pass that made it, an
idle worker asks about once per ``HOLD_S``, and closing the link ends a held poll at once."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from etc_agent.agent.attached import Attachments
from etc_agent.agent.commits import Commits
from etc_agent.agent.control_channel import ControlChannel
from etc_agent.agent.node import LoopPasses, WorkerContacts
from etc_agent.protocol.control import CONTROL_REQUEST, AssignmentQuery
from etc_agent.rendezvous.records import GenerationRecord
from etc_agent.utils import auth
from etc_agent.utils.jsonline import JsonLineServer
from etc_agent.worker import link as link_module
from etc_agent.worker.link import AgentLink


@dataclass
class _Node:
    """What the control channel reads of its node (the agent's main loop is the test)."""

    passes: LoopPasses = field(default_factory=LoopPasses)
    contacts: WorkerContacts = field(default_factory=WorkerContacts)
    attachments: Attachments = field(default_factory=Attachments)
    latest: GenerationRecord | None = None
    generation: GenerationRecord | None = None
    assignments: dict = field(default_factory=dict)
    fenced: bool = False
    node_id: str = "node-a"
    wake: threading.Event = field(default_factory=threading.Event)
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(nproc_per_node=1, sidecar=False))
    state: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(state=SimpleNamespace(restarting=set(), ready=True))
    )
    store: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(put=lambda *args, **kwargs: None))
    control_keys: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(check=lambda *args: None))

    def job_finished(self) -> bool:
        return False

    def emit(self, event: str, fields: dict) -> None:
        pass

    def generation_number(self, number: int) -> GenerationRecord:
        return GenerationRecord(number=number, status="running", members=["node-a"])

    def new_generation(self, number: int) -> None:
        """What a main-loop pass does when it reads a new generation."""
        self.latest = self.generation_number(number)
        self.passes.passed()


@pytest.fixture
def agent(monkeypatch):
    """A control channel served on a free port, the key of local rank 0 in the environment, and the
    number of polls it answered."""
    node = _Node()
    channel = ControlChannel(node, lambda: None, Commits.__new__(Commits))  # type: ignore[arg-type]
    key = auth.derive(b"s" * 32, auth.worker_key_id(0))
    polls: list[float] = []

    def handle(req, key_id):
        if isinstance(req, AssignmentQuery):
            polls.append(time.monotonic())
        return channel.handle(req, key_id)

    server = JsonLineServer(handle, schema=CONTROL_REQUEST, keys=lambda key_id: key if key_id == key.id else None)
    monkeypatch.setenv(auth.TOKEN_ENV, key.token())
    yield node, server.address, polls
    server.stop()


def _until(condition, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s
        time.sleep(0.005)
    return time.monotonic() - started


def test_a_new_generation_reaches_a_held_poll_in_the_pass_that_read_it_and_an_idle_worker_asks_seldom(agent):
    node, address, polls = agent
    node.new_generation(3)
    link = AgentLink(address, 0)
    try:
        _until(lambda: link.latest == 3, 5.0)
        time.sleep(0.3)  # the poll in flight is held now
        node.new_generation(4)
        assert _until(lambda: link.latest == 4, 5.0) < 0.1
        polls.clear()
        idle_s = 2.5
        passes_end = time.monotonic() + idle_s
        while time.monotonic() < passes_end:  # the main loop's passes, none of which changes a thing
            node.passes.passed()
            time.sleep(0.1)
        # Every 0.1 s would be 25 polls; held, one per HOLD_S.
        assert len(polls) <= idle_s / link_module.HOLD_S + 1, polls
        assert link.latest == 4
    finally:
        link.close()


def test_closing_the_link_ends_a_held_poll_at_once(agent):
    node, address, polls = agent
    node.new_generation(1)
    link = AgentLink(address, 0)
    _until(lambda: link.latest == 1 and len(polls) >= 2, 5.0)  # the second poll is the held one
    started = time.monotonic()
    link.close()
    assert time.monotonic() - started < 0.3
    assert not link._thread.is_alive()
