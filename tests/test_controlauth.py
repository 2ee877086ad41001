"""Who may say what on an agent's control channel (etc_agent.agent.controlauth), request by request,
and the workers' launcher that sends ``leave`` (etc_agent.agent.spawn)."""

import pytest

from etc_agent.agent.controlauth import ControlKeys, NotAllowed
from etc_agent.protocol.control import Heartbeat, Leave
from etc_agent.utils import auth


def test_leave_is_taken_only_from_a_sidecars_workers_launcher():
    key_id = auth.worker_key_id(0)
    etcrun = ControlKeys(2, sidecar=False, master=b"m" * 32)
    with pytest.raises(NotAllowed, match="sidecar"):
        etcrun.check(Leave(reason="SIGTERM"), key_id, lambda rank: 4242)
    ControlKeys(2, sidecar=True, master=b"m" * 32).check(Leave(reason="SIGTERM"), key_id, lambda rank: None)


def test_a_request_naming_another_local_rank_than_its_key_is_refused():
    keys = ControlKeys(2, sidecar=True, master=b"m" * 32)
    with pytest.raises(NotAllowed, match="names local rank 1"):
        keys.check(Heartbeat(local_rank=1), auth.worker_key_id(0), lambda rank: None)
    keys.check(Heartbeat(local_rank=1), auth.worker_key_id(1), lambda rank: None)


class _Process:
    def __init__(self):
        self.signals: list[int] = []

    def poll(self):
        return None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


def _launcher(address):
    """``etc-agent workers``' supervisor around two stand-in processes (nothing started)."""
    import argparse
    import signal

    from etc_agent.agent.spawn import _Workers

    workers = _Workers.__new__(_Workers)
    workers.args = argparse.Namespace(departure_timeout=0.3)
    workers.address = address
    workers.procs = {0: _Process(), 1: _Process()}
    workers.restarts = {0: 0, 1: 0}
    workers.signals, workers.departure_deadline, workers.terminated = [], None, False
    workers._on_term(signal.SIGTERM, None)
    return workers


def test_a_launcher_whose_sidecar_cannot_be_asked_stops_its_workers_once_at_once():
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unused = s.getsockname()
    workers = _launcher(unused)
    workers._handle_signals()
    assert workers.stopping and workers.terminated
    time.sleep(0.05)
    workers._handle_signals()  # no second SIGTERM, no "departure timeout" after it
    assert [p.signals for p in workers.procs.values()] == [[signal.SIGTERM], [signal.SIGTERM]]
