"""Megatron-core models and optimizers as state the executor migrates.

A Megatron model describes every local tensor in ``sharded_state_dict()`` as a ``ShardedTensor``:
a global key, the global shape, this rank's box (``global_offset``, ``local_shape``) and a
``replica_id``. That is a :class:`~etc_agent.migrate.describe.BoxedTensor`, with two differences
this module removes so that one key names the same elements in every (tp, pp, dp):

- Megatron stacks a stage's transformer layers under one key with a *prepended* layer axis (local
  length 1, offset = the global layer number), so which layers a rank holds depends on pp. Each
  prepended offset goes into the key instead: ``decoder.layers.mlp.linear_fc2.weight[3]``.
- A ``ShardedTensorFactory`` (SwiGLU's ``linear_fc1``) stores one local tensor as several boxes of
  one key: ``[gate; up]`` locally, the two halves of the global ``[2 * ffn, hidden]`` tensor. Boxes
  that cut one axis into ``k`` equal parts are folded into a new axis of length ``k``
  (``[2, ffn, hidden]``, split on ffn), the layout ``etc_agent.layout.megatron`` plans with; the
  local tensor is viewed, not copied.

The distributed optimizer (``use_distributed_optimizer=True``) holds, per model parameter, a flat
element range of the parameter on each DP rank (``gbuf_ranges``): its fp32 main parameter and Adam
moments over that range become boxes with a ``flat_range`` (the same description as ZeRO-1). The
plain optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``) hold whole-box state.
Main parameters that are views of the model parameter (fp32 training) are not described twice.

Not migrated: ``ShardedObject`` entries (Transformer Engine ``_extra_state``: FP8 scaling history,
rebuilt by TE within its amax history window), gradient buffers (zeroed every step). The optimizer's
step count and param-group settings travel as plain values.

Needs ``megatron-core`` (``pip install etc-agent[megatron]``), imported only when used.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from etc_agent.migrate.describe import BoxedTensor


def available() -> bool:
    """True when Megatron-core has been imported by this process (no import is triggered)."""
    return "megatron.core" in sys.modules


def is_model(obj: Any) -> bool:
    """A Megatron module, or a list of them (model chunks, as Megatron's training loop holds them)."""
    if not available():
        return False
    from megatron.core.transformer.module import MegatronModule

    if isinstance(obj, (list, tuple)):
        return bool(obj) and all(isinstance(chunk, MegatronModule) for chunk in obj)
    return isinstance(obj, MegatronModule)


def is_optimizer(obj: Any) -> bool:
    if not available():
        return False
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(obj, MegatronOptimizer)


@dataclass(frozen=True)
class ParamBox:
    """Where a model parameter's local tensor sits in its global tensor."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


# ---- model -----------------------------------------------------------------------------------


def tensor_id(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Identity of a tensor's elements (storage, offset, shape): a parameter, its ``.data`` and a detached
    view of it agree, so optimizers and state dicts that hold either find the same box."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape)


def model_tensors(model: Any) -> tuple[dict[str, BoxedTensor], dict[tuple, ParamBox]]:
    """``(boxes by layout-independent key, tensor_id(parameter) -> its box)`` of one rank's model.

    ``model`` is a Megatron module (a DDP wrapper included) or a list of model chunks. Every box's
    tensor aliases the parameter's (or buffer's) storage, so writing into it updates the model.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    tensors: dict[str, BoxedTensor] = {}
    params: dict[tuple, ParamBox] = {}
    for chunk in chunks:
        for item in nested_values(chunk.sharded_state_dict()):
            if isinstance(item, ShardedObject):
                continue
            if isinstance(item, ShardedTensorFactory):
                built = [sh for sh in nested_values(_as_dict(item.build())) if isinstance(sh, ShardedTensor)]
                key, box = _fold(item.key, item.data, [_unprepend(sh) for sh in built])
            elif isinstance(item, ShardedTensor):
                key, box = _unprepend(item)
            else:
                continue
            global_shape, offsets, lengths, data = box
            if data is None:
                raise ValueError(f"{key}: a ShardedTensor without data cannot be migrated")
            if key in tensors:
                raise ValueError(
                    f"{key}: two local boxes of one tensor on this rank ({tensors[key].offsets} and {offsets})"
                )
            view = data.detach()
            view = view.view(lengths) if tuple(view.shape) != lengths else view
            tensors[key] = BoxedTensor(view, global_shape, offsets, lengths)
            params[tensor_id(data)] = ParamBox(key, global_shape, offsets, lengths)
    return tensors, params


