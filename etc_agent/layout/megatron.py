"""The Megatron-LM layout of a GPT / Llama model's training state for a :class:`ParallelConfig`.

Conventions (see docs/design.md, "Layout conventions"):

- QKV and FC1 are column-parallel (split on the output dim), the attention projection and FC2 are
  row-parallel (split on the input dim, bias replicated), norms are replicated across TP, the word
  embedding is vocab-parallel (dim 0) and so is an untied output head.
- QKV is ``[(heads + 2*groups) * head_dim, hidden]`` in Megatron's per-group interleaved order, so a
  contiguous dim-0 split gives every TP rank whole query groups.
- A gated (SwiGLU) FC1 is ``[2, ffn, hidden]`` (gate, up) split on dim 1: each TP rank's local
  ``[2*ffn/tp, hidden]`` weight is exactly that box, as in Megatron's per-rank ``[gate; up]`` layout.
- Layers are split into ``pp`` contiguous stages, earlier stages taking the extra layer. The embedding
  sits on the first stage, final norm and output head on the last; with tied embeddings and ``pp > 1``
  the last stage keeps a replica of the word embedding (same key, same boxes).
- Optimizer state (Adam moments, and an fp32 master copy for bf16/fp16 params) has the parameter's
  boxes; with ``zero=1`` each TP/PP box is additionally split across the DP group along its flattened
  element range (``torch.chunk`` sizes).
- FSDP2 / HSDP (``dp_shard > 1``): as ``fully_shard`` leaves them, every parameter and its optimizer
  state is split along dim 0 of its TP box across the ``dp_shard`` ranks of its shard group
  (``torch.chunk`` sizes: uneven and empty last shards), replicated across ``dp_replicate`` groups.
  The data-parallel index is ``replicate * dp_shard + shard`` (torchtitan's mesh order
  ``pp, dp_replicate, dp_shard, tp``). A gated FC1 is sharded on its ffn dim (dim 1): torchtitan's
  separate ``w1`` and ``w3``, each split on its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from etc_agent.layout.boxes import balanced_range, chunk_range
from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.model import ModelSpec
from etc_agent.layout.shards import Geometry, Placement, StateLayout


@dataclass(frozen=True)
class TensorKind:
    """One parameter tensor of the model and how Megatron shards it."""

    suffix: str
    shape: tuple[int, ...]
    split_dim: int | None
    """Dim split across TP, or None when replicated across TP."""
    fsdp_dim: int = 0
    """Dim FSDP2 splits across its shard group (dim 0 of the tensor as the framework holds it)."""


def layer_tensors(spec: ModelSpec) -> list[TensorKind]:
    h, f = spec.hidden_size, spec.ffn_hidden_size
    qkv_rows = (spec.num_attention_heads + 2 * spec.query_groups) * spec.head_dim
    attn_cols = spec.num_attention_heads * spec.head_dim
    bias = spec.add_bias_linear
    out = list(_norm(spec, "input_layernorm"))
    out.append(TensorKind("self_attention.linear_qkv.weight", (qkv_rows, h), 0))
    if bias:
        out.append(TensorKind("self_attention.linear_qkv.bias", (qkv_rows,), 0))
    out.append(TensorKind("self_attention.linear_proj.weight", (h, attn_cols), 1))
    if bias:
        out.append(TensorKind("self_attention.linear_proj.bias", (h,), None))
    out += _norm(spec, "pre_mlp_layernorm")
    if spec.gated_mlp:
        out.append(TensorKind("mlp.linear_fc1.weight", (2, f, h), 1, fsdp_dim=1))
        if bias:
            out.append(TensorKind("mlp.linear_fc1.bias", (2, f), 1, fsdp_dim=1))
    else:
        out.append(TensorKind("mlp.linear_fc1.weight", (f, h), 0))
        if bias:
            out.append(TensorKind("mlp.linear_fc1.bias", (f,), 0))
    out.append(TensorKind("mlp.linear_fc2.weight", (h, f), 1))
    if bias:
        out.append(TensorKind("mlp.linear_fc2.bias", (h,), None))
    return out


def _norm(spec: ModelSpec, name: str) -> list[TensorKind]:
    kinds = [TensorKind(f"{name}.weight", (spec.hidden_size,), None)]
    if spec.normalization == "layernorm":
        kinds.append(TensorKind(f"{name}.bias", (spec.hidden_size,), None))
    return kinds


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    start, length = balanced_range(num_layers, pp, stage)
    return range(start, start + length)


def model_tensors(spec: ModelSpec, pp: int) -> list[tuple[str, TensorKind, tuple[int, ...]]]:
    """Every parameter as ``(key, kind, stages holding it)``."""
    v, h = spec.padded_vocab_size, spec.hidden_size
    first, last = 0, pp - 1
    out: list[tuple[str, TensorKind, tuple[int, ...]]] = []
    embed_stages = (first, last) if spec.tied_embeddings and pp > 1 else (first,)
    out.append(("embedding.word_embeddings.weight", TensorKind("weight", (v, h), 0), embed_stages))
    if spec.position_embedding_type == "learned":
        out.append(
            (
                "embedding.position_embeddings.weight",
                TensorKind("weight", (spec.max_position_embeddings, h), None),
                (first,),
            )
        )
    kinds = layer_tensors(spec)
    for stage in range(pp):
        for layer in stage_layers(spec.num_layers, pp, stage):
            out += [(f"decoder.layers.{layer}.{k.suffix}", k, (stage,)) for k in kinds]
    out += [(f"decoder.final_layernorm.{k.suffix.split('.')[-1]}", k, (last,)) for k in _norm(spec, "final_layernorm")]
    if not spec.tied_embeddings:
        out.append(("output_layer.weight", TensorKind("weight", (v, h), 0), (last,)))
    return out


def optimizer_key(param_key: str, state: str) -> str:
    return f"optimizer.state.{param_key}.{state}"


def model_layout(spec: ModelSpec, config: ParallelConfig) -> StateLayout:
    """Every rank's shards of parameters and Adam state for ``spec`` under ``config``."""
    spec.check_parallel(config)
    tp, dp = config.tp, config.dp
    geometries: dict[tuple[object, ...], Geometry] = {}
    placements: list[Placement] = []
    placement_index: dict[tuple[object, ...], int] = {}
    key_placement: dict[str, int] = {}
    key_dtype: dict[str, str] = {}

    fsdp = config.dp_shard

    def placement_for(kind: TensorKind, stages: tuple[int, ...], zero_split: bool) -> int:
        gkey = (kind.shape, kind.split_dim, kind.fsdp_dim, zero_split)
        if gkey not in geometries:
            geometries[gkey] = _geometry(kind, tp, dp, zero_split, fsdp)
        pkey = (gkey, stages)
        if pkey not in placement_index:
            tp_idx = np.tile(np.arange(tp), dp)
            dp_idx = np.repeat(np.arange(dp), tp)
            ranks = np.concatenate([s * dp * tp + dp_idx * tp + tp_idx for s in stages])
            box_idx = tp_idx if kind.split_dim is not None else np.zeros_like(tp_idx)
            if zero_split:
                shard = box_idx * dp + dp_idx
            elif fsdp > 1:
                shard = box_idx * fsdp + dp_idx % fsdp  # one chunk per shard-group rank, same in every replica
            else:
                shard = box_idx
            placement_index[pkey] = len(placements)
            placements.append(Placement(geometries[gkey], ranks, np.tile(shard, len(stages))))
        return placement_index[pkey]

    states = spec.optimizer_state_names()
    for key, kind, stages in model_tensors(spec, config.pp):
        key_placement[key] = placement_for(kind, stages, False)
        key_dtype[key] = spec.params_dtype
        opt_placement = placement_for(kind, stages, bool(config.zero))
        for state in states:
            key_placement[optimizer_key(key, state)] = opt_placement
            key_dtype[optimizer_key(key, state)] = "float32"
    return StateLayout(config.world_size, placements, key_placement, key_dtype)


