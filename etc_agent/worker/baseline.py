"""The checkpoint way (``--migration checkpoint``, the baseline every figure is compared with):
``torch.distributed.checkpoint`` save, restart the workers, load with resharding.

Two ways through DCP, chosen by the state saved:

- an app state with an FSDP2 module (``fully_shard``) goes FSDP2's own way, as a torchtitan or
  plain FSDP2 job checkpoints: ``torch.distributed.checkpoint.state_dict.get_state_dict`` of each
  module and its optimizers, ``dcp.save``; on load, the new modules' and optimizers' own state
  dicts, ``dcp.load`` into them, ``set_state_dict`` (``checkpoint_api="state_dict"``);
- any other state (Megatron boxes, ZeRO flat ranges, DTensor TP) goes as the described shards,
  :mod:`etc_agent.migrate.storage` (the same boxes the executor moves; ``checkpoint_api="boxes"``).

The load follows the save's way (``etc_state.json`` says which), whatever the new layout is.

Call sequence: at the agreed step boundary every rank of the old layout calls :func:`save_and_exit`
(one DCP save, collective over the default group, then exit with ``RESTART_EXIT``); the agent
starts fresh workers, and every rank of the new layout calls :func:`load_checkpoint` (one DCP load,
collective over the new default group) on the state its ``build`` returned.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.storage import load_shards, save_shards
from etc_agent.protocol.phases import RESTART_EXIT
from etc_agent.utils.plainstate import to_json
from etc_agent.worker.appstate import split_state
from etc_agent.worker.logs import say

__all__ = ["checkpoint_api", "load_checkpoint", "load_shards", "save_and_exit", "save_shards"]

CheckpointApi = Literal["boxes", "state_dict"]
EXTRA_TENSORS = "etc_tensors"
"""State-dict entry of the app state's tensors that no module or optimizer holds (a Stateful's)."""


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # One entry per parameter for its group settings too (torchtitan's choice): pipeline stages hold
    # different parameters, and a nested param_groups list would be saved once, from one stage.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_api(app: Mapping[str, Any], tensors: Mapping[str, Any]) -> CheckpointApi:
    """``state_dict`` when FSDP2 manages a module of ``app`` and every optimizer's parameters are one
    module's (what ``get_state_dict`` takes) and every tensor is a plain tensor or DTensor."""
    from torch.distributed.fsdp import FSDPModule

    modules = [obj for obj in app.values() if isinstance(obj, nn.Module)]
    fsdp = any(isinstance(m, FSDPModule) for module in modules for m in module.modules())
    return "state_dict" if fsdp and _fits_a_state_dict(app, tensors) else "boxes"


def _fits_a_state_dict(app: Mapping[str, Any], tensors: Mapping[str, Any]) -> bool:
    """Every tensor a plain tensor or DTensor, every optimizer's parameters one module's."""
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return False
    optimizers = [obj for obj in app.values() if isinstance(obj, torch.optim.Optimizer)]
    return all(_owner(o, app) is not None for o in optimizers)


def _owner(optim: torch.optim.Optimizer, app: Mapping[str, Any]) -> nn.Module | None:
    """The module of ``app`` that holds every parameter of ``optim``."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    for obj in app.values():
        if isinstance(obj, nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
            return obj
    return None


def _state_dict(app: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """What an FSDP2 job hands DCP: each module's and optimizer's ``get_*_state_dict`` (sharded
    DTensors aliasing the live storage), and the tensors nothing else holds under ``EXTRA_TENSORS``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for name, obj in app.items():
        if isinstance(obj, nn.Module):
            out[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            owner = _owner(obj, app)
            assert owner is not None, "checkpoint_api() said state_dict"
            out[name] = get_optimizer_state_dict(owner, obj, options=_options())
    held = tuple(f"{name}." for name, obj in app.items() if isinstance(obj, (nn.Module, torch.optim.Optimizer)))
    extra = {key: t for key, t in tensors.items() if not key.startswith(held)}
    if extra:
        out[EXTRA_TENSORS] = extra
    return out


def _set_state_dict(app: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for name, obj in app.items():
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, loaded[name])
    for name, obj in app.items():
        if isinstance(obj, torch.optim.Optimizer):
            owner = _owner(obj, app)
            assert owner is not None, "_load() checked _fits_a_state_dict()"
            set_optimizer_state_dict(owner, obj, loaded[name], options=_options())


def _save(app: Mapping[str, Any], tensors: Mapping[str, Any], path: Path, api: CheckpointApi) -> None:
    if api == "state_dict":
        dcp.save(_state_dict(app, tensors), storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))
    else:
        save_shards(describe_state(tensors), path)


