"""Who may say what on an agent's control channel (etc_agent.agent.controlauth), request by request."""

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
