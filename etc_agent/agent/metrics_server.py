"""The read-only HTTP endpoint of an agent's metrics (``etcrun --metrics-port``).

It answers ``GET /metrics`` with the Prometheus text format and nothing else: any other path is a
404, any other method a 405, a request it cannot parse a 400, and no request changes anything. One
thread serves every connection (an asyncio loop of its own), so a flood of connections costs the
agent no threads: at most :data:`MAX_OPEN` connections are open at once (a new one past the bound
takes the place of the oldest that has not sent its request yet, so idle connections cannot keep a
scraper out; where none is idle, the new one is closed), each has :data:`READ_TIMEOUT_S` to send
its request line and headers (a scraper sends them as it connects; an idle connection is dropped),
a line longer than :data:`MAX_LINE` ends it, and a request body is never read. A scraper's request
is answered as soon as it arrives, whatever the flood's other connections do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("etc_agent.agent")

METRICS_PATH = "/metrics"
MAX_OPEN = 256
READ_TIMEOUT_S = 1.0
MAX_LINE = 8192
MAX_HEADERS = 64
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


def answer(request_line: bytes) -> tuple[int, bytes | None]:
    """The status of a request line and whether it gets the metrics (``None`` body: the metrics)."""
    parts = request_line.decode("latin-1").strip().split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return 400, b"bad request\n"
    method, path = parts[0], parts[1].split("?", 1)[0]
    if method != "GET":
        return (405 if method in KNOWN_METHODS else 501), f"read-only: only GET {METRICS_PATH}\n".encode()
    if path != METRICS_PATH:
        return 404, f"only {METRICS_PATH} is served here\n".encode()
    return 200, None


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 501: "Not Implemented"}


class MetricsServer:
    """Serve ``exposition()`` on ``addr:port`` from a daemon thread until :meth:`close`."""

    def __init__(self, addr: str, port: int, exposition: Callable[[], bytes]):
        self.exposition = exposition
        self.num_open = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._reading: dict[asyncio.StreamWriter, None] = {}
        """Open connections whose request is not read yet, oldest first (the ones a new one may evict)."""
        self._evicted: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(addr, port, started, failure), name="etc-agent-metrics", daemon=True
        )
        self._thread.start()
        started.wait()
        if failure:
            err = failure[0]
            detail = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise ValueError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {detail}")
        assert self._server is not None
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _run(self, addr: str, port: int, started: threading.Event, failure: list[BaseException]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, addr, port, limit=MAX_LINE, backlog=128)
            )
        except OSError as err:
            failure.append(err)
            started.set()
            return
        started.set()
        self._loop.run_forever()
        self._loop.close()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Count a new connection in, evicting the oldest idle one at the bound; False: no room."""
        if self.num_open >= MAX_OPEN:
            if not self._reading:
                return False
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            self._evicted.add(oldest)
            self.num_open -= 1
            oldest.close()
        self.num_open += 1
        self._writers.add(writer)
        self._reading[writer] = None
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.close()
            return
        try:
            status, body = await asyncio.wait_for(self._read(reader), READ_TIMEOUT_S)
            self._reading.pop(writer, None)
            if writer in self._evicted:
                return
            if body is None:
                body = self.exposition()
                headers = f"Content-Type: {CONTENT_TYPE_LATEST}\r\n"
            else:
                headers = "Content-Type: text/plain; charset=utf-8\r\n" + ("Allow: GET\r\n" if status == 405 else "")
            head = f"HTTP/1.0 {status} {REASONS[status]}\r\n{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S * 5)
        except (TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            pass  # idle, too long, cut short or gone: dropped
        except Exception:  # a bug here must not end the loop that serves the next scrape
            log.exception("metrics request failed")
        finally:
            self._reading.pop(writer, None)
            if writer in self._evicted:
                self._evicted.discard(writer)  # counted out when it was evicted
            else:
                self.num_open -= 1
            self._writers.discard(writer)
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes | None]:
        """The request line's answer, once the headers are read (never a body)."""
        request_line = await reader.readline()
        for _ in range(MAX_HEADERS):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                return answer(request_line)
        return 400, b"too many headers\n"

    def close(self) -> None:
        """Stop listening, drop every open connection, end the thread."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(timeout=5)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await asyncio.sleep(0.05)  # the transports' closing callbacks run
        asyncio.get_running_loop().stop()
