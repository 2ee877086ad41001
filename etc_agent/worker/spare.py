"""A warm spare worker: a process of the script that waits, without a rank, to replace a crashed one.

An agent whose workers use the worker API keeps one spare process besides them (``etcrun
--spare-worker``, :mod:`etc_agent.agent.spares`). It is started like a worker (forked from the fork
server: torch imported), runs the script from the top like one, and stops in ``etc_agent.init()``,
the first point where a worker needs its rank: it never says hello, never joins a
group, and holds no state. There it says ``ready`` on a socket whose other end only its agent
holds (``ETC_AGENT_SPARE_FD``) and reads its adoption from it: one JSON line,
:class:`~etc_agent.protocol.control.SpareAdoption`, with the whole environment a worker started for
that local rank would have had (rank variables, the control channel's key). It takes
that environment and goes on as that worker: hello, assignment, state from a replica. An agent
that no longer needs it closes the socket; the spare then exits 0 without a word.

What the script runs before ``etc_agent.init()`` must not need the rank (``LOCAL_RANK``, ``RANK``
are unset in a spare): a spare that exits before its adoption is noticed by its agent, which then
keeps none for the rest of the run and says why.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from etc_agent.migrate.executor import warm_migration
from etc_agent.protocol.control import SpareAdoption
from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.forkserver import set_process_name
from etc_agent.worker.groups import destroy_all_groups


def read_adoption(fd: int) -> SpareAdoption | None:
    """Say ``ready`` on the channel, then block until the agent adopts this spare (None: it let the
    spare go, or died)."""
    received = bytearray()
    with socket.socket(fileno=fd) as channel:
        try:
            channel.sendall(b"ready\n")
        except OSError:
            pass  # adopted before it was ready: the agent wrote the adoption and closed its end
        try:
            while not received.endswith(b"\n"):
                chunk = channel.recv(1 << 16)
                if not chunk:
                    break
                received += chunk
        except OSError:
            return None
    if not received.endswith(b"\n"):
        return None
    return SpareAdoption.model_validate_json(bytes(received))


def warm_up() -> None:
    """Pay the first-use costs of a worker's first switch while nothing waits for this process: a
    gloo group, a device mesh, tensor-parallel DTensor modules, their forward, backward and an
    optimizer step, all on a one-process group of its own, then everything of it dropped (torch's
    group registry and DTensor's cache as a fresh process has them); and a first migration plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("spare_warm_up",))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        optim = torch.optim.AdamW(model.parameters(), foreach=False)
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
        mesh._pg_registry.clear()
        del model, optim, mesh
    finally:
        torch._C._clear_DTensor_sharding_propagator_cache()
        destroy_all_groups()
    warm_migration(torch.device("cpu"))


def become_worker() -> None:
    """In a spare: wait for the adoption and take its environment; exit 0 when released.
    In an ordinary worker: nothing."""
    fd = WorkerSettings.from_env(os.environ).spare_fd
    if fd is None:
        return
    try:
        warm_up()
    except Exception as err:  # noqa: BLE001 - only a head start: the worker pays these costs itself then
        print(f"etc_agent spare: warm-up skipped ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
    adoption = read_adoption(fd)
    if adoption is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # released before doing anything: no state, nothing to finalize
    # Wholesale, as a worker forked for this rank would have it (os.environ writes through to the C
    # environment, which gloo and CUDA read when they start).
    os.environ.clear()
    os.environ.update(adoption.env)
    set_process_name(adoption.process_name)
