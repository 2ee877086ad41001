"""The user's app state, split into tensors that migrate and small plain values that are carried.

An app state is a dict, as for ``torch.distributed.checkpoint``: name -> ``nn.Module`` | ``Optimizer``
| Stateful (``state_dict``/``load_state_dict``) | ``Tensor`` | ``DTensor`` | :class:`BoxedTensor` |
plain value. Keys of the migrated tensors:

- module ``m``: ``m.<fqn>`` for every entry of ``state_dict()`` (parameters and buffers);
- optimizer ``o``: ``o.state.<param fqn>.<state name>``, the parameter named after the module that
  holds it, so keys do not depend on the layout; its param-group settings (lr, betas, ...) are plain;
- Stateful ``s``: ``s.<path>`` for tensors in ``state_dict()``; everything else in it is plain;
- a tensor entry ``t``: ``t``;
- Megatron-core model ``m`` (a module or a list of model chunks): ``m.<sharded_state_dict key>``,
  with each layer's number in the key; Megatron optimizer ``o``: ``o.<state>.<model key>``
  (see :mod:`etc_agent.integrations.megatron`); its step count and settings are plain.

Tensors of a new state are written in place (module parameters, optimizer state, a Stateful's
``state_dict()`` tensors must alias its storage); Statefuls then get ``load_state_dict`` with the
migrated tensors and the carried plain values. Plain values travel as JSON, never pickled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from etc_agent.integrations import megatron
from etc_agent.migrate.describe import BoxedTensor
from etc_agent.utils.plainstate import from_json, json_key, load_param_group, materialize_optimizer_state, to_json

__all__ = [
    "from_json",
    "holds_only_whole_tensors",
    "hook_optimizers",
    "load_param_group",
    "load_state",
    "materialize_optimizer_state",
    "param_names",
    "reshard_fsdp",
    "split_state",
    "to_json",
]

TensorLike = (torch.Tensor, BoxedTensor)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def param_names(app: Mapping[str, Any]) -> dict[int, str]:
    """``id(parameter)`` -> ``<module name>.<fqn>`` for every module of the app state."""
    names: dict[int, str] = {}
    for name, obj in app.items():
        if isinstance(obj, nn.Module):
            for fqn, param in obj.named_parameters(remove_duplicate=False):
                names.setdefault(id(param), f"{name}.{fqn}")
    return names


def hook_optimizers(
    app: Mapping[str, Any], zero: bool, before_step: Callable[..., None] | None, after_step: Callable[..., None]
) -> None:
    """Give every optimizer of the app state its state now (zeros when ``zero``: nothing will be
    loaded into it) and hook its step: ``before_step`` (None: nothing) before it, ``after_step`` after."""
    for obj in app.values():
        if isinstance(obj, torch.optim.Optimizer):
            materialize_optimizer_state(obj, zero=zero)
            if before_step is not None:
                obj.register_step_pre_hook(before_step)
            obj.register_step_post_hook(after_step)
        elif megatron.is_optimizer(obj):
            megatron.materialize_optimizer_state(obj, zero=zero)
            megatron.wrap_step(obj, before_step, after_step)


def holds_only_whole_tensors(app: Mapping[str, Any]) -> bool:
    """Whether every tensor of the app state is whole on this rank (no tensor-, pipeline-, FSDP or
    ZeRO shard, no :class:`BoxedTensor` range): a replica whose loss any surviving replica covers.
    Reads shapes only."""
    from etc_agent.migrate.describe import describe_tensor

    tensors, _ = split_state(app)
    for key, value in tensors.items():
        local = describe_tensor(key, value)
        if local is None:
            continue
        shard = local.shard
        if shard.flat_range is not None or any(shard.offsets) or tuple(shard.lengths) != tuple(shard.global_shape):
            return False
    return True


def reshard_fsdp(app: Mapping[str, Any]) -> None:
    """Put every FSDP2 unit of the app state's modules back to its sharded parameters.

    A step a peer's failure cut short can stop between forward and backward, where ``fully_shard``
    leaves units unsharded (the root keeps its parameters unsharded after forward): the module then
    holds plain full tensors, not the sharded parameters the optimizer's state is keyed by, and that
    state would lose its names. ``reshard`` is local (no collective) and a no-op on a sharded unit."""
    from torch.distributed.fsdp import FSDPModule

    for obj in app.values():
        modules = obj if isinstance(obj, list | tuple) else [obj]
        for module in modules:
            if isinstance(module, nn.Module):
                for sub in module.modules():
                    if isinstance(sub, FSDPModule):
                        sub.reshard()


def split_state(app: Mapping[str, Any], keep_vars: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors to migrate by key, plain values by entry name)`` of an app state; FSDP2 units are
    resharded first (:func:`reshard_fsdp`). ``keep_vars``: a module's parameters and buffers
    themselves (``state_dict(keep_vars=True)``) instead of detached aliases, so that a migration may
    give them another storage (:meth:`~etc_agent.migrate.rounds.Runner.local_copies`)."""
    reshard_fsdp(app)
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    names = param_names(app)
    megatron_params: dict[tuple, megatron.ParamBox] = {}
    for name, obj in app.items():
        if megatron.is_model(obj):
            boxes, params = megatron.model_tensors(obj)
            tensors.update({f"{name}.{key}": box for key, box in boxes.items()})
            megatron_params.update(
                {
                    pid: megatron.ParamBox(f"{name}.{b.key}", b.global_shape, b.offsets, b.lengths)
                    for pid, b in params.items()
                }
            )
    for name, obj in app.items():
        if megatron.is_model(obj):
            continue
        if megatron.is_optimizer(obj):
            boxes = megatron.optimizer_tensors(obj, megatron_params)
            tensors.update({f"{name}.{key}": box for key, box in boxes.items()})
            plain[name] = megatron.optimizer_plain(obj, name)
        elif isinstance(obj, nn.Module):
            for fqn, value in obj.state_dict(keep_vars=keep_vars).items():
                tensors[f"{name}.{fqn}"] = value
        elif isinstance(obj, torch.optim.Optimizer):
            groups = []
            for gi, group in enumerate(obj.param_groups):
                groups.append(
                    {k: to_json(v, f"{name}.param_groups[{gi}].{k}") for k, v in group.items() if k != "params"}
                )
                for pi, p in enumerate(group["params"]):
                    pname = names.get(id(p), f"group{gi}.param{pi}")
                    for k, v in obj.state.get(p, {}).items():
                        if isinstance(v, TensorLike):
                            tensors[f"{name}.state.{pname}.{k}"] = v
            plain[name] = {"param_groups": groups}
        elif isinstance(obj, TensorLike):
            tensors[name] = obj
        elif _is_stateful(obj):
            plain[name] = _split_nested(obj.state_dict(), name, tensors)
        else:
            plain[name] = to_json(obj, name)
    return tensors, plain


