"""Model specifications (GPT / Llama family) read from YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from etc_agent.layout.config import ParallelConfig, _first_error

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """Map ``bf16``/``torch.bfloat16``/``bfloat16`` to one spelling; raise ValueError for unknown ones."""
    name = name.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return name


MAX_STATE_BYTES = 10**15
"""A model whose training state exceeds 1 PB is refused (its plans would not fit in memory here)."""


class ModelSpec(BaseModel):
    """Shapes of a GPT / Llama style decoder, enough to lay out every byte of its training state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Human-readable model name.")
    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width.")
    num_attention_heads: int = Field(ge=1, description="Query heads.")
    num_query_groups: int | None = Field(
        None, ge=1, description="Key/value heads (GQA); None means one per query head (plain multi-head attention)."
    )
    kv_channels: int | None = Field(
        None, ge=1, description="Per-head width; None means hidden_size / num_attention_heads."
    )
    ffn_hidden_size: int = Field(ge=1, description="MLP inner width (per branch when gated).")
    vocab_size: int = Field(ge=1, description="Tokenizer vocabulary before padding.")
    make_vocab_size_divisible_by: int = Field(
        128, ge=1, description="The embedding rows are padded up to a multiple of this (Megatron's default is 128)."
    )
    max_position_embeddings: int = Field(2048, ge=1, description="Rows of the learned position table (if any).")
    position_embedding_type: Literal["learned", "rope"] = Field(
        "learned",
        description="'learned' adds a replicated position table on the first stage; 'rope' has no parameters.",
    )
    normalization: Literal["layernorm", "rmsnorm"] = Field(
        "layernorm", description="LayerNorm has weight and bias, RMSNorm weight only."
    )
    add_bias_linear: bool = Field(
        True, description="Biases on the QKV, projection and MLP linears (GPT yes, Llama no)."
    )
    gated_mlp: bool = Field(False, description="SwiGLU: FC1 holds gate and up projections, stored as [2, ffn, hidden].")
    tied_embeddings: bool = Field(
        True,
        description="Output head shares the word embedding; with pp > 1 the last stage keeps a replica of it (as Megatron does).",
    )
    params_dtype: str = Field("bfloat16", description="Dtype of the model parameters.")
    optimizer: Literal["adam"] = Field("adam", description="Adam(W): two fp32 moments per parameter.")
    master_weights: bool | None = Field(
        None, description="Keep an fp32 master copy in the optimizer; None means yes exactly when params are not fp32."
    )

    @field_validator("params_dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return canonical_dtype(value)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.state_bytes() > MAX_STATE_BYTES:
            raise ValueError(
                f"{self.state_bytes():.3g} bytes of parameters and optimizer state exceed {MAX_STATE_BYTES:.0e} "
                "(1 PB, the planner's limit)"
            )
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_query_groups={groups}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}; set kv_channels"
            )
        return self

    # ---- derived shapes -------------------------------------------------------
    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def uses_master_weights(self) -> bool:
        if self.master_weights is None:
            return self.params_dtype != "float32"
        return self.master_weights

    def optimizer_state_names(self) -> list[str]:
        """Per-parameter optimizer tensors, all fp32."""
        names = ["exp_avg", "exp_avg_sq"]
        return (["fp32_param"] + names) if self.uses_master_weights else names

    def num_parameters(self) -> int:
        """Closed-form parameter count (each tied tensor once), independent of the layout code."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.padded_vocab_size
        qkv_rows = (self.num_attention_heads + 2 * self.query_groups) * self.head_dim
        attn_out = self.num_attention_heads * self.head_dim
        norm = h * (2 if self.normalization == "layernorm" else 1)
        fc1_rows = f * (2 if self.gated_mlp else 1)
        per_layer = 2 * norm + qkv_rows * h + h * attn_out + fc1_rows * h + h * f
        if self.add_bias_linear:
            per_layer += qkv_rows + h + fc1_rows + h
        total = self.num_layers * per_layer + v * h + norm
        if self.position_embedding_type == "learned":
            total += self.max_position_embeddings * h
        if not self.tied_embeddings:
            total += v * h
        return total

    def state_bytes(self) -> int:
        """Bytes of parameters plus optimizer state, each element once."""
        per_param = DTYPE_BYTES[self.params_dtype] + 4 * len(self.optimizer_state_names())
        return self.num_parameters() * per_param

    def check_parallel(self, config: ParallelConfig) -> None:
        """Raise ValueError when ``config`` cannot shard this model (Megatron's divisibility rules)."""
        tp = config.tp
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        if self.query_groups % tp:
            problems.append(f"num_query_groups={self.query_groups}")
        if self.ffn_hidden_size % tp:
            problems.append(f"ffn_hidden_size={self.ffn_hidden_size}")
        if self.padded_vocab_size % tp:
            problems.append(f"padded vocab {self.padded_vocab_size}")
        if problems:
            raise ValueError(f"tp={tp} does not divide {', '.join(problems)} of {self.name}")
        if config.pp > self.num_layers:
            raise ValueError(f"pp={config.pp} exceeds the {self.num_layers} layers of {self.name}")

    # ---- files ----------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"model spec {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"model spec {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ValueError(f"model spec {str(path)!r} must be a mapping of fields")
        try:
            return cls(**data)
        except ValidationError as err:
            raise ValueError(f"model spec {str(path)!r}: {_first_error(err)}") from None
