"""A cluster on one machine (``scripts/netlab.py``): hosts made of network namespaces, each with its
own address, one agent per host, a real etcd in namespaces of its own. Every scenario checks the
training state bitwise against an uninterrupted run.

Marked ``cluster``; skipped with the reason where the machine cannot make namespaces (not root, no
``ip`` / ``nft`` / ``tc``)."""

from __future__ import annotations

import uuid

import pytest
from elastic_demo import compare_states, json_line_event, reference_losses, run_scenario
from netlab import NetLab, unavailable

_WHY_NOT = unavailable()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network lab: {_WHY_NOT}")]

STEPS = 40


def _registered(lines: list[str]) -> dict:
    return next(e for line in lines if (e := json_line_event(line)) and e.get("event") == "registered")


def test_hosts_with_their_own_addresses_join_and_leave_live_with_local_addr_alone(tmp_path):
    """Three hosts, ``--local-addr`` alone (no GLOO_SOCKET_IFNAME or other interface variable): the
    agents advertise their hosts' addresses, the workers' groups bind to the hosts' interfaces, and
    a join and a planned leave migrate live; the final state is the uninterrupted run's, bitwise."""
    with NetLab(num_hosts=3, num_etcd=1) as lab:
        hosts = [(lab.prefix(name), lab.addr(name)) for name in ("h1", "h2", "h3")]
        rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", lab.etcd_endpoints, "--rdzv-id", uuid.uuid4().hex[:8]]
        result = run_scenario(
            "tp=1,pp=1,dp=auto",
            1,
            STEPS,
            0.1,
            tmp_path,
            echo=False,
            rdzv=rdzv,
            events=("join", "leave"),
            extra_script_args=["--elementwise"],
            hosts=hosts,
        )
        logs = result["cluster"].tail(40)
        assert result["codes"] == [0, 0, 0], f"agents exited {result['codes']}\n{logs}"
        for (_, addr), lines in zip(hosts, result["cluster"].outputs, strict=True):
            registered = _registered(lines)
            assert registered["host"] == addr and registered["interface"] == "eth0", registered
        records = sorted(result["migrations"], key=lambda m: m["generation"])
        assert [(r["old_world_size"], r["new_world_size"]) for r in records] == [(2, 3), (3, 2)], records
        assert records[0]["bytes_moved"] > 0, records  # the joining host got a replica over its link
        assert sorted(result["losses"]) == list(range(STEPS)), logs
        _, reference_state = reference_losses(STEPS, tmp_path, ["--elementwise"])
        assert compare_states(result["state_file"], reference_state) == [], logs
