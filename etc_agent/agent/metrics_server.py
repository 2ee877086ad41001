"""The read-only HTTP endpoint of an agent's metrics (``etcrun --metrics-port``).

It answers ``GET /metrics`` with the Prometheus text format and nothing else: any other path is a
404, any other method a 405, and no request changes anything. A flood cannot hold it or the agent:
at most :data:`MAX_CONCURRENT` connections are served at once and at most :data:`MAX_WAITING` more
wait up to :data:`SLOT_WAIT_S` for a turn (the rest get a 503 and are closed at once), each has
:data:`READ_TIMEOUT_S` to send its request line and headers (a scraper sends them as soon as it
connects; an idle connection gives its turn up quickly), and a request body is never read. Its
threads are daemons: the agent's exit does not wait for a slow scraper.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("etc_agent.agent")

METRICS_PATH = "/metrics"
MAX_CONCURRENT = 8
MAX_WAITING = 16
SLOT_WAIT_S = 2.0
READ_TIMEOUT_S = 1.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], exposition: Callable[[], bytes]):
        self.exposition = exposition
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self.waiting = threading.BoundedSemaphore(MAX_WAITING)
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        # Through the agent's log (one JSON line in json mode), not socketserver's print to stderr.
        log.exception("metrics request from %s failed", client_address[0])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = READ_TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after the answer

    def handle(self) -> None:
        if not self._turn():
            self._refuse_busy()
            return
        try:
            super().handle()
        except (OSError, TimeoutError):
            pass  # a client that went away or never finished its request
        finally:
            self.server.slots.release()

    def _turn(self) -> bool:
        """A slot at once, or after a bounded wait among a bounded number of waiters."""
        server = self.server
        if server.slots.acquire(blocking=False):
            return True
        if not server.waiting.acquire(blocking=False):
            return False
        try:
            return server.slots.acquire(timeout=SLOT_WAIT_S)
        finally:
            server.waiting.release()

    def _refuse_busy(self) -> None:
        try:
            self.wfile.write(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != METRICS_PATH:
            self._plain(404, f"only {METRICS_PATH} is served here\n")
            return
        body = self.server.exposition()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_allowed(self) -> None:
        self._plain(405, f"read-only: only GET {METRICS_PATH}\n", allow=True)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _plain(self, code: int, text: str, allow: bool = False) -> None:
        body = text.encode()
        self.send_response(code)
        if allow:
            self.send_header("Allow", "GET")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        log.debug("metrics %s: " + format, self.client_address[0], *args)


class MetricsServer:
    """Serve ``exposition()`` on ``addr:port`` from a daemon thread until :meth:`close`."""

    def __init__(self, addr: str, port: int, exposition: Callable[[], bytes]):
        try:
            self._server = _Server((addr, port), exposition)
        except OSError as err:
            raise ValueError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {err.strerror or err}") from None
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="etc-agent-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
