"""The control plane with many agents: 32 real ``etcrun`` agents (one sleeping worker each) against
a real etcd; a node's SIGKILL and a join are seen by every agent (``scripts/bench_control_plane.py``
measures 16 to 64 with the same scenario helper)."""

from __future__ import annotations

import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from bench_control_plane import Fleet

NUM_AGENTS = 32


def test_control_plane_of_32_agents_sees_a_kill_and_a_join(etcd_server, tmp_path):
    """All 32 see one running generation of all of them; a non-leader node SIGKILLed (agent and
    worker): the 31 survivors each see a generation without it; one more agent starts: all 32 see
    the generation with it. Every wait names the agents that did not see it."""
    fleet = Fleet(etcd_server.endpoint, tmp_path, max_nodes=NUM_AGENTS + 1, lease_ttl=5.0)
    try:
        started = time.time()
        fleet.start(NUM_AGENTS)
        assert len(fleet.wait_all_see(NUM_AGENTS, started, timeout=240)) == NUM_AGENTS
        leader = fleet.leader()
        assert leader is not None
        victim = next(i for i in fleet.alive() if i != leader)
        killed_at = fleet.kill(victim)
        seen = fleet.wait_all_see(NUM_AGENTS - 1, killed_at, timeout=60)
        assert sorted(seen) == sorted(fleet.alive()) and victim not in seen
        joined_at = time.time()
        [newcomer] = fleet.start(1)
        seen = fleet.wait_all_see(NUM_AGENTS, joined_at, timeout=120)
        assert newcomer in seen and len(seen) == NUM_AGENTS
    finally:
        fleet.stop()