def _split_nested(value: Any, path: str, tensors: dict[str, Any]) -> Any:
    if isinstance(value, TensorLike):
        tensors[path] = value
        return {"__migrated__": path}
    if isinstance(value, Mapping):
        return {"__dict__": [[json_key(k, path), _split_nested(v, f"{path}.{k}", tensors)] for k, v in value.items()]}
    return to_json(value, path)


def load_state(app: dict[str, Any], plain: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """Restore carried plain values into a new app state whose tensors hold the migrated data."""
    for name, obj in list(app.items()):
        if name not in plain:
            continue
        value = plain[name]
        if megatron.is_optimizer(obj):
            megatron.load_optimizer_plain(obj, value)
        elif isinstance(obj, torch.optim.Optimizer):
            for group, saved in zip(obj.param_groups, value["param_groups"]):
                load_param_group(group, saved)
        elif isinstance(obj, (nn.Module, *TensorLike)) or megatron.is_model(obj):
            continue
        elif _is_stateful(obj):
            obj.load_state_dict(_join_nested(value, tensors))
        else:
            app[name] = from_json(value)


def _join_nested(value: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(value, dict) and "__migrated__" in value:
        migrated = tensors[value["__migrated__"]]
        return migrated.tensor if isinstance(migrated, BoxedTensor) else migrated
    if isinstance(value, dict) and "__dict__" in value:
        return {from_json(k): _join_nested(v, tensors) for k, v in value["__dict__"]}
    return from_json(value)
