"""Parallel configuration and Megatron rank order.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline:
``rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx`` (Megatron-LM's default).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

_FIELDS = ("tp", "pp", "dp", "zero")


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

    @model_validator(mode="after")
    def _zero_needs_dp(self) -> ParallelConfig:
        from etc_agent.layout.devices import MAX_DEVICES

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
        try:
            return cls(**values)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"bad parallel config {text!r}: {_first_error(err)}") from None

    def short(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp},zero={self.zero}"

    def __str__(self) -> str:
        return self.short()

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
    degree to the planner's policy (which needs a model spec).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int | None = Field(1, ge=1, description="Tensor-parallel degree; None = auto.")
    pp: int | None = Field(1, ge=1, description="Pipeline-parallel degree; None = auto.")
    dp: int | None = Field(None, ge=1, description="Data-parallel degree; None = auto (fill the devices).")
    zero: int = Field(0, ge=0, le=1, description="ZeRO-1 optimizer sharding (used when dp > 1).")

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
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"bad --parallel {text!r}: {_first_error(err)}") from None

    @property
    def fully_fixed(self) -> bool:
        return None not in (self.tp, self.pp, self.dp)

    def short(self) -> str:
        parts = [f"{n}={'auto' if getattr(self, n) is None else getattr(self, n)}" for n in ("tp", "pp", "dp")]
        return ",".join(parts + [f"zero={self.zero}"])

    def resolve(self, num_devices: int) -> ParallelConfig | None:
        """The config using the most of ``num_devices`` devices (None if none fits).

        Only ``dp`` may be auto here; ``tp``/``pp`` auto needs the policy and a model spec.
        """
        if self.tp is None or self.pp is None:
            raise ValueError(f"--parallel {self.short()}: tp/pp auto needs --model (the planner's policy chooses them)")
        unit = self.tp * self.pp
        dp = self.dp if self.dp is not None else num_devices // unit
        if dp < 1 or dp * unit > num_devices:
            return None
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=dp, zero=self.zero if dp > 1 else 0)