def _as_dict(built: Any) -> Any:
    return built if isinstance(built, (dict, list)) else [built]


def _unprepend(sh: Any) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], Any]]:
    """``(key with prepended offsets, (global shape, offsets, lengths, data))`` without prepended axes."""
    prepend = sh.prepend_axis_num
    if getattr(sh, "flattened_range", None) is not None:
        raise ValueError(
            f"{sh.key}: a flattened ShardedTensor (distributed-optimizer checkpoint format) is not a model "
            "tensor; pass the optimizer itself in the app state"
        )
    key = sh.key + "".join(f"[{offset}]" for offset in sh.global_offset[:prepend])
    global_shape = tuple(sh.global_shape[prepend:])
    offsets = tuple(sh.global_offset[prepend:])
    lengths = tuple(sh.local_shape)
    if len(global_shape) != len(lengths):
        raise ValueError(
            f"{sh.key}: local shape {lengths} does not match global shape {global_shape} without "
            f"{prepend} prepended axes"
        )
    if not global_shape:  # a scalar: a one-element box
        global_shape, offsets, lengths = (1,), (0,), (1,)
    return key, (global_shape, offsets, lengths, sh.data)


def _fold(key: str, data: torch.Tensor, boxes: list) -> tuple[str, tuple]:
    """One box for a factory's ShardedTensors: itself when there is one, else the ``k`` equal boxes
    along one axis (at ``o + i * G/k``, in the local tensor's order) folded into a leading axis ``k``."""
    if len(boxes) == 1:
        k, (global_shape, offsets, lengths, _) = boxes[0]
        return k, (global_shape, offsets, lengths, data)
    keys = {k for k, _ in boxes}
    if len(keys) != 1:
        raise ValueError(f"{key}: a factory that builds several keys ({sorted(keys)}) cannot be migrated")
    (out_key,) = keys
    shapes = {b[0] for _, b in boxes}
    lengths = {b[2] for _, b in boxes}
    if len(shapes) != 1 or len(lengths) != 1:
        raise ValueError(f"{out_key}: the factory's boxes differ in shape ({sorted(lengths)}); cannot fold them")
    (global_shape,), (local,) = shapes, lengths
    offsets = [b[1] for _, b in boxes]
    axes = [a for a in range(len(global_shape)) if len({o[a] for o in offsets}) > 1]
    count = len(boxes)
    if len(axes) != 1 or global_shape[axes[0]] % count:
        raise ValueError(f"{out_key}: {count} boxes at {offsets} do not split one axis into equal parts")
    axis = axes[0]
    part = global_shape[axis] // count
    starts = [o[axis] for o in offsets]
    if (
        sorted(starts) != starts
        or any(s - starts[0] != i * part for i, s in enumerate(starts))
        or starts[0] + local[axis] > part
    ):
        raise ValueError(f"{out_key}: boxes along axis {axis} at {starts} are not one box per part of {part}")
    stacked = local[:axis] + (count * local[axis],) + local[axis + 1 :]
    if tuple(data.shape) != stacked or not data.is_contiguous():
        raise ValueError(
            f"{out_key}: local tensor {tuple(data.shape)} is not the {count} boxes {local} stacked on axis {axis}"
        )
    folded_shape = global_shape[:axis] + (count, part) + global_shape[axis + 1 :]
    folded_offsets = offsets[0][:axis] + (0, starts[0]) + offsets[0][axis + 1 :]
    folded_lengths = local[:axis] + (count, local[axis]) + local[axis + 1 :]
    return out_key, (folded_shape, folded_offsets, folded_lengths, data)


