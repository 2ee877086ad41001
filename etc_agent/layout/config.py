"""Parallel configuration and Megatron rank order.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline:
``rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx`` (Megatron-LM's default).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

_FIELDS = ("tp", "pp", "dp", "zero", "dp_replicate", "dp_shard")
"""Names of the short form; ``dp_replicate`` and ``dp_shard`` are torchtitan's split of ``dp``."""


class RankCoord(NamedTuple):
    """Coordinates of one rank in the (pp, dp, tp) grid."""

    pp: int
    dp: int
    tp: int


class ParallelConfig(BaseModel):
    """A hybrid-parallel configuration: tensor x pipeline x data parallel, optional ZeRO-1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(1, ge=1, description="Tensor-parallel degree (ranks that split each layer's matrices).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree (contiguous stages of layers).")
    dp: int = Field(1, ge=1, description="Data-parallel degree (replicas of every tp x pp shard).")
    zero: int = Field(
        0,
        ge=0,
        le=1,
        description="1: optimizer state is additionally split across the DP group (ZeRO-1 / "
        "Megatron distributed optimizer); 0: every DP replica holds its shard's full optimizer state.",
    )

    dp_shard: int = Field(
        1,
        ge=1,
        description="FSDP2 shard degree (torchtitan's dp_shard): data-parallel ranks that split every "
        "parameter and its optimizer state along dim 0 (ZeRO-3); dp = dp_replicate * dp_shard, so "
        "dp_shard = dp is plain FSDP and 1 < dp_shard < dp is HSDP. 1: no parameter sharding.",
    )

    @model_validator(mode="after")
    def _zero_needs_dp(self) -> ParallelConfig:
        from etc_agent.layout.devices import MAX_DEVICES

        if self.dp % self.dp_shard:
            raise ValueError(f"dp_shard={self.dp_shard} does not divide dp={self.dp} (dp = dp_replicate * dp_shard)")
        if self.zero and self.dp_shard > 1:
            raise ValueError("zero=1 with dp_shard > 1: FSDP already shards the optimizer state with the parameters")

        if self.tp * self.pp * self.dp > MAX_DEVICES:
            raise ValueError(
                f"tp*pp*dp = {self.tp * self.pp * self.dp} exceeds {MAX_DEVICES} devices (the planner's limit)"
            )
        if self.zero and self.dp == 1:
            raise ValueError(f"zero=1 needs dp > 1 (got {self.short()}): with one replica there is nothing to split")
        return self

    # ---- parsing and printing -------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parse the short form ``tp=4,pp=2,dp=2,zero=1``; missing fields default to 1 (zero to 0)."""
        values: dict[str, int] = {}
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            name, sep, raw = item.partition("=")
            if not sep or name not in _FIELDS:
                raise ValueError(
                    f"bad parallel config {text!r}: expected items like tp=4,pp=2,dp=2,zero=1, got {item!r}"
                )
            if name in values:
                raise ValueError(f"bad parallel config {text!r}: {name} given twice")
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"bad parallel config {text!r}: {name}={raw!r} is not an integer") from None
        if not values:
            raise ValueError(f"bad parallel config {text!r}: empty")
        if "dp_replicate" in values:
            replicate, shard = values.pop("dp_replicate"), values.get("dp_shard", 1)
            if "dp" in values and values["dp"] != replicate * shard:
                raise ValueError(
                    f"bad parallel config {text!r}: dp={values['dp']} is not dp_replicate * dp_shard = {replicate * shard}"
                )
            values["dp"] = replicate * shard
        elif "dp_shard" in values:
            values.setdefault("dp", values["dp_shard"])
        try:
            return cls(**values)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"bad parallel config {text!r}: {_first_error(err)}") from None

    def short(self) -> str:
        if self.dp_shard > 1:
            return f"tp={self.tp},pp={self.pp},dp_replicate={self.dp_replicate},dp_shard={self.dp_shard}"
        return f"tp={self.tp},pp={self.pp},dp={self.dp},zero={self.zero}"

    def __str__(self) -> str:
        return self.short()

    @property
    def dp_replicate(self) -> int:
        """Replicas of every FSDP shard group (torchtitan's dp_replicate); ``dp`` without FSDP."""
        return self.dp // self.dp_shard

    # ---- geometry -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def check_world_size(self, num_devices: int) -> None:
        """Raise ValueError unless this config uses exactly ``num_devices`` devices."""
        if self.world_size != num_devices:
            raise ValueError(
                f"{self.short()} needs tp*pp*dp = {self.world_size} devices, but the device set has {num_devices}"
            )

    def rank(self, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise IndexError(f"coordinate (pp={pp}, dp={dp}, tp={tp}) outside {self.short()}")
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return RankCoord(pp, dp, tp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks that share one tensor-parallel group (consecutive ranks)."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(pp, dp, tp) for dp in range(self.dp)] for pp in range(self.pp) for tp in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(pp, dp, tp) for pp in range(self.pp)] for dp in range(self.dp) for tp in range(self.tp)]


def _first_error(err: Exception) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(part) for part in first.get("loc", ()))
        msg = str(first.get("msg", err)).removeprefix("Value error, ")
        return f"{loc}: {msg}" if loc else msg
    return str(err)


class ParallelSpec(BaseModel):
    """What the user asked for with ``--parallel``: fixed degrees, any of which may be ``auto``.

    ``tp=2,pp=1,dp=auto`` keeps tp and pp and lets dp fill the devices; ``auto`` alone leaves every
    degree to the planner's policy (which needs a model spec). FSDP2 / HSDP in torchtitan's terms:
    ``tp=2,dp_shard=auto`` (plain FSDP over what tp leaves), ``dp_replicate=2,dp_shard=auto`` (HSDP
    with two replicas), ``dp_shard=8`` (shard groups of 8, as many replicas as fit).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int | None = Field(1, ge=1, description="Tensor-parallel degree; None = auto.")
    pp: int | None = Field(1, ge=1, description="Pipeline-parallel degree; None = auto.")
    dp: int | None = Field(None, ge=1, description="Data-parallel degree; None = auto (fill the devices).")
    zero: int = Field(0, ge=0, le=1, description="ZeRO-1 optimizer sharding (used when dp > 1).")
    dp_shard: int | None = Field(1, ge=1, description="FSDP2 shard degree; None = auto (fill the devices).")
    dp_replicate: int | None = Field(
        None, ge=1, description="Replicas of each FSDP shard group; None = whatever dp and dp_shard leave."
    )

    @classmethod
    def parse(cls, text: str) -> ParallelSpec:
        text = text.replace(" ", "")
        if text in ("", "auto"):
            return cls(tp=None, pp=None, dp=None)
        values: dict[str, int | None] = {}
        for item in text.split(","):
            name, sep, raw = item.partition("=")
            if not sep or name not in _FIELDS:
                raise ValueError(f"bad --parallel {text!r}: expected items like tp=2,pp=1,dp=auto,zero=1, got {item!r}")
            if name in values:
                raise ValueError(f"bad --parallel {text!r}: {name} given twice")
            if raw == "auto" and name != "zero":
                values[name] = None
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"bad --parallel {text!r}: {name}={raw!r} is neither an integer nor auto") from None
        values.setdefault("dp", None)
        if "dp_shard" in values or "dp_replicate" in values:
            if values["dp"] is not None:
                raise ValueError(f"bad --parallel {text!r}: give dp, or dp_replicate/dp_shard, not both")
            if values.get("dp_shard", 1) is None:
                if "dp_replicate" in values and values["dp_replicate"] is None:
                    raise ValueError(f"bad --parallel {text!r}: dp_replicate and dp_shard cannot both be auto")
                values.setdefault("dp_replicate", 1)  # dp_shard=auto alone: plain FSDP over every dp rank
            if values.get("zero"):
                raise ValueError(f"bad --parallel {text!r}: zero=1 with dp_shard: FSDP already shards the optimizer")
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"bad --parallel {text!r}: {_first_error(err)}") from None

    @property
    def fully_fixed(self) -> bool:
        return self.num_devices is not None

    @property
    def num_devices(self) -> int | None:
        """The devices a spec with no ``auto`` uses (dp, or dp_replicate x dp_shard); None otherwise."""
        if self.tp is None or self.pp is None:
            return None
        if self.dp_shard != 1 or self.dp_replicate is not None:
            if self.dp_shard is None or self.dp_replicate is None:
                return None
            return self.tp * self.pp * self.dp_replicate * self.dp_shard
        return None if self.dp is None else self.tp * self.pp * self.dp

    def short(self) -> str:
        def text(name: str) -> str:
            value = getattr(self, name)
            return f"{name}={'auto' if value is None else value}"

        if self.dp_shard != 1 or self.dp_replicate is not None:
            return ",".join(text(n) for n in ("tp", "pp", "dp_replicate", "dp_shard"))
        return ",".join([*(text(n) for n in ("tp", "pp", "dp")), f"zero={self.zero}"])

    def resolve(self, num_devices: int) -> ParallelConfig | None:
        """The config using the most of ``num_devices`` devices (None if none fits).

        Only ``dp`` may be auto here; ``tp``/``pp`` auto needs the policy and a model spec.
        """
        if self.tp is None or self.pp is None:
            raise ValueError(f"--parallel {self.short()}: tp/pp auto needs --model (the planner's policy chooses them)")
        unit = self.tp * self.pp
        if self.dp_shard != 1 or self.dp_replicate is not None:
            return self._resolve_fsdp(num_devices // unit)
        dp = self.dp if self.dp is not None else num_devices // unit
        if dp < 1 or dp * unit > num_devices:
            return None
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=dp, zero=self.zero if dp > 1 else 0)

    def _resolve_fsdp(self, num_dp_ranks: int) -> ParallelConfig | None:
        """FSDP/HSDP: the auto degree (shard, or else replicate) takes what the fixed one leaves."""
        if self.dp_shard is None:
            replicate = self.dp_replicate or 1
            shard = num_dp_ranks // replicate
        else:
            shard = self.dp_shard
            replicate = self.dp_replicate if self.dp_replicate is not None else num_dp_ranks // shard
        if shard < 1 or replicate < 1 or replicate * shard > num_dp_ranks:
            return None
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=replicate * shard, dp_shard=shard)
