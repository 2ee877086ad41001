"""``torch.distributed`` backend names: the default group's, and the one a group's data runs on.

A job on GPUs trains over NCCL, but the step boundary's votes (:mod:`etc_agent.worker.boundary`)
and a few other control collectives all-reduce small CPU tensors, which NCCL refuses. The default
group is therefore made with one backend per device type, ``cpu:gloo,cuda:nccl`` (as torchtitan
does for its CPU collectives): CPU tensors go over gloo, CUDA tensors over NCCL, on the same ranks.
"""

from __future__ import annotations

CPU_BACKEND = "gloo"
"""The backend CPU tensors use beside an accelerator's."""


def default_group_backend(backend: str) -> str:
    """The backend string the default group is made with: ``nccl`` gets gloo beside it for CPU
    tensors; any other backend, and an explicit device map, is kept as given."""
    return f"cpu:{CPU_BACKEND},cuda:nccl" if backend == "nccl" else backend


def data_backend(backend: str) -> str:
    """The backend a group's training and migration tensors go over, from ``dist.get_backend``'s
    string: the accelerator's in a ``cpu:gloo,cuda:nccl`` map (where the data lives), else the CPU's."""
    if ":" not in backend:
        return backend
    by_device = dict(part.strip().split(":", 1) for part in backend.split(",") if ":" in part)
    accelerators = [name for device, name in by_device.items() if device != "cpu"]
    return accelerators[0] if accelerators else by_device.get("cpu", backend)
