"""Shutting this process's TCP connections to given hosts (etc_agent.utils.sever): the kernel's
address encoding, a /proc table read from a directory of our own, and real sockets of this process."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from etc_agent.utils.netaddr import interface_addresses, is_loopback
from etc_agent.utils.sever import _address, connections_to, sever


@pytest.mark.parametrize(
    ("hex_address", "text"),
    [
        ("0100007F", "127.0.0.1"),  # IPv4: one little-endian word
        ("0202000A", "10.0.2.2"),
        ("00000000", "0.0.0.0"),
        ("00000000000000000000000001000000", "::1"),  # IPv6: four little-endian words
        ("B80D0120000000000000000001000000", "2001:db8::1"),
        ("000080FE00000000FF0200001B3A00FE", "fe80::2ff:fe00:3a1b"),
        ("0000000000000000FFFF00000100007F", "127.0.0.1"),  # IPv4-mapped IPv6: the IPv4 address
        ("0000000000000000FFFF00000264A8C0", "192.168.100.2"),
    ],
)
def test_proc_net_tcp_addresses_decode(hex_address: str, text: str):
    assert _address(hex_address) == text


def test_ipv6_addresses_decode_as_ipaddress_writes_them(tmp_path: Path):
    """connections_to compares with ipaddress' text of the hosts asked for, so both sides must agree
    (glibc's inet_ntop writes ::1.2.3.4 where ipaddress writes ::102:304)."""
    assert _address("00000000000000000000000004030201") == "::102:304"
    (tmp_path / "net").mkdir()
    line = "   0: B80D0120000000000000000002000000:9C44 00000000000000000000000004030201:0050 01 0:0 0:0 0 0 0 3003 1 0"
    (tmp_path / "net" / "tcp6").write_text("header\n" + line + "\n")
    assert connections_to(["::1.2.3.4"], tmp_path) == {3003}


TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0
   1: 0202000A:9C40 0302000A:0050 01 00000000:00000000 00:00000000 00000000     0        0 1002 1 0
   2: 0202000A:9C41 0302000A:0051 06 00000000:00000000 03:00000000 00000000     0        0 0 3 0
   3: 0202000A:9C42 0402000A:0050 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000202000A:9C43 0000000000000000FFFF00000302000A:0050 01 00000000:00000000 00:00000000 00000000     0        0 2001 1 0
   1: B80D0120000000000000000002000000:9C44 B80D0120000000000000000003000000:0050 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0
"""


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    return tmp_path


def test_connections_to_finds_the_sockets_by_remote_address_in_both_tables(proc: Path):
    # 1002 and the IPv4-mapped 2001 go to 10.0.2.3; 1003 goes elsewhere; the TIME_WAIT one has no inode.
    assert connections_to(["10.0.2.3"], proc) == {1002, 2001}
    assert connections_to(["10.0.2.4"], proc) == {1003}
    assert connections_to(["2001:DB8:0::3"], proc) == {2002}  # written another way: the same address
    assert connections_to(["10.0.2.3", "2001:db8::3"], proc) == {1002, 2001, 2002}
    assert connections_to(["10.0.2.9"], proc) == set() and connections_to([], proc) == set()


def test_connections_to_without_proc_tables_finds_nothing(tmp_path: Path):
    assert connections_to(["10.0.2.3"], tmp_path) == set()


def _external_ipv4() -> str:
    """An address of this host that is not loopback (the test is skipped without one)."""
    found = [addr for addr in interface_addresses().values() if not is_loopback(addr)]
    if not found:
        pytest.skip("this host has no IPv4 address besides loopback")
    return found[0]


def _blocked_reader(sock: socket.socket) -> tuple[threading.Thread, list[object]]:
    """A thread blocked in ``sock.recv``; what it got (bytes, or the error) lands in the list."""
    got: list[object] = []

    def read() -> None:
        try:
            got.append(sock.recv(1))
        except OSError as e:
            got.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, got


def test_sever_ends_a_read_blocked_on_a_host_and_leaves_the_descriptor_open():
    addr = _external_ipv4()
    with socket.create_server((addr, 0)) as server, socket.create_connection(server.getsockname(), timeout=5) as client:
        client.settimeout(None)
        accepted, _ = server.accept()
        with accepted:
            reader, got = _blocked_reader(client)
            assert sever(["127.0.0.1"]) == 0  # loopback is never severed
            reader.join(timeout=0.2)
            assert reader.is_alive() and not got
            assert sever([addr]) >= 1
            reader.join(timeout=2)
            assert not reader.is_alive(), "the read did not end"
            assert got == [b""] or isinstance(got[0], OSError), got
            assert client.fileno() >= 0
            os.fstat(client.fileno())  # shut, not closed: the descriptor is still ours


def test_sever_passes_over_a_socket_closed_while_it_looks(monkeypatch: pytest.MonkeyPatch):
    """A descriptor closed between reading its link and shutting it (another thread of the worker
    closed it) is skipped; the other connections to the host are still shut."""
    addr = _external_ipv4()
    with socket.create_server((addr, 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
        closing = str(client.fileno())
        real_readlink = os.readlink

        def readlink_then_close(path: str) -> str:
            link = real_readlink(path)
            if path.endswith(f"/fd/{closing}") and client.fileno() >= 0:
                client.close()
            return link

        monkeypatch.setattr(os, "readlink", readlink_then_close)
        with accepted:
            assert sever([addr]) == 1  # the accepted end; the client end was closed meanwhile
            assert client.fileno() == -1
            assert accepted.recv(1) == b""


def test_sever_leaves_loopback_connections_alone():
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname(), timeout=5) as client,
    ):
        accepted, _ = server.accept()
        with accepted:
            assert sever(["127.0.0.1", "::1"]) == 0
            client.sendall(b"x")
            assert accepted.recv(1) == b"x"


def test_sever_of_no_host_is_nothing():
    assert sever([]) == 0
