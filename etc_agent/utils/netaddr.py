"""This host's address as its peers reach it, and the network interface that holds it.

An agent advertises one address: its peers dial it for the workers' store, the liveness probe and
the embedded store, and its workers' process groups bind to the interface that holds it. The
choice reads only this host's own sockets and interfaces, never the name service: a container or a
network namespace often has no name for itself (gloo's ``The hostname of the client socket cannot
be retrieved``), and a name that resolves to 127.0.1.1 sends every peer to itself.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's (primary) IPv4 address."""
_PROBE_PORT = 9
"""Any port will do: connecting a UDP socket sends nothing, it only picks the route's source."""


@dataclass(frozen=True)
class Advertised:
    """The address an agent gives its peers, and where it came from."""

    addr: str
    """A numeric IPv4 or IPv6 address."""
    interface: str | None
    """The interface of this host that holds ``addr`` (``None``: no interface holds it, e.g. an
    address translated on the way in); the workers' gloo / NCCL sockets bind to it."""
    source: str
    """How it was chosen, for the agent's log: ``--local-addr``, ``route to HOST``, ``loopback``."""


def is_loopback(host: str) -> bool:
    """``host`` names this host's loopback (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def numeric(host: str) -> str:
    """``host`` as a numeric address: itself when it is one, else its first IPv4 (then IPv6)
    address from the resolver (a name the user gave; this host's own name is never looked up)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if host == "localhost":
        return "127.0.0.1"
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def source_address_towards(host: str) -> str:
    """The source address this host's routing table gives packets to ``host``."""
    target = numeric(host)
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((target, _PROBE_PORT))
        return str(probe.getsockname()[0])


def interface_addresses() -> dict[str, str]:
    """Each IPv4 interface of this host -> its primary address (interfaces without one are left out)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_of(addr: str) -> str | None:
    """The interface of this host whose address is ``addr`` (loopback addresses: the loopback one)."""
    addresses = interface_addresses()
    for name, held in addresses.items():
        if held == addr:
            return name
    if is_loopback(addr):
        return next((name for name, held in addresses.items() if is_loopback(held)), None)
    return None


def _on_this_host(host: str) -> bool:
    """``host`` is this host (loopback, or an address one of its interfaces holds)."""
    if is_loopback(host):
        return True
    try:
        return interface_of(numeric(host)) is not None
    except OSError:
        return False


def choose_advertised(local_addr: str | None, rendezvous_host: str | None) -> Advertised:
    """The address this agent advertises: ``--local-addr`` when given, else the source address of
    the route to the rendezvous endpoint (127.0.0.1 when the rendezvous is on loopback).

    Raises ``ValueError`` (one line) where the peers could not use the result: an address on
    loopback while the rendezvous is on another host, or a ``--local-addr`` that does not resolve."""
    if local_addr:
        try:
            addr = numeric(local_addr)
        except OSError as e:
            raise ValueError(f"--local-addr {local_addr}: not an address, and the name does not resolve ({e})") from e
        source = "--local-addr"
    elif rendezvous_host is None or is_loopback(rendezvous_host):
        addr, source = "127.0.0.1", "loopback"
    else:
        try:
            addr = source_address_towards(rendezvous_host)
        except OSError as e:
            raise ValueError(
                f"no route from this host to the rendezvous at {rendezvous_host} ({e}); "
                "pass --local-addr with an address the other hosts reach"
            ) from e
        source = f"route to {rendezvous_host}"
    if is_loopback(addr) and rendezvous_host is not None and not _on_this_host(rendezvous_host):
        raise ValueError(
            f"this agent would advertise {addr} ({source}) to a rendezvous at {rendezvous_host}: other hosts "
            "cannot reach a loopback address; pass --local-addr with an address they reach"
        )
    return Advertised(addr=addr, interface=interface_of(addr), source=source)
