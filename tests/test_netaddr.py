"""The address an agent advertises and the interface that holds it (etc_agent.utils.netaddr), with this
host's interfaces and routes replaced by fixed ones where the answer would depend on the machine."""

from __future__ import annotations

import socket

import pytest

from etc_agent.utils import netaddr
from etc_agent.utils.netaddr import Advertised, choose_advertised, interface_of, is_loopback, numeric

INTERFACES = {"lo": "127.0.0.1", "eth0": "10.0.0.2", "eth1": "192.168.5.9"}
"""The fixed interfaces of this host in the tests that replace them."""
OTHER_HOST = "198.51.100.7"
"""An address (TEST-NET-2) that no interface of this host holds."""


@pytest.fixture
def fixed_host(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This host with ``INTERFACES``; every route leaves from eth0. Returns the hosts routes were asked for."""
    asked: list[str] = []

    def route(host: str) -> str:
        asked.append(host)
        return "10.0.0.2"

    monkeypatch.setattr(netaddr, "interface_addresses", lambda: dict(INTERFACES))
    monkeypatch.setattr(netaddr, "source_address_towards", route)
    return asked


def resolver(names: dict[str, list[tuple[socket.AddressFamily, str]]]):
    """A getaddrinfo that knows ``names`` only (their addresses in the order given)."""

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(family, socket.SOCK_STREAM, 6, "", (addr, 0)) for family, addr in names[host]]

    return getaddrinfo


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("10.0.0.2", False),
        ("::ffff:10.0.0.2", False),
        ("node-a", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, expected: bool):
    assert is_loopback(host) is expected


def test_numeric_keeps_addresses_and_prefers_a_names_ipv4(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        resolver(
            {
                "node-a": [(socket.AF_INET6, "fd00::5"), (socket.AF_INET, "10.1.1.5")],
                "six": [(socket.AF_INET6, "fd00::6")],
            }
        ),
    )
    assert numeric("10.0.0.2") == "10.0.0.2"
    assert numeric("2001:DB8:0::1") == "2001:db8::1"
    assert numeric("localhost") == "127.0.0.1"
    assert numeric("node-a") == "10.1.1.5"
    assert numeric("six") == "fd00::6"
    with pytest.raises(OSError):
        numeric("nowhere")


def test_interface_of(fixed_host: list[str]):
    assert interface_of("10.0.0.2") == "eth0" and interface_of("192.168.5.9") == "eth1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("127.0.0.2") == "lo"  # any loopback address: the loopback interface
    assert interface_of(OTHER_HOST) is None


def test_interface_of_loopback_without_a_loopback_interface(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(netaddr, "interface_addresses", lambda: {"eth0": "10.0.0.2"})
    assert interface_of("127.0.0.1") is None


def test_a_loopback_rendezvous_advertises_loopback_on_this_hosts_lo():
    if "lo" not in netaddr.interface_addresses():
        pytest.skip("this host has no interface named lo")
    assert choose_advertised(None, "127.0.0.1") == Advertised("127.0.0.1", "lo", "loopback")
    assert choose_advertised(None, "localhost") == Advertised("127.0.0.1", "lo", "loopback")


def test_no_rendezvous_host_advertises_loopback(fixed_host: list[str]):
    assert choose_advertised(None, None) == Advertised("127.0.0.1", "lo", "loopback")
    assert fixed_host == []  # no route looked up


def test_a_remote_rendezvous_advertises_the_source_of_the_route_to_it(fixed_host: list[str]):
    assert choose_advertised(None, OTHER_HOST) == Advertised("10.0.0.2", "eth0", f"route to {OTHER_HOST}")
    assert fixed_host == [OTHER_HOST]


def test_no_route_to_the_rendezvous_is_one_line_naming_local_addr(monkeypatch: pytest.MonkeyPatch):
    def unreachable(host: str) -> str:
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(netaddr, "source_address_towards", unreachable)
    with pytest.raises(ValueError, match="no route .* rendezvous at 198.51.100.7 .*--local-addr") as err:
        choose_advertised(None, OTHER_HOST)
    assert "\n" not in str(err.value)


def test_local_addr_wins_and_is_resolved(fixed_host: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(socket, "getaddrinfo", resolver({"node-b": [(socket.AF_INET, "192.168.5.9")]}))
    assert choose_advertised("node-b", OTHER_HOST) == Advertised("192.168.5.9", "eth1", "--local-addr")
    assert choose_advertised("203.0.113.4", OTHER_HOST) == Advertised("203.0.113.4", None, "--local-addr")
    assert fixed_host == []  # the route to the rendezvous was not asked for


def test_a_local_addr_that_does_not_resolve_is_refused(fixed_host: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(socket, "getaddrinfo", resolver({}))
    with pytest.raises(ValueError, match="--local-addr nowhere: not an address"):
        choose_advertised("nowhere", OTHER_HOST)


@pytest.mark.parametrize("local_addr", ["127.0.0.1", "localhost", "127.0.1.1"])
def test_loopback_local_addr_to_a_rendezvous_on_another_host_is_refused(fixed_host: list[str], local_addr: str):
    with pytest.raises(
        ValueError, match=f"advertise 127\\.0\\.[01]\\.1 \\(--local-addr\\) to a rendezvous at {OTHER_HOST}"
    ):
        choose_advertised(local_addr, OTHER_HOST)
    with pytest.raises(ValueError, match="pass --local-addr with an address they reach"):
        choose_advertised(local_addr, OTHER_HOST)


def test_loopback_local_addr_to_a_rendezvous_on_this_host_is_allowed(
    fixed_host: list[str], monkeypatch: pytest.MonkeyPatch
):
    assert choose_advertised("127.0.0.1", "10.0.0.2") == Advertised("127.0.0.1", "lo", "--local-addr")
    assert choose_advertised("127.0.0.1", "127.0.0.1") == Advertised("127.0.0.1", "lo", "--local-addr")
    monkeypatch.setattr(socket, "getaddrinfo", resolver({"me": [(socket.AF_INET, "192.168.5.9")]}))
    assert choose_advertised("127.0.0.1", "me") == Advertised("127.0.0.1", "lo", "--local-addr")


def test_a_route_to_the_rendezvous_through_loopback_is_refused(monkeypatch: pytest.MonkeyPatch):
    """A name of another host that this host's routes send to loopback (an /etc/hosts entry, say)."""
    monkeypatch.setattr(netaddr, "interface_addresses", lambda: dict(INTERFACES))
    monkeypatch.setattr(netaddr, "source_address_towards", lambda host: "127.0.0.1")
    with pytest.raises(ValueError, match=f"advertise 127.0.0.1 \\(route to {OTHER_HOST}\\)"):
        choose_advertised(None, OTHER_HOST)
