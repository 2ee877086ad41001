"""A fork server: one process imports what every worker needs once, then forks ready workers.

A Python worker spends 3-6 s of CPU importing torch, ``torch.distributed``, DTensor and dynamo before
the first line of its script runs. On a node that starts eight of them, restarts a crashed one or
warms up to join, that import is the time to full strength, and on a small machine the imports of
several workers compete for the same cores. The server (``python -u -m etc_agent.worker.forkserver``,
started by the agent with ``--start-method forkserver``, the default) pays it once per agent; a
forked worker runs its script within milliseconds.

The worker a fork makes is what ``python -u ARGV...`` would be: its own session (process group),
the environment, working directory, stdout and stderr the agent gives it, ``sys.argv`` and
``sys.path[0]`` as the interpreter sets them, fresh random seeds, Python's default signal
handlers, and an exit the way the interpreter exits (non-daemon threads joined, ``atexit`` handlers
run, the code of ``SystemExit``, 1 and a traceback for an uncaught exception). It dies with the
server (``PR_SET_PDEATHSIG``), which dies with its agent. What differs from a fresh interpreter:
the modules the server imported are already imported (with the environment the server started
with: the agent's, which is every worker's less its rank variables), and ``/proc/PID/cmdline``
shows the server's command (``comm``, what ``ps -o comm``/``top`` show, is the script's name).

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one JSON object per packet, file descriptors as
``SCM_RIGHTS``), all messages small except a spawn's environment:

- server -> client: ``{"op": "ready", "pid", "preload_s"}`` once the imports are done, or
  ``{"op": "failed", "error"}`` (the server then exits);
- client -> server: ``{"op": "spawn", "id", "argv", "env", "cwd", "fds": ["stdout"?, "stderr"?,
  "env:VARIABLE"...], "name"}`` with the named descriptors attached (a stream not named is inherited
  from the server; an ``env:`` one stays open in the worker, its number in that variable);
- server -> client: ``{"op": "spawned", "id", "pid"}`` or ``{"op": "spawn_failed", "id", "error"}``,
  then ``{"op": "exited", "pid", "code"}`` when it reaped the process (``code`` as
  :mod:`subprocess` reports it: negative for a signal);
- client -> server: ``{"op": "cancel", "id", "signal"}`` for a spawn whose pid the client does not
  know yet (a stop while the server still imports): a spawn not forked yet is dropped (the server
  reads every queued message before it forks), one already forked gets ``signal``. The client counts
  the process as ended when it sends this; the server sends nothing back for a dropped spawn.

The client closing its end stops the server. This module imports nothing heavy: the server's
preload is the caller's.
"""

from __future__ import annotations

import array
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

MAX_MESSAGE = 1 << 20
"""Bytes of one packet (a spawn carries the worker's whole environment)."""
MAX_FDS = 4
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"fork server message of {len(data)} bytes (at most {MAX_MESSAGE})")
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def receive(sock: socket.socket, wait: bool = True) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors it carried; ``(None, [])`` once the other end closed.
    ``wait=False``: raise :class:`BlockingIOError` when no message is there."""
    data, ancdata, _flags, _addr = sock.recvmsg(
        MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize), 0 if wait else socket.MSG_DONTWAIT
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - (len(payload) % received.itemsize)])
            fds.extend(received)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def _prctl(option: int, value: int | bytes) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """What ``ps -o comm`` and ``top`` show for this process (15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def serve(sock: socket.socket, preload: Callable[[], None]) -> int:
    """The server's life: import (``preload``), say ready, fork on request, report every exit.
    Returns when the client closed its end (the exit code for the server process)."""
    started = time.monotonic()
    try:
        preload()
    except BaseException as err:  # noqa: BLE001 - any failure to import is reported, the agent falls back
        send(sock, {"op": "failed", "error": f"{type(err).__name__}: {err}"})
        return 1
    # What the imports made lives as long as the process: out of every later collection (a
    # worker's full collection at a generation switch walked ~280k objects of torch's modules).
    gc.freeze()
    # SIGCHLD wakes the select at once (a crash reported without a polling delay).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    try:
        send(sock, {"op": "ready", "pid": os.getpid(), "preload_s": round(time.monotonic() - started, 3)})
    except OSError:
        return 0  # the agent is gone (it exited while this process imported)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, int] = {}
    """pid -> spawn id, of every child not reaped yet."""
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is sock:
                if not _handle_requests(sock, children, (wake_r, wake_w)):
                    return 0
            else:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
        _reap(sock, children)


def _handle_requests(sock: socket.socket, children: dict[int, int], wake: tuple[int, int]) -> bool:
    """Every message queued on the socket, cancels first (a spawn cancelled before its fork never
    runs); False once the client closed its end."""
    batch = [receive(sock)]
    while batch[-1][0] is not None:
        try:
            batch.append(receive(sock, wait=False))
        except BlockingIOError:
            break
    cancels = {m["id"]: m.get("signal", signal.SIGTERM) for m, _ in batch if m is not None and m.get("op") == "cancel"}
    for pid, spawn_id in list(children.items()):
        if spawn_id in cancels:
            try:
                os.kill(pid, cancels[spawn_id])
            except ProcessLookupError:
                pass
    for message, fds in batch:
        if message is None:
            return False
        if message.get("op") != "spawn":
            continue
        if message["id"] in cancels:
            for fd in fds:
                os.close(fd)
            continue
        _spawn(sock, message, fds, children, wake)
    return True


def _reap(sock: socket.socket, children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.pop(pid, None)
        send(sock, {"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _spawn(
    sock: socket.socket, message: dict[str, Any], fds: list[int], children: dict[int, int], wake: tuple[int, int]
) -> None:
    streams = dict(zip(message.get("fds", []), fds))
    server_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError as err:
        send(sock, {"op": "spawn_failed", "id": message["id"], "error": str(err)})
    else:
        if pid == 0:
            _child(message, streams, server_pid, [sock.fileno(), *wake])  # never returns
        children[pid] = message["id"]
        send(sock, {"op": "spawned", "id": message["id"], "pid": pid})
    finally:
        for fd in fds:
            os.close(fd)


def _child(message: dict[str, Any], streams: dict[str, int], server_pid: int, server_fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()  # its own process group, as Popen(start_new_session=True): stopping it stops its children
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server_pid:  # the server died between the fork and the prctl
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for fd in server_fds:
            os.close(fd)
        for name, target in (("stdout", 1), ("stderr", 2)):
            if name in streams:
                os.dup2(streams[name], target)
                os.close(streams[name])
        set_process_name(message.get("name", "worker"))
        # The interpreter's own handlers, not the server's.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        for name, fd in streams.items():
            if name.startswith("env:"):
                os.environ[name[len("env:") :]] = str(fd)
        _reseed()
        code = run_as_main(message["argv"])
    except BaseException:  # noqa: BLE001 - whatever happened, this process must not return into the server's loop
        traceback.print_exc()
    finally:
        os._exit(code)


def _reseed() -> None:
    """Fresh seeds where a new interpreter would have them (``random`` reseeds itself at fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def run_as_main(argv: list[str]) -> int:
    """``python -u ARGV`` in this process: the script or ``-m`` module as ``__main__``; the exit code
    (a forked worker's life, and the test suite's forked reference runs)."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        if argv[0] == "-m":
            # A module the server preloaded runs again as __main__ (its imports are cached): runpy
            # would warn that it is in sys.modules already.
            sys.modules.pop(argv[1], None)
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour for an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at interpreter exit
        atexit._run_exitfuncs()
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # killed by a signal, as the interpreter reports KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
