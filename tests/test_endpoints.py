"""--rdzv-endpoint as read: several etcd members checked when the options are built
(etc_agent.rendezvous.etcd.EtcdOptions), and the host the agent routes towards
(etc_agent.cli.rdzv.Rendezvous.first_host)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from etc_agent.cli.rdzv import Rendezvous
from etc_agent.rendezvous.etcd import EtcdOptions


@pytest.mark.parametrize(
    ("endpoint", "members"),
    [
        ("10.0.0.1:2379", [("10.0.0.1", 2379)]),
        ("etcd-0:2379,etcd-1:2380", [("etcd-0", 2379), ("etcd-1", 2380)]),
        (
            "http://10.0.0.1:2379, https://10.0.0.2:2379/ ,10.0.0.3:2379",
            [("10.0.0.1", 2379), ("10.0.0.2", 2379), ("10.0.0.3", 2379)],
        ),
        ("[::1]:2379,http://[fd00::2]:2379/", [("::1", 2379), ("fd00::2", 2379)]),
        ("etcd:2379,etcd:2380", [("etcd", 2379), ("etcd", 2380)]),  # one host, two ports: two members
    ],
)
def test_comma_separated_endpoints_parse_in_order(endpoint: str, members: list[tuple[str, int]]):
    options = EtcdOptions(endpoint=endpoint)
    assert options.host_ports() == members
    assert options.endpoint == endpoint  # kept as given


@pytest.mark.parametrize(
    ("endpoint", "named"),
    [
        ("10.0.0.1:2379,10.0.0.1:2379", "10.0.0.1:2379 is given twice"),
        ("http://etcd:2379,etcd:2379", "etcd:2379 is given twice"),
        ("[::1]:2379, [::1]:2379", "::1:2379 is given twice"),
        ("etcd-0:2379,etcd-1", "'etcd-1'"),
        ("etcd-0", "'etcd-0'"),
        ("etcd-0:port", "'etcd-0:port'"),
        (":2379", "':2379'"),
        ("etcd-0:2379,", "''"),
        ("etcd-0:2379,,etcd-1:2379", "''"),
        ("etcd-0:-1", "'etcd-0:-1'"),
        ("etcd-0:0", "'etcd-0:0'"),
        ("etcd-0:65536", "'etcd-0:65536'"),
        ("etcd-0:²", "'etcd-0:²'"),
    ],
)
def test_duplicate_and_malformed_endpoints_are_refused_by_name(endpoint: str, named: str):
    with pytest.raises(ValidationError) as err:
        EtcdOptions(endpoint=endpoint)
    [error] = err.value.errors()
    assert error["loc"] == ("endpoint",) and named in error["msg"], error  # the message, not the input echoed


def test_the_highest_port_is_an_endpoint():
    assert EtcdOptions(endpoint="etcd:65535").host_ports() == [("etcd", 65535)]


def rendezvous(endpoint: str) -> Rendezvous:
    return Rendezvous("etcd-v3", endpoint, "run", {})


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("10.0.0.1:2379", "10.0.0.1"),
        ("etcd-0:2379,etcd-1:2379", "etcd-0"),
        (" http://10.0.0.5:2379/ , 10.0.0.6:2379", "10.0.0.5"),
        ("https://[fd00::1]:2379,10.0.0.2:2379", "fd00::1"),
        ("[::1]:29400", "::1"),
        ("node0", "node0"),
        ("", None),
        (":29400", None),
    ],
)
def test_first_host(endpoint: str, host: str | None):
    assert rendezvous(endpoint).first_host == host