# ---- optimizer -------------------------------------------------------------------------------


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_tensors(optimizer: Any, params: Mapping[tuple, ParamBox]) -> dict[str, BoxedTensor]:
    """Boxes of a Megatron optimizer's per-parameter state, keyed ``<state>.<model key>``
    (``exp_avg.module.decoder.layers.mlp.linear_fc2.weight[1]``; ``param`` for fp32 main parameters).

    ``params`` maps the model parameters (as returned by :func:`model_tensors`) to their boxes.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out: dict[str, BoxedTensor] = {}
    for opt in _inner_optimizers(optimizer):
        if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise ValueError(
                "Megatron's precision-aware optimizer keeps its state scaled and gives copies of it; "
                "it cannot be migrated in place (set use_precision_aware_optimizer=False)"
            )
        for model_param, main_param, state, flat in _param_states(opt, isinstance(opt, DistributedOptimizer)):
            box = params.get(tensor_id(model_param))
            if box is None:
                raise ValueError(
                    f"an optimizer parameter of shape {tuple(model_param.shape)} is not in any Megatron model "
                    "of the app state (put the model chunks the optimizer was built for in the app state)"
                )
            tensors = {"param": main_param, **{k: v for k, v in state.items() if k != "step"}}
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if name == "param" and _aliases(tensor, model_param):
                    continue  # the model's box already carries these elements
                expected = (flat[1] - flat[0]) if flat else math.prod(box.lengths)
                if tensor.numel() != expected:
                    raise ValueError(
                        f"{box.key}: optimizer state {name} has {tensor.numel()} elements, expected {expected}"
                    )
                data = tensor.detach()
                key = f"{name}.{box.key}"
                if key in out:
                    raise ValueError(f"{key}: two optimizer states for one parameter box on this rank")
                if flat:
                    out[key] = BoxedTensor(data.view(-1), box.global_shape, box.offsets, box.lengths, flat)
                else:
                    out[key] = BoxedTensor(data.view(box.lengths), box.global_shape, box.offsets, box.lengths)
    return out


def _param_states(
    opt: Any, distributed: bool
) -> Iterable[tuple[torch.Tensor, torch.Tensor, dict, tuple[int, int] | None]]:
    """``(model param, main param, optimizer state, flat range or None)`` for every parameter of one optimizer."""
    inner = opt.optimizer
    if distributed:
        for gbuf_range_maps in opt.gbuf_ranges:
            for buckets in gbuf_range_maps.values():
                for bucket in buckets:
                    for model_param, range_map in bucket["param_map"].items():
                        r = range_map["param"]
                        group_index, group_order = opt.model_param_group_index_map[model_param]
                        main = inner.param_groups[group_index]["params"][group_order]
                        yield model_param, main, inner.state.get(main, {}), (r.start, r.end)
        return
    float16 = getattr(opt, "float16_groups", None)
    if float16 is not None:  # Float16OptimizerWithFloat16Params: fp32 copies of the fp16/bf16 params
        for model_group, main_group in zip(float16, opt.fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                yield model_param, main, inner.state.get(main, {}), None
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                yield param, param, inner.state.get(param, {}), None
        return
    for group in inner.param_groups:  # FP32Optimizer: the model's own parameters
        for param in group["params"]:
            yield param, param, inner.state.get(param, {}), None


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def materialize_optimizer_state(optimizer: Any, zero: bool) -> None:
    """Create the Adam state of every main parameter now (Megatron creates it at the first step)."""
    from etc_agent.utils.plainstate import materialize_optimizer_state as materialize

    for opt in _inner_optimizers(optimizer):
        inner: Any = getattr(opt, "optimizer", None)  # Megatron's wrapper around a torch optimizer
        if inner is not None and any(g["params"] for g in inner.param_groups):
            materialize(inner, zero=zero)


def wrap_step(optimizer: Any, before: Callable[[], None] | None, after: Callable[[], None]) -> None:
    """Call ``before`` and ``after`` around every ``optimizer.step()`` of a Megatron optimizer (which has
    no step hooks): once per step on every rank, whatever optimizers it chains."""
    step = optimizer.step

    def stepped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        result = step(*args, **kwargs)
        after()
        return result

    optimizer.step = stepped


def optimizer_plain(optimizer: Any, path: str) -> dict:
    """The small state of a Megatron optimizer: param-group settings, the step count, the loss scale."""
    from etc_agent.utils.plainstate import to_json

    groups, steps = [], set()
    for i, opt in enumerate(_inner_optimizers(optimizer)):
        inner: Any = getattr(opt, "optimizer", None)  # Megatron's wrapper around a torch optimizer
        settings = []
        for gi, group in enumerate(inner.param_groups if inner is not None else []):
            settings.append(
                {
                    k: to_json(v, f"{path}[{i}].param_groups[{gi}].{k}")
                    for k, v in group.items()
                    if k != "params" and _jsonable(v)
                }
            )
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if step is not None:
                    steps.add(float(step))
        scaler = getattr(opt, "grad_scaler", None)
        groups.append(
            {
                "param_groups": settings,
                "grad_scaler": to_json(scaler.state_dict(), f"{path}[{i}].grad_scaler") if scaler else None,
            }
        )
    if len(steps) > 1:
        raise ValueError(f"{path}: parameters of one optimizer are at different steps ({sorted(steps)})")
    return {"optimizers": groups, "step": steps.pop() if steps else None}


def _jsonable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return isinstance(value, torch.Tensor) and value.numel() == 1


def load_optimizer_plain(optimizer: Any, plain: Mapping[str, Any]) -> None:
    from etc_agent.utils.plainstate import from_json, load_param_group

    optimizers = _inner_optimizers(optimizer)
    if len(optimizers) != len(plain["optimizers"]):
        raise ValueError(
            f"the new Megatron optimizer chains {len(optimizers)} optimizers, the migrating one {len(plain['optimizers'])}"
        )
    step = plain["step"]
    for opt, saved in zip(optimizers, plain["optimizers"]):
        inner: Any = getattr(opt, "optimizer", None)  # Megatron's wrapper around a torch optimizer
        for group, settings in zip(inner.param_groups if inner is not None else [], saved["param_groups"]):
            load_param_group(group, settings)
            for p in group["params"]:
                state = inner.state.get(p)
                if state and step is not None and "step" in state:
                    if isinstance(state["step"], torch.Tensor):
                        state["step"].fill_(step)
                    else:
                        state["step"] = type(state["step"])(step)
        if saved["grad_scaler"] is not None and getattr(opt, "grad_scaler", None) is not None:
            opt.grad_scaler.load_state_dict(from_json(saved["grad_scaler"]))


# ---- parallel state --------------------------------------------------------------------------


def initialize_model_parallel(ctx: Any, seed: int | None = None, **kwargs: Any) -> None:
    """Build Megatron's ``parallel_state`` for ``ctx``'s layout (call it at the top of ``build(ctx)``).

    Any parallel state of an earlier generation is dropped first. ``seed`` (re)seeds Megatron's
    model-parallel RNG tracker (``model_parallel_cuda_manual_seed``). ``kwargs`` go to
    ``parallel_state.initialize_model_parallel`` (context or expert parallelism are not laid out by
    etc_agent and must stay 1). Megatron's groups get the job's collective timeout (whole minutes).
    """
    from megatron.core import parallel_state

    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if name in kwargs:
            raise ValueError(
                f"{name} comes from the job's parallel configuration ({ctx.config.short()}); do not pass it"
            )
    for name in ("context_parallel_size", "expert_model_parallel_size"):
        if kwargs.get(name, 1) != 1:
            raise ValueError(f"{name}={kwargs[name]}: etc_agent lays out tp, pp and dp only")
    destroy_model_parallel()
    timeout_s = getattr(ctx, "timeout_s", None) or 1800.0
    kwargs.setdefault("distributed_timeout_minutes", max(1, math.ceil(timeout_s / 60)))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=ctx.tp, pipeline_model_parallel_size=ctx.pp, **kwargs
    )
    found = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    assert found == (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank), (
        f"Megatron placed rank {ctx.rank} at (tp, pp, dp) {found}, the job at {(ctx.tp_rank, ctx.pp_rank, ctx.dp_rank)}"
    )
    if seed is not None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_model_parallel() -> None:
    """Drop Megatron's parallel state (its groups belong to the generation that ends)."""
    if not available():
        return
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # destroy_model_parallel leaves a few groups set (megatron-core 0.16: the intra partial dp groups);
    # a group kept alive keeps its connections open, and peers blocked on it would wait for their timeout.
    import torch.distributed as dist

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