def _geometry(kind: TensorKind, tp: int, dp: int, zero_split: bool, fsdp: int = 1) -> Geometry:
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if kind.split_dim is None:
        boxes.append(((0,) * len(kind.shape), kind.shape))
    else:
        for t in range(tp):
            start, length = chunk_range(kind.shape[kind.split_dim], tp, t)
            offsets = tuple(start if d == kind.split_dim else 0 for d in range(len(kind.shape)))
            lengths = tuple(length if d == kind.split_dim else n for d, n in enumerate(kind.shape))
            boxes.append((offsets, lengths))
    if fsdp > 1:
        # FSDP2's dim-0 chunks of each TP box (of the fsdp dim: a gated FC1's ffn rows).
        dim = kind.fsdp_dim
        fsdp_boxes = []
        for offsets, lengths in boxes:
            for s in range(fsdp):
                start, length = chunk_range(lengths[dim], fsdp, s)
                fsdp_boxes.append(
                    (
                        tuple(o + start if d == dim else o for d, o in enumerate(offsets)),
                        tuple(length if d == dim else n for d, n in enumerate(lengths)),
                        None,
                    )
                )
        return Geometry(kind.shape, fsdp_boxes)
    if not zero_split:
        return Geometry(kind.shape, [(o, n, None) for o, n in boxes])
    shard_boxes = []
    for offsets, lengths in boxes:
        numel = int(np.prod(lengths))
        for d in range(dp):
            start, length = chunk_range(numel, dp, d)
            shard_boxes.append((offsets, lengths, (start, start + length)))
    return Geometry(kind.shape, shard_boxes)
