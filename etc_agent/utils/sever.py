"""Shut this process's TCP connections to given hosts, so that whatever waits on them fails now.

A host cut off silently (packets dropped, no reset) leaves a gloo collective blocked on it until
the collective's timeout: gloo has no way to abort a group, and nothing arrives to end the wait.
``shutdown(2)`` on those sockets does: the blocked read sees the end of the stream at once, gloo
raises ``Connection closed by peer``, and the worker takes that as a peer failure and switches to
the next generation. The sockets are found through ``/proc`` (this process's descriptors, and the
kernel's table of TCP connections by inode); they are shut, never closed, so no descriptor that
gloo still owns is freed under it. Linux only (elsewhere nothing is shut).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path


def _address(hex_address: str) -> str:
    """An address of ``/proc/net/tcp[6]`` (hex, in the kernel's byte order) as text."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # Four 32-bit words, each in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    # ipaddress' text, as connections_to writes the hosts it looks for (inet_ntop differs on some).
    return str(address.ipv4_mapped or address)


def connections_to(hosts: Iterable[str], proc: Path = Path("/proc/self")) -> set[int]:
    """Inodes of the TCP sockets (in this network namespace) whose remote end is one of ``hosts``."""
    wanted = {str(ipaddress.ip_address(h)) for h in hosts}
    inodes: set[int] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote = _address(fields[2].split(":")[0])
            if remote in wanted and int(fields[9]):
                inodes.add(int(fields[9]))
    return inodes


def sever(hosts: Iterable[str]) -> int:
    """Shut (both ways) every TCP socket of this process connected to one of ``hosts``; returns how
    many. Sockets on loopback are never among them (a host is named by an address others reach)."""
    hosts = [h for h in hosts if not ipaddress.ip_address(h).is_loopback]
    if not hosts:
        return 0
    targets = connections_to(hosts)
    severed = 0
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in descriptors:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not (link.startswith("socket:[") and int(link[8:-1]) in targets):
            continue
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:
            continue  # closed since its link was read
        try:
            sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            pass  # already shut, or closed meanwhile
        finally:
            sock.detach()  # the descriptor stays gloo's
    return severed
