"""A tiny authenticated request/reply protocol over TCP: one JSON object per line each way.

Used by the embedded membership store and by the agent's control channel to its workers. Every
connection carries one request (a held connection carries one, then stays open as a liveness
signal)::

    server -> {"challenge": "<32 hex>"}
    client -> <key id> <hmac of (challenge, request)> <request JSON>
    server -> <hmac of ("reply", challenge, reply)> <reply JSON>     ("-" instead: refused, unsigned)

The server looks the key up by its id (:data:`~etc_agent.utils.auth.KeyLookup`) and checks the MAC
before it parses anything; a wrong or missing one gets one error reply and a log line. Resources are
bounded: a fixed number of connections at a time (more are closed at once), a deadline for the
request line, a maximum request size.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from etc_agent.utils.auth import Key, KeyLookup, challenge

log = logging.getLogger("etc_agent.auth")

Handler = Callable[[Any, str], dict[str, Any]]
"""``handler(request, key_id)``: the validated request and the id of the key it was signed with."""
CHALLENGE_LINE_MAX = 256
REFUSAL_LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class ServerLimits:
    """What one server may hold at a time, whatever its clients do."""

    max_connections: int = 128
    """Open connections at once (held ones and long polls included); more are closed on accept."""
    max_request_bytes: int = 1 << 20
    """A longer request line is refused without being read further."""
    request_timeout_s: float = 10.0
    """A client must send its whole request line within this many seconds of connecting."""
    backlog: int = 128
    """Pending connections the kernel queues before the server accepts them."""


def describe_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where + ': ' if where else ''}{first.get('msg')}"


class _RequestTooLong(ValueError):
    pass


def _read_line(sock: socket.socket, limit: int, deadline: float, buffer: bytearray) -> bytes:
    """One line (without its newline) within ``limit`` bytes and by ``deadline``; b"" if the peer closed."""
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            return line
        if len(buffer) > limit:
            raise _RequestTooLong(f"request longer than {limit} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete request line in time")
        sock.settimeout(left)
        chunk = sock.recv(min(1 << 16, limit + 1 - len(buffer)) or 1)
        if not chunk:
            return b""
        buffer += chunk


class _Refusals:
    """Refused requests, logged at most once per interval with how many there were."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._count = 0
        self._last = 0.0

    def note(self, peer: str, why: str) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < REFUSAL_LOG_INTERVAL_S:
                return
            count, self._count, self._last = self._count, 0, now
        log.warning("%s: refused %d request(s), the last from %s: %s", self.name, count, peer, why)