def _load(app: Mapping[str, Any], tensors: Mapping[str, Any], path: Path, api: CheckpointApi) -> None:
    if api == "state_dict":
        if not _fits_a_state_dict(app, tensors):
            raise ValueError(
                f"{path} was saved through get_state_dict; the new state does not fit one (boxed tensors, "
                "or an optimizer whose parameters are not one module's)"
            )
        loaded = _state_dict(app, tensors)
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(path)))
        _set_state_dict(app, loaded)
    else:
        with torch.no_grad():  # the new state's module tensors are its parameters (split_state keep_vars)
            load_shards(describe_state(tensors), path)


def save_and_exit(
    app: Mapping[str, Any],
    checkpoint_dir: str,
    pending: int,
    step: int,
    rank: int,
    config: str,
    stopped_at: float,
) -> None:
    """Save the state with DCP (files synced; the way :func:`checkpoint_api` picks), then exit so that
    the agent starts fresh workers for generation ``pending`` that load with resharding. Rank 0
    writes the plain state beside them."""
    tensors, plain = split_state(app)
    path = Path(checkpoint_dir) / f"gen{pending}"
    api = checkpoint_api(app, tensors)
    t0 = time.perf_counter()
    _save(app, tensors, path, api)
    save_s = time.perf_counter() - t0
    if rank == 0:
        meta = {
            "checkpoint_api": api,
            "app": plain,
            "rng": to_json(torch.get_rng_state(), "rng"),
            "step": step,
            "stopped_at": stopped_at,
            "save_s": save_s,
            "config": config,
            "generation": pending,
        }
        (path / "etc_state.json").write_text(json.dumps(meta))
    dist.barrier()
    say(
        f"rank {rank}: saved to {path} in {save_s:.3f} s ({api}); exiting for generation {pending} "
        "(--migration checkpoint)",
    )
    sys.stdout.flush()
    os._exit(RESTART_EXIT)  # no interpreter teardown: the saved state is all that matters now


def load_checkpoint(
    new_state: Mapping[str, Any],
    new_tensors: dict,
    checkpoint_dir: str,
    generation: int,
    published_at: float,
    periodic: bool,
) -> dict | None:
    """Load the newest save into the new state (collective over the new world): the baseline's save
    at the last switch, or, after a failure, the newest complete periodic checkpoint (``periodic``;
    what a restarted ``torchrun`` job loads; its write ran in the background, off the stall).
    Returns the plain state and timings, or None when there is nothing to load."""
    root = Path(checkpoint_dir)
    found = sorted(root.glob("gen*/etc_state.json"), key=lambda p: int(p.parent.name[3:]))
    # (step, the baseline's save over a periodic one, newest generation): the state to resume from.
    saves: list[tuple[dict[str, Any], Path, tuple[int, int]]] = [
        ((json.loads(p.read_text())), p.parent, (1, int(p.parent.name[3:])))
        for p in found
        if int(p.parent.name[3:]) <= generation
    ]
    if periodic:
        from etc_agent.worker.checkpoint import complete_checkpoints

        for stored in complete_checkpoints(root):
            saves.append(
                ({**stored.state(), "stopped_at": published_at, "save_s": 0.0}, stored.path, (0, stored.generation))
            )
    if not saves:
        return None
    meta, path, _ = max(saves, key=lambda item: (item[0]["step"], *item[2]))
    t0 = time.perf_counter()
    meta.setdefault("checkpoint_api", "boxes")  # periodic checkpoints are boxes
    _load(new_state, new_tensors, path, meta["checkpoint_api"])
    meta["load_s"] = time.perf_counter() - t0
    meta["path"] = str(path)
    meta["written_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")
    return meta
