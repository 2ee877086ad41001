"""A tiny request/reply protocol over TCP: one JSON object per line each way.

Used by the embedded membership store and by the agent's control channel to its workers.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError

Handler = Callable[[Any], dict[str, Any]]
MAX_REQUEST_BYTES = 16 << 20
"""A request line longer than this is refused (a confused or hostile client cannot exhaust memory)."""


def describe_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where + ': ' if where else ''}{first.get('msg')}"


class _RequestHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        handler: Handler = self.server.handler  # type: ignore[attr-defined]
        schema: TypeAdapter | None = self.server.schema  # type: ignore[attr-defined]
        try:  # one request per connection
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError:  # the client went away (a worker killed mid-request)
            return
        if not line:
            return
        try:
            if len(line) > MAX_REQUEST_BYTES:
                raise ValueError(f"request longer than {MAX_REQUEST_BYTES} bytes")
            req = json.loads(line)
            if schema is not None:
                req = schema.validate_python(req)
            reply = handler(req)
        except ValidationError as err:
            reply = {"error": f"invalid request: {describe_validation_error(err)}"}
        except Exception as err:  # noqa: BLE001 - reported to the client, never kills the server
            reply = {"error": f"{type(err).__name__}: {err}"}
        try:
            self.wfile.write((json.dumps(reply) + "\n").encode())
            self.wfile.flush()
        except OSError:
            return
        held = self.server.on_held  # type: ignore[attr-defined]
        if reply.get("hold") and held is not None:
            # The client keeps this connection open for as long as it lives; the callback blocks
            # until it closes (the client exited, or the server side shut it down).
            held(req, self.connection, self.rfile)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class JsonLineServer:
    """Serve ``handler`` on ``host:port`` (port 0: a free one) in a background thread until :meth:`stop`.

    With ``schema`` (a pydantic ``TypeAdapter``, typically of a union discriminated by ``op``) every
    request is validated first and the handler gets the model; invalid ones get an error reply.
    A reply with ``"hold": true`` keeps the connection: ``on_held(request, socket, reader)`` runs in
    the connection's thread until the client closes it (a liveness signal that needs no polling).
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "jsonline",
        schema: TypeAdapter | None = None,
        on_held: Callable[[Any, socket.socket, Any], None] | None = None,
    ):
        self.server = _Server((host, port), _RequestHandler)
        self.server.handler = handler  # type: ignore[attr-defined]
        self.server.schema = schema  # type: ignore[attr-defined]
        self.server.on_held = on_held  # type: ignore[attr-defined]
        self.host, self.port = self.server.server_address[:2]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, name=name, daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class JsonLineError(RuntimeError):
    """The server could not be reached, or it answered with an error."""


def request(address: tuple[str, int], req: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request on a fresh connection and return the reply."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.sendall((json.dumps(req) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except OSError as err:
        raise JsonLineError(f"cannot reach {address[0]}:{address[1]}: {err}") from err
    if not data:
        raise JsonLineError(f"{address[0]}:{address[1]} closed the connection without a reply")
    reply = json.loads(data)
    if "error" in reply:
        raise JsonLineError(reply["error"])
    return reply


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {text!r}: expected host:port")
    return host or "127.0.0.1", int(port)