class JsonLineServer:
    """Serve ``handler`` on ``host:port`` (port 0: a free one) in background threads until :meth:`stop`.

    With ``schema`` (a pydantic ``TypeAdapter``, typically of a union discriminated by ``op``) every
    request is validated first and the handler gets the model; invalid ones get an error reply.
    Only requests signed with a key ``keys`` knows reach the handler. A reply with ``"hold": true``
    keeps the connection: ``on_held(request, socket, reader)`` runs in the connection's thread until
    the client closes it (a liveness signal that needs no polling).
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "jsonline",
        schema: TypeAdapter | None = None,
        on_held: Callable[[Any, socket.socket, Any], None] | None = None,
        *,
        keys: KeyLookup,
        limits: ServerLimits | None = None,
    ):
        limits = limits or ServerLimits()
        self.handler, self.schema, self.on_held, self.keys, self.limits = handler, schema, on_held, keys, limits
        self.name = name
        self._sock = socket.create_server((host, port), backlog=limits.backlog, reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._refusals = _Refusals(name)
        self._stopped = threading.Event()
        self._open: set[socket.socket] = set()
        self._pending: dict[socket.socket, float] = {}
        """Open connections that have not sent their request line yet, and since when."""
        self._open_lock = threading.Lock()
        self.num_rejected_busy = 0
        self.num_evicted = 0
        self.thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def num_open(self) -> int:
        with self._open_lock:
            return len(self._open)

    def _accept_loop(self) -> None:
        # ``stop`` shuts the socket down, which wakes the accept; the timeout only bounds a stop missed.
        self._sock.settimeout(1.0)
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.01)  # out of file descriptors: let connections close
                continue
            if not self._slots.acquire(blocking=False):
                # Every slot taken: the connection waiting longest for its request line gives way (a
                # client of the job sends its request at once; one that idles is not one of ours).
                self._evict_oldest_pending()
                if not self._slots.acquire(timeout=0.5):
                    self.num_rejected_busy += 1
                    self._refusals.note(f"{peer[0]}:{peer[1]}", f"{self.limits.max_connections} connections open")
                    conn.close()
                    continue
            with self._open_lock:
                self._open.add(conn)
                self._pending[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn, peer), name=f"{self.name}-conn", daemon=True).start()

    def _evict_oldest_pending(self) -> None:
        with self._open_lock:
            if not self._pending:
                return
            oldest = min(self._pending, key=self._pending.__getitem__)
            del self._pending[oldest]
        self.num_evicted += 1
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread sees the end and frees the slot
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            self._exchange(conn, f"{peer[0]}:{peer[1]}")
        except (OSError, TimeoutError):
            pass  # the client went away (a worker killed mid-request) or was too slow
        finally:
            with self._open_lock:
                self._open.discard(conn)
                self._pending.pop(conn, None)
            conn.close()
            self._slots.release()

    def _exchange(self, conn: socket.socket, peer: str) -> None:
        nonce = challenge()
        conn.sendall(b'{"challenge": "' + nonce + b'"}\n')
        buffer = bytearray()
        deadline = time.monotonic() + self.limits.request_timeout_s
        try:
            line = _read_line(conn, self.limits.max_request_bytes, deadline, buffer)
        except _RequestTooLong as err:
            conn.sendall(b"- " + json.dumps({"error": str(err)}).encode() + b"\n")
            return
        finally:
            with self._open_lock:
                self._pending.pop(conn, None)
        if not line:
            return
        key_id, mac, body = (line.split(b" ", 2) + [b"", b""])[:3]
        key = self.keys(key_id.decode(errors="replace")) if key_id else None
        if key is None or not key.verify(mac.decode(errors="replace"), nonce, body):
            why = "unknown key" if key is None else "bad signature"
            self._refusals.note(peer, why)
            conn.sendall(b"- " + json.dumps({"error": f"unauthenticated: {why}", "refused": True}).encode() + b"\n")
            return
        req = None
        try:
            req = json.loads(body)
            if self.schema is not None:
                req = self.schema.validate_python(req)
            reply = self.handler(req, key.id)
        except ValidationError as err:
            reply = {"error": f"invalid request: {describe_validation_error(err)}"}
        except Exception as err:  # noqa: BLE001 - reported to the client, never kills the server
            reply = {"error": f"{type(err).__name__}: {err}"}
        out = json.dumps(reply).encode()
        conn.settimeout(self.limits.request_timeout_s)
        conn.sendall(key.sign(b"reply", nonce, out).encode() + b" " + out + b"\n")
        if reply.get("hold") and self.on_held is not None:
            # The client keeps this connection open for as long as it lives; the callback blocks
            # until it closes (the client exited, or the server side shut it down).
            conn.settimeout(None)
            self.on_held(req, conn, conn.makefile("rb"))

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._open_lock:
            open_now = list(self._open)
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(1.0)


class JsonLineError(RuntimeError):
    """The server could not be reached, or it answered with an error."""


class Unauthenticated(JsonLineError):
    """The server refused the request's key or signature."""


def _exchange_client(sock: socket.socket, address: tuple[str, int], req: dict[str, Any], key: Key) -> dict[str, Any]:
    where = f"{address[0]}:{address[1]}"
    buffer = bytearray()
    deadline = time.monotonic() + (sock.gettimeout() or 3600)
    first = _read_line(sock, CHALLENGE_LINE_MAX, deadline, buffer)
    try:
        nonce = json.loads(first)["challenge"].encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise JsonLineError(f"{where} does not speak this protocol (no challenge)") from None
    body = json.dumps(req).encode()
    sock.sendall(key.id.encode() + b" " + key.sign(nonce, body).encode() + b" " + body + b"\n")
    line = _read_line(sock, 1 << 30, deadline, buffer)
    if not line:
        raise JsonLineError(f"{where} closed the connection without a reply")
    mac, _, out = line.partition(b" ")
    if mac == b"-":
        reply = json.loads(out)
        if reply.get("refused"):
            raise Unauthenticated(f"{where}: {reply['error']}")
        raise JsonLineError(reply.get("error", "refused"))
    if not key.verify(mac.decode(errors="replace"), b"reply", nonce, out):
        raise Unauthenticated(f"{where}: the reply is not signed with this job's key")
    reply = json.loads(out)
    if "error" in reply:
        raise JsonLineError(reply["error"])
    return reply


def request(
    address: tuple[str, int],
    req: dict[str, Any],
    timeout: float,
    key: Key,
    on_connect: Callable[[socket.socket], None] | None = None,
) -> dict[str, Any]:
    """Send one request on a fresh connection and return the reply. ``on_connect(socket)`` is called
    once connected (a caller that may have to end a held request shuts that socket down)."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            if on_connect is not None:
                on_connect(sock)
            return _exchange_client(sock, address, req, key)
    except (OSError, TimeoutError) as err:
        raise JsonLineError(f"cannot reach {address[0]}:{address[1]}: {err}") from err


def hold(address: tuple[str, int], req: dict[str, Any], timeout: float, key: Key) -> tuple[socket.socket, dict]:
    """Send one request whose reply keeps the connection (``"hold": true``); the open socket and the reply."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        reply = _exchange_client(sock, address, req, key)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, reply


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {text!r}: expected host:port")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {text!r}: port {port} is not in 0-65535")
    return host or "127.0.0.1", int(port)
