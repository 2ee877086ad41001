"""Plain (non-tensor) training state as JSON, and optimizer state created ahead of its first step.

Below both the worker (which carries a script's small state across a migration) and the framework
adapters in :mod:`etc_agent.integrations` (which carry their optimizers' settings the same way).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import torch


def materialize_optimizer_state(optim: torch.optim.Optimizer, zero: bool = True) -> None:
    """Create the optimizer's state for every parameter now, in the parameters' own layout.

    Adam/AdamW get what their first step would create (zeros, step 0) directly, without a step;
    other optimizers go through one zero-gradient, lr=0 step, then their state tensors are zeroed.
    ``zero=False`` (a migration overwrites every element) leaves Adam's moments uninitialised.
    """
    if all(p in optim.state and optim.state[p] for g in optim.param_groups for p in g["params"]):
        return
    if isinstance(optim, (torch.optim.Adam, torch.optim.AdamW)):
        for group in optim.param_groups:
            for p in group["params"]:
                if optim.state.get(p):
                    continue
                moment = torch.zeros_like if zero else torch.empty_like
                state = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": moment(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": moment(p, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = moment(p, memory_format=torch.preserve_format)
                optim.state[p] = state
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optim)
    with torch.no_grad():
        for state in optim.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


def load_param_group(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Restore an optimizer param group's carried settings (lr, betas, ...) in place.

    Tuples come back as tuples; a tensor-valued setting keeps its tensor (device, dtype) and takes the value.
    """
    for k, v in saved.items():
        restored = from_json(v)
        if isinstance(group.get(k), tuple) and isinstance(restored, list):
            restored = tuple(restored)
        if isinstance(group.get(k), torch.Tensor):
            group[k].copy_(torch.as_tensor(restored))
        else:
            group[k] = restored


def json_key(key: Any, path: str) -> Any:
    if isinstance(key, (str, int, float, bool)) or key is None:
        return to_json(key, path)
    raise ValueError(f"app state {path}: key {key!r} of type {type(key).__name__} cannot be carried")


def to_json(value: Any, path: str) -> Any:
    """A JSON form of a plain value that :func:`from_json` turns back (tuples, bytes, small tensors)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return {"__dict__": [[json_key(k, path), to_json(v, f"{path}.{k}")] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.Tensor) and not hasattr(value, "placements") and value.numel() <= 1 << 16:
        raw = value.detach().cpu().contiguous()
        return {
            "__tensor__": base64.b64encode(raw.view(torch.uint8).numpy().tobytes() if raw.numel() else b"").decode(),
            "dtype": str(raw.dtype).removeprefix("torch."),
            "shape": list(raw.shape),
        }
    raise ValueError(
        f"app state {path}: a {type(value).__name__} cannot be carried across a migration; "
        "return tensors, modules, optimizers, Statefuls or JSON-like values from build()"
    )


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(from_json(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {from_json(k): from_json(v) for k, v in value["__dict__"]}
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"])
            data = bytearray(base64.b64decode(value["__tensor__"]))
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).clone()
    return value
