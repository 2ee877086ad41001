"""Run Megatron-core on CPU with gloo: for tests and local dry runs of an elastic Megatron job.

Megatron-core assumes CUDA in a few places that have nothing to do with the math: buffers
allocated on ``torch.cuda.current_device()`` or ``device="cuda"``, ``.cuda()`` and
``torch.cuda.synchronize()`` calls, type checks
against ``torch.cuda.FloatTensor``, and the model-parallel RNG tracker, which forks the CUDA
generator. :func:`enable` maps each of those to the CPU in this process: a torch function mode
sends CUDA device arguments to the CPU and reports CPU tensors' ``type()`` with the ``cuda`` name,
and the RNG tracker forks the CPU generator. Nothing changes when CUDA is available (the function
refuses to run there, so it cannot hide a real device).

Transformer Engine, Apex and fused kernels stay unavailable on CPU; use Megatron's local layer
specs (``get_gpt_layer_local_spec``) and ``use_cpu_initialization=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


def _cpu(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str):
        return torch.device("cpu") if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _cpu(kwargs["device"])}
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def enable() -> None:
    """Make this process's Megatron-core run on the CPU (idempotent; call before building models)."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.enable() is for machines without CUDA; this one has a GPU")
    from megatron.core.tensor_parallel import random as megatron_random

    cuda: Any = torch.cuda  # patched in place: its functions are replaced with CPU stand-ins
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _CudaToCpu().__enter__()
    _enabled = True
