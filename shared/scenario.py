"""Scenario files: the pydantic schema, the TOML loader, overrides and a TOML writer.

A scenario (DESIGN.md, "Scenarios") is the single input of both modes: the simulator
and the hardware driver read the same resolved `Scenario`, and a run directory stores
it back as TOML (`Scenario.to_toml`) so a run can be replayed exactly.

Bad input of any kind -- a TOML syntax error, an unknown key, a wrong type, a TP pair
the rank mapping cannot express, a staging pool too small for one chunk -- becomes one
`ScenarioError` whose message names the field as a dotted path (`decode.page_size`),
the value given and what is allowed. Callers print `str(err)`; nobody sees a pydantic
traceback.

Only the stdlib and pydantic are used (the `shared/` rule). File reads here are the
loader's job; the schema itself stays a pure function of its input plus the profile
file it names.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime, time
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from kvstage.shared.faults import FaultsConfig
from kvstage.shared.layout import DTYPE_BYTES, Geometry, LayoutError, validate_tp
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "HOST_FIELDS",
    "PRESETS",
    "PROFILE_FIELDS",
    "REPO_PROFILES",
    "DecodeConfig",
    "FaultsConfig",
    "HardwareConfig",
    "HostNumbers",
    "LinkNumbers",
    "LinksConfig",
    "ModelConfig",
    "ModelPreset",
    "PrefillConfig",
    "ResolvedLinks",
    "ScaleDown",
    "Scenario",
    "ScenarioError",
    "TransferConfig",
    "WorkloadConfig",
    "apply_overrides",
    "available_profiles",
    "dumps_toml",
    "load_scenario",
    "parse_override_value",
    "profile_dirs",
    "scenario_from_dict",
]

MIB = 1 << 20

# The repository's own profiles: the last place a profile name is looked up.
REPO_PROFILES = Path(__file__).resolve().parents[1] / "scenarios" / "profiles"


class ScenarioError(ValueError):
    """Bad scenario input, with one message meant for a human (no traceback needed).

    `field` is the dotted path of the (first) offending field when one is known.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _FieldProblem(ValueError):
    """Raised inside validators so that the error keeps its field path and value.

    Pydantic wraps a ValueError from a validator into a `value_error` whose location
    is the model being validated; for a cross-field check that location is too coarse
    (`decode` instead of `decode.prefix_tokens`). This carries the precise field(s),
    relative to that location, through pydantic to `_explain`.
    """

    def __init__(self, fields: Mapping[str, Any], reason: str) -> None:
        super().__init__(reason)
        self.fields = dict(fields)
        self.reason = reason


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Published KV geometry of a model: what the transfer moves, and params for FLOPs."""

    layers: int
    kv_heads: int
    head_dim: int
    params_b: float
    note: str = ""


# Numbers from each model's published config.json (num_hidden_layers,
# num_key_value_heads, hidden_size / num_attention_heads) and its model card.
PRESETS: dict[str, ModelPreset] = {
    "llama-2-7b": ModelPreset(32, 32, 128, 6.7, "multi-head attention: 32 KV heads"),
    "llama-3-8b": ModelPreset(32, 8, 128, 8.0),
    "llama-3.1-8b": ModelPreset(32, 8, 128, 8.0),
    "llama-3-70b": ModelPreset(80, 8, 128, 70.6),
    "llama-3.1-70b": ModelPreset(80, 8, 128, 70.6),
    "llama-3.1-405b": ModelPreset(126, 8, 128, 405.0),
    "llama-3.2-1b": ModelPreset(16, 8, 64, 1.24),
    "llama-3.2-3b": ModelPreset(28, 8, 128, 3.2),
    "mistral-7b": ModelPreset(32, 8, 128, 7.3),
    "qwen2.5-0.5b": ModelPreset(24, 2, 64, 0.49, "2 KV heads: replication from TP 4"),
    "qwen2.5-7b": ModelPreset(28, 4, 128, 7.6),
    "qwen2.5-14b": ModelPreset(48, 8, 128, 14.7),
    "qwen2.5-32b": ModelPreset(64, 8, 128, 32.5),
    "qwen2.5-72b": ModelPreset(80, 8, 128, 72.7),
}

# --------------------------------------------------------------------------- profiles

# The optional host model (sim/host.py), opt-in per profile: with host_model =
# "cpu-loop" every rank is ONE single-threaded loop (hw/rank.py) that serialises its
# event handling, pattern fills, gathers and scatters, and that loop work is slowed by
# the host's CPU sharing. Absent (or "gpu"): the default GPU model, unchanged.
#   host_model          "gpu" | "cpu-loop"
#   host_cores          CPU cores the P + D rank processes share (cpu-loop only)
#   engine_thread_cores cores each rank process's transfer engine keeps busy on its
#                       own (e.g. NIXL's UCX progress thread), >= 0
#   event_us            loop CPU time of handling one delivered event (message,
#                       completion) in a rank loop, before CPU sharing
#   fill_latency_us     hw-mode prefill 'forward' (pattern fill of one chunk):
#   fill_bandwidth_gbs    t = fill_latency + KV bytes of the chunk / fill_bandwidth (GB/s)
HOST_FIELDS: tuple[str, ...] = (
    "host_model",
    "host_cores",
    "engine_thread_cores",
    "event_us",
    "fill_latency_us",
    "fill_bandwidth_gbs",
)
HostModel = Literal["gpu", "cpu-loop"]

# Profile fields in the units people quote them in (Gbit/s for links, GB/s for HBM,
# microseconds, TFLOP/s). `ResolvedLinks` holds the same numbers in SI units.
PROFILE_FIELDS: tuple[str, ...] = (
    "inter_bandwidth_gbps",
    "inter_latency_us",
    "inter_per_request_us",
    "intra_bandwidth_gbps",
    "intra_latency_us",
    "intra_per_request_us",
    "control_latency_us",
    "gpus_per_nic",
    "mem_bandwidth_gbs",
    "kernel_launch_us",
    "gpu_tflops",
    *HOST_FIELDS,
)
_COMMON_FIELDS = (
    "control_latency_us",
    "gpus_per_nic",
    "mem_bandwidth_gbs",
    "kernel_launch_us",
    "gpu_tflops",
)


def _placement_fields(placement: str) -> tuple[str, str, str]:
    return (f"{placement}_bandwidth_gbps", f"{placement}_latency_us", f"{placement}_per_request_us")


@dataclass(frozen=True, slots=True)
class LinkNumbers:
    """One link class in SI units."""

    bandwidth_bytes_s: float
    latency_s: float
    per_request_s: float  # fixed cost of each transfer request (post, completion)


@dataclass(frozen=True, slots=True)
class HostNumbers:
    """The cpu-loop host model's inputs in SI units (see HOST_FIELDS)."""

    cores: float
    engine_thread_cores: float
    event_s: float
    fill_latency_s: float
    fill_bandwidth_bytes_s: float


@dataclass(frozen=True, slots=True)
class ResolvedLinks:
    """The profile merged with the [links] overrides, in SI units.

    `link` is the link KV transfers take for this placement (inter: NIC between
    nodes; intra: NVLink inside a node). `inter` / `intra` are None when the profile
    has no numbers for that class (e.g. the intra-node-only `nvlink` profile).
    """

    profile: str  # the name or path as written in the scenario
    profile_path: str | None  # the file read, None when every number was explicit
    source: str
    placement: Literal["inter", "intra"]
    link: LinkNumbers
    inter: LinkNumbers | None
    intra: LinkNumbers | None
    control_latency_s: float
    gpus_per_nic: int
    mem_bandwidth_bytes_s: float
    kernel_launch_s: float
    gpu_flops: float
    host: HostNumbers | None = None  # None: the default GPU model (host_model absent or "gpu")


# --------------------------------------------------------------------------- field types

# Upper bounds keep absurd values (from typos or fuzzing) from turning into huge
# loops or float overflow downstream; they are far above any real deployment.
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
TPSize = Annotated[int, Field(ge=1, le=1024)]
PosFloat = Annotated[float, Field(gt=0, le=1e15)]
NonNegFloat = Annotated[float, Field(ge=0, le=1e15)]
PoolMiB = Annotated[float, Field(ge=0, le=1e9)]


class _Table(BaseModel):
    """Common config: unknown keys rejected, TOML types taken literally, immutable.

    strict=True because TOML values are already typed: `tp = true` or `tp = 2.5`
    should be an error, not silently 1 or truncated. (A float field accepts an int.)
    frozen=True because the cross-field checks ran at validation; mutating a field
    afterwards would bypass them. Use `apply_overrides` / `scenario_from_dict`.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- tables


class ModelConfig(_Table):
    """[model]: a preset, or explicit geometry; explicit fields override the preset."""

    preset: str | None = None
    layers: PosInt
    kv_heads: Annotated[int, Field(ge=1, le=1024)]
    head_dim: PosInt
    params_b: PosFloat  # billions of parameters, for 2 * params * tokens FLOPs
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            raise _FieldProblem(
                {"preset": name}, f"unknown model preset; allowed: {', '.join(PRESETS)}"
            )
        p = PRESETS[name]
        base = {
            "layers": p.layers,
            "kv_heads": p.kv_heads,
            "head_dim": p.head_dim,
            "params_b": p.params_b,
        }
        return {**base, **data}

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


class PrefillConfig(_Table):
    """[prefill]: TP size and how long a forward takes."""

    tp: TPSize
    chunked_prefill_size: PosInt = 8192
    tokens_per_s: PosFloat | None = None  # if set: forward time = tokens / tokens_per_s
    tflops: PosFloat = 400.0  # sustained per GPU, for 2 * params * tokens / tp FLOPs


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class DecodeConfig(_Table):
    """[decode]: TP size, KV paging and the staging pool of each decode rank."""

    tp: TPSize
    page_size: PosInt = 16
    staging_pool_mb: PoolMiB = 4096.0  # MiB per decode rank
    prefix_tokens: NonNegInt = 0  # decode-side cached prefix of every request

    @field_validator("page_size")
    @classmethod
    def _page_power_of_two(cls, v: int) -> int:
        if not _is_power_of_two(v):
            raise ValueError("page_size must be a power of two (1, 2, 4, 8, 16, 32, ...)")
        return v

    @model_validator(mode="after")
    def _prefix_page_aligned(self) -> DecodeConfig:
        # A prefix that is not page aligned would shift every page of the copy.
        if self.prefix_tokens % self.page_size:
            raise _FieldProblem(
                {"prefix_tokens": self.prefix_tokens},
                f"must be a multiple of decode.page_size = {self.page_size} "
                f"(e.g. {self.prefix_tokens // self.page_size * self.page_size})",
            )
        return self


class TransferConfig(_Table):
    """[transfer]: staged bulk writes, or the per-slice baseline."""

    path: Literal["staging", "slice"] = "staging"
    room_timeout_s: PosFloat = 60.0


class _ProfileNumbers(_Table):
    """The numbers a hardware profile gives (PROFILE_FIELDS), all optional: the
    fields of a profile file, and the per-field overrides in [links]."""

    inter_bandwidth_gbps: PosFloat | None = None
    inter_latency_us: NonNegFloat | None = None
    inter_per_request_us: NonNegFloat | None = None
    intra_bandwidth_gbps: PosFloat | None = None
    intra_latency_us: NonNegFloat | None = None
    intra_per_request_us: NonNegFloat | None = None
    control_latency_us: NonNegFloat | None = None
    gpus_per_nic: Annotated[int, Field(ge=1, le=1024)] | None = None
    mem_bandwidth_gbs: PosFloat | None = None
    kernel_launch_us: NonNegFloat | None = None
    gpu_tflops: PosFloat | None = None
    # host model (opt-in; see HOST_FIELDS): all five numbers are needed with "cpu-loop"
    host_model: HostModel | None = None
    host_cores: Annotated[float, Field(gt=0, le=1e6)] | None = None
    engine_thread_cores: Annotated[float, Field(ge=0, le=1e6)] | None = None
    event_us: NonNegFloat | None = None
    fill_latency_us: NonNegFloat | None = None
    fill_bandwidth_gbs: PosFloat | None = None


class LinksConfig(_ProfileNumbers):
    """[links]: a named hardware profile plus optional per-field overrides.

    The profile is resolved at validation (see `profile_dirs`); `resolved()` gives
    the merged numbers in SI units.

    Host model (opt-in, HOST_FIELDS): `host_model = "cpu-loop"` makes the simulator
    model each rank as the single-threaded loop of hardware mode (sim/host.py):
    `host_cores` cores shared by the P + D rank loops and their engines'
    `engine_thread_cores` each, `event_us` of loop time per delivered event, and the
    pattern-fill forward `fill_latency_us` + KV bytes / `fill_bandwidth_gbs`.
    `kvstage calibrate` writes all of them; absent or "gpu" keeps the GPU model.
    """

    profile: str = "rdma-400g"
    placement: Literal["inter", "intra"] = "inter"
    source: str | None = None  # where the numbers come from; defaults to the profile's

    _resolved: ResolvedLinks | None = PrivateAttr(default=None)
    _merged: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> LinksConfig:
        base_dir = (info.context or {}).get("base_dir")
        self._merged, self._resolved = _resolve_links(self, base_dir)
        return self

    def resolved(self) -> ResolvedLinks:
        """The profile merged with the overrides, in bytes/s, seconds and FLOP/s."""
        if self._resolved is None:  # only when built without validation
            self._merged, self._resolved = _resolve_links(self, None)
        return self._resolved


class WorkloadConfig(_Table):
    """[workload]: how many requests, when they arrive and how long their prompts are.

    See `shared.workload.generate_requests` for the exact processes.
    """

    requests: PosInt = 16
    arrival: Literal["poisson", "fixed", "burst", "trace"] = "poisson"
    rate_per_s: PosFloat = 2.0
    burst_size: PosInt = 8
    trace_csv: str | None = None  # columns arrival_s,prompt_tokens[,prefix_tokens]
    prompt: Literal["fixed", "uniform", "lognormal", "csv"] = "fixed"
    prompt_tokens: PosInt = 8192  # fixed length; lognormal median
    prompt_min: PosInt = 1024
    prompt_max: PosInt = 32768
    prompt_sigma: NonNegFloat = 0.5
    # Cap applied to every prompt after sampling (also trace rows); scale-down sets it.
    max_prompt_tokens: PosInt | None = None
    seed: Annotated[int, Field(ge=0)] = 0  # Random(-s) == Random(s): refuse negatives

    @model_validator(mode="before")
    @classmethod
    def _anchor_trace(cls, data: Any, info: ValidationInfo) -> Any:
        # A relative trace path means relative to the scenario file, so the resolved
        # scenario (and its run-directory copy) holds an absolute path.
        if isinstance(data, dict) and isinstance(data.get("trace_csv"), str):
            base_dir = (info.context or {}).get("base_dir")
            p = Path(data["trace_csv"]).expanduser()
            if not p.is_absolute() and base_dir is not None:
                p = Path(base_dir) / p
            if data["trace_csv"]:
                data = {**data, "trace_csv": str(p.resolve())}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadConfig:
        if self.prompt_min > self.prompt_max:
            raise _FieldProblem(
                {"prompt_min": self.prompt_min, "prompt_max": self.prompt_max},
                "prompt_min must be <= prompt_max",
            )
        if self.prompt == "lognormal" and not (
            self.prompt_min <= self.prompt_tokens <= self.prompt_max
        ):
            raise _FieldProblem(
                {"prompt_tokens": self.prompt_tokens},
                f"the lognormal median must lie in [prompt_min, prompt_max] = "
                f"[{self.prompt_min}, {self.prompt_max}]",
            )
        needs_csv = self.arrival == "trace" or self.prompt == "csv"
        if needs_csv and not self.trace_csv:
            raise _FieldProblem(
                {"trace_csv": self.trace_csv},
                'required when arrival = "trace" or prompt = "csv" '
                "(a CSV with columns arrival_s,prompt_tokens[,prefix_tokens])",
            )
        if needs_csv and self.trace_csv and not Path(self.trace_csv).is_file():
            raise _FieldProblem({"trace_csv": self.trace_csv}, "no such file")
        return self


class ScaleDown(_Table):
    """[hardware.scale_down]: shrink a big case so it runs in host memory on a laptop.

    TP sizes (the geometry under test) never change; only sizes do, and only down.
    `chunked_prefill_size` is here so a shrunken prompt still spans several chunks.
    """

    enabled: bool = False
    layers: PosInt | None = None
    requests: PosInt | None = None
    max_prompt_tokens: PosInt | None = None
    staging_pool_mb: PoolMiB | None = None
    chunked_prefill_size: PosInt | None = None


class HardwareConfig(_Table):
    """[hardware]: options of the real-transfer mode (ignored by the simulator)."""

    backend: Literal["nixl", "mooncake"] = "nixl"
    device: Literal["cpu", "cuda"] = "cpu"
    verify: Literal["full", "sample", "off"] = "full"
    forward_delay: bool = False  # sleep for the modeled prefill forward time
    scale_down: ScaleDown = Field(default_factory=ScaleDown)


class ExpectConfig(_Table):
    """[expect]: the outcome a (fault) scenario must end with; `kvstage sim`/`hw`
    check it and exit 1 when it does not hold."""

    # None: no expectation; [] : every room done; [2, 5]: exactly these rooms fail
    failed_rooms: list[Annotated[int, Field(ge=0)]] | None = None
    reason_contains: str = ""  # every failed room's reason contains this text
    hw_run_fails: bool = False  # hardware mode: the run itself must fail (e.g. a killed rank)


_OPTIONAL_TABLES = ("transfer", "links", "workload", "hardware", "faults", "expect")


class Scenario(_Table):
    """One scenario: everything both modes need, validated and resolved."""

    name: Annotated[str, Field(min_length=1)] = "scenario"
    description: str = ""
    model: ModelConfig
    prefill: PrefillConfig
    decode: DecodeConfig
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    links: LinksConfig = Field(default_factory=LinksConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    expect: ExpectConfig = Field(default_factory=ExpectConfig)

    _base_dir: Path | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _fill_tables(cls, data: Any) -> Any:
        # Missing tables are validated as empty ones, so that defaults (the links
        # profile in particular) resolve with this scenario's context.
        if isinstance(data, dict):
            data = dict(data)
            for key in _OPTIONAL_TABLES:
                data.setdefault(key, {})
        return data

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> Scenario:
        base_dir = (info.context or {}).get("base_dir")
        self._base_dir = Path(base_dir) if base_dir is not None else None
        _check_tp_mapping(self.prefill.tp, self.decode.tp, self.model.kv_heads)
        if self.transfer.path == "staging":
            # The slice path writes straight into the KV pool, so any pool (even 0)
            # is fine there; staging needs room for at least one full chunk.
            geo = self.geometry()
            _check_pool(
                geo, self.pool_bytes, {"decode.staging_pool_mb": self.decode.staging_pool_mb}
            )
            sd = self.hardware.scale_down
            if sd.staging_pool_mb is not None:
                sgeo = _scaled_geometry(geo, sd)
                pool = min(self.pool_bytes, _mib_to_bytes(sd.staging_pool_mb))
                _check_pool(sgeo, pool, {"hardware.scale_down.staging_pool_mb": sd.staging_pool_mb})
        return self

    # --- derived numbers ---------------------------------------------------------
    def geometry(self) -> Geometry:
        """The layout geometry (shared.layout) of this scenario."""
        return Geometry(
            prefill_tp=self.prefill.tp,
            decode_tp=self.decode.tp,
            total_kv_heads=self.model.kv_heads,
            layers=self.model.layers,
            head_dim=self.model.head_dim,
            dtype_bytes=self.model.dtype_bytes,
            page_size=self.decode.page_size,
            chunked_prefill_size=self.prefill.chunked_prefill_size,
        )

    @property
    def pool_bytes(self) -> int:
        """Staging pool of one decode rank in bytes (staging_pool_mb is MiB)."""
        return _mib_to_bytes(self.decode.staging_pool_mb)

    @property
    def base_dir(self) -> Path | None:
        """Directory relative paths were resolved against (the scenario file's)."""
        return self._base_dir

    def forward_time_s(self, tokens: int) -> float:
        """Modeled prefill forward time of `tokens` tokens on one prefill rank.

        One home for the formula so the simulator and `hardware.forward_delay` agree:
        tokens / tokens_per_s when given, else 2 * params * tokens / tp FLOPs at
        `prefill.tflops` sustained (attention's quadratic term is ignored).
        """
        if self.prefill.tokens_per_s is not None:
            return tokens / self.prefill.tokens_per_s
        flops = 2.0 * self.model.params_b * 1e9 * tokens / self.prefill.tp
        return flops / (self.prefill.tflops * 1e12)

    # --- transforms --------------------------------------------------------------
    def scaled(self) -> Scenario:
        """This scenario with [hardware.scale_down] applied, or itself when disabled.

        Sizes only shrink (each is min(current, scale-down value)); TP sizes, KV
        heads, head_dim and page size stay, so the rank mapping under test is the
        same. params_b shrinks with the layer count so the modeled forward time stays
        per-layer faithful.
        """
        sd = self.hardware.scale_down
        if not sd.enabled:
            return self
        data = self.model_dump(exclude_none=True)
        if sd.layers is not None and sd.layers < self.model.layers:
            data["model"]["layers"] = sd.layers
            data["model"]["params_b"] = self.model.params_b * sd.layers / self.model.layers
        if sd.requests is not None:
            data["workload"]["requests"] = min(self.workload.requests, sd.requests)
        if sd.max_prompt_tokens is not None:
            cap = sd.max_prompt_tokens
            w = data["workload"]
            if self.workload.max_prompt_tokens is not None:
                cap = min(cap, self.workload.max_prompt_tokens)
            w["max_prompt_tokens"] = cap
            for key in ("prompt_tokens", "prompt_min", "prompt_max"):
                w[key] = min(w[key], cap)
        if sd.staging_pool_mb is not None:
            data["decode"]["staging_pool_mb"] = min(self.decode.staging_pool_mb, sd.staging_pool_mb)
        if sd.chunked_prefill_size is not None:
            data["prefill"]["chunked_prefill_size"] = min(
                self.prefill.chunked_prefill_size, sd.chunked_prefill_size
            )
        return scenario_from_dict(data, self._base_dir, source=f"{self.name} (scaled down)")

    def to_toml(self) -> str:
        """The resolved scenario as TOML; `load_scenario` of it gives this scenario back.

        Link numbers are written out explicitly, so the file still loads where the
        profile file is not found (a run directory copied elsewhere).
        """
        data = self.model_dump(exclude_none=True)
        r = self.links.resolved()
        profile = r.profile_path if r.profile_path and _looks_like_path(r.profile) else r.profile
        links: dict[str, Any] = {"profile": profile, "placement": r.placement, "source": r.source}
        for key in PROFILE_FIELDS:
            if self.links._merged.get(key) is not None:
                links[key] = self.links._merged[key]
        data["links"] = links
        header = (
            f"# kvstage scenario {self.name!r}, resolved (defaults, preset and profile\n"
            f"# {r.profile!r} filled in). Load it with load_scenario().\n"
        )
        return header + dumps_toml(data)


# --------------------------------------------------------------------------- checks


def _mib_to_bytes(mib: float) -> int:
    return int(mib * MIB)


def _fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.6g}"


def _check_tp_mapping(prefill_tp: int, decode_tp: int, kv_heads: int) -> None:
    try:
        validate_tp(prefill_tp, decode_tp, kv_heads)
    except LayoutError as exc:
        big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
        if big % small:
            fields: dict[str, Any] = {"prefill.tp": prefill_tp, "decode.tp": decode_tp}
        elif prefill_tp % kv_heads and kv_heads % prefill_tp:
            fields = {"prefill.tp": prefill_tp, "model.kv_heads": kv_heads}
        else:
            fields = {"decode.tp": decode_tp, "model.kv_heads": kv_heads}
        raise _FieldProblem(fields, str(exc)) from None


def _scaled_geometry(geo: Geometry, sd: ScaleDown) -> Geometry:
    layers = min(geo.layers, sd.layers) if sd.layers is not None else geo.layers
    cps = geo.chunked_prefill_size
    if sd.chunked_prefill_size is not None:
        cps = min(cps, sd.chunked_prefill_size)
    return replace(geo, layers=layers, chunked_prefill_size=cps)


def _check_pool(geo: Geometry, pool_bytes: int, fields: dict[str, Any]) -> None:
    need = geo.chunk_bytes()
    if pool_bytes >= need:
        return
    tokens = geo.grid_pages * geo.page_size
    heads = need // (2 * geo.layers * tokens * geo.head_dim * geo.dtype_bytes)
    raise _FieldProblem(
        fields,
        f"the staging pool ({_fmt_mib(pool_bytes)} MiB) is smaller than one full chunk on "
        f"a decode rank ({_fmt_mib(need)} MiB = {tokens} tokens x {geo.layers} layers x K,V "
        f"x {heads} heads x {geo.head_dim} x {geo.dtype_bytes} B); the minimum is "
        f'{math.ceil(need / MIB)} MiB (or use transfer.path = "slice")',
    )


# --------------------------------------------------------------------------- profiles


def _looks_like_path(profile: str) -> bool:
    return "/" in profile or "\\" in profile or profile.endswith(".toml")


def profile_dirs(base_dir: str | Path | None = None) -> list[Path]:
    """Where a profile name is looked up, in order (duplicates removed).

    <scenario dir>/profiles, <scenario dir>/../profiles, then the repository's
    scenarios/profiles.
    """
    dirs: list[Path] = []
    if base_dir is not None:
        b = Path(base_dir)
        dirs += [b / "profiles", b.parent / "profiles"]
    dirs.append(REPO_PROFILES)
    seen: set[Path] = set()
    out = []
    for d in dirs:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def available_profiles(base_dir: str | Path | None = None) -> list[str]:
    """Profile names that `links.profile` can name from a scenario in `base_dir`."""
    names: set[str] = set()
    for d in profile_dirs(base_dir):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


class _ProfileFile(_ProfileNumbers):
    """A profile file: the [links] numbers plus where they come from."""

    source: str = ""


def _find_profile(profile: str, base_dir: Path | None) -> Path | None:
    if _looks_like_path(profile):
        p = Path(profile).expanduser()
        candidates = [p]
        if not p.is_absolute() and base_dir is not None:
            candidates.append(base_dir / p)
    else:
        candidates = [d / f"{profile}.toml" for d in profile_dirs(base_dir)]
    return next((c for c in candidates if c.is_file()), None)


def _read_profile(path: Path, profile: str) -> _ProfileFile:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise _FieldProblem({"profile": profile}, f"{path}: invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _FieldProblem({"profile": profile}, f"{path}: cannot read: {exc}") from None
    try:
        return _ProfileFile.model_validate(data)
    except ValidationError as exc:
        raise _FieldProblem(
            {"profile": profile}, str(_explain(exc, str(path), _ProfileFile))
        ) from None


def _resolve_links(
    links: LinksConfig, base_dir: str | Path | None
) -> tuple[dict[str, Any], ResolvedLinks]:
    """Merge profile file and overrides; check the numbers the placement needs exist."""
    bdir = Path(base_dir) if base_dir is not None else None
    explicit = {k: getattr(links, k) for k in PROFILE_FIELDS if getattr(links, k) is not None}
    needed = (*_placement_fields(links.placement), *_COMMON_FIELDS)
    path = _find_profile(links.profile, bdir)
    merged: dict[str, Any] = {}
    source = ""
    if path is not None:
        pf = _read_profile(path, links.profile)
        merged = {k: getattr(pf, k) for k in PROFILE_FIELDS if getattr(pf, k) is not None}
        source = pf.source
    elif not all(k in explicit for k in needed):
        # Without a profile file, a scenario that spells out every number it needs
        # still loads (that is what to_toml writes); otherwise the name is wrong.
        where = "file not found" if _looks_like_path(links.profile) else "unknown profile"
        raise _FieldProblem(
            {"profile": links.profile},
            f"{where}; available: {', '.join(available_profiles(bdir)) or '(none)'} "
            f"(searched {', '.join(str(d) for d in profile_dirs(bdir))}; a path to a "
            ".toml file also works)",
        )
    merged.update(explicit)
    for key in needed:
        if merged.get(key) is None:
            raise _FieldProblem(
                {key: None},
                f"profile {links.profile!r} has no {key}, needed with placement = "
                f'"{links.placement}"; set links.{key} or choose another placement/profile',
            )
    if links.source is not None:
        source = links.source
    elif path is None:
        source = "explicit [links] numbers"

    def numbers(cls: str) -> LinkNumbers | None:
        bw, lat, per = (merged.get(k) for k in _placement_fields(cls))
        if bw is None or lat is None or per is None:
            return None
        return LinkNumbers(bw * 1e9 / 8, lat / 1e6, per / 1e6)

    inter, intra = numbers("inter"), numbers("intra")
    link = inter if links.placement == "inter" else intra
    host = None
    if merged.get("host_model", "gpu") == "cpu-loop":
        for key in HOST_FIELDS[1:]:
            if merged.get(key) is None:
                raise _FieldProblem(
                    {key: None},
                    f'profile {links.profile!r} has host_model = "cpu-loop" but no {key}; '
                    f"set links.{key} (kvstage calibrate writes all of {', '.join(HOST_FIELDS)}) "
                    'or host_model = "gpu"',
                )
        host = HostNumbers(
            cores=float(merged["host_cores"]),
            engine_thread_cores=float(merged["engine_thread_cores"]),
            event_s=merged["event_us"] / 1e6,
            fill_latency_s=merged["fill_latency_us"] / 1e6,
            fill_bandwidth_bytes_s=merged["fill_bandwidth_gbs"] * 1e9,
        )
    assert link is not None  # checked through `needed` above
    resolved = ResolvedLinks(
        profile=links.profile,
        profile_path=str(path.resolve()) if path is not None else None,
        source=source,
        placement=links.placement,
        link=link,
        inter=inter,
        intra=intra,
        control_latency_s=merged["control_latency_us"] / 1e6,
        gpus_per_nic=merged["gpus_per_nic"],
        mem_bandwidth_bytes_s=merged["mem_bandwidth_gbs"] * 1e9,
        kernel_launch_s=merged["kernel_launch_us"] / 1e6,
        gpu_flops=merged["gpu_tflops"] * 1e12,
        host=host,
    )
    return merged, resolved


# --------------------------------------------------------------------------- errors


def _fmt_value(value: Any) -> str:
    """A value as the user would write it in TOML (shortened when long)."""
    try:
        text = _toml_value(value)
    except TypeError:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _join(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _table_at(loc: Sequence[Any], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class of the table at `loc`, or None if it is not a known table."""
    cls: type[BaseModel] = root
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _explain_one(err: Mapping[str, Any], root: type[BaseModel]) -> tuple[str, str]:
    """(field path, one line) for one pydantic error."""
    loc = list(err.get("loc", ()))
    ctx = err.get("ctx") or {}
    problem = ctx.get("error")
    if isinstance(problem, _FieldProblem):
        parts = []
        first = None
        for rel, value in problem.fields.items():
            path = rel if "." in rel else _join([*loc, rel])
            first = first or path
            parts.append(f"{path} = {_fmt_value(value)}" if value is not None else path)
        return first or _join(loc), f"{', '.join(parts)}: {problem.reason}"
    path = _join(loc) or "(scenario)"
    kind = err.get("type")
    if kind == "extra_forbidden":
        table = _table_at(loc[:-1], root)
        where = f"[{_join(loc[:-1])}]" if loc[:-1] else "the top level"
        allowed = ", ".join(table.model_fields) if table is not None else "?"
        return path, f"{path}: unknown key; allowed keys in {where}: {allowed}"
    if kind == "missing":
        if loc[:1] == ["model"] and len(loc) == 2:
            return path, (
                f"{path}: missing; set model.preset (one of: {', '.join(PRESETS)}) or give "
                "model.layers, model.kv_heads, model.head_dim and model.params_b"
            )
        return path, f"{path}: missing (required)"
    msg = str(err.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    if kind == "model_type":
        msg = "expected a table"
    return path, f"{path} = {_fmt_value(err.get('input'))}: {msg}"


def _explain(
    exc: ValidationError, source: str | None = None, root: type[BaseModel] | None = None
) -> ScenarioError:
    """One ScenarioError for a pydantic ValidationError: one line per problem.

    `root` is the model that was validated (for the allowed keys of a table).
    """
    lines: list[str] = []
    first_field = None
    for err in exc.errors(include_url=False):
        field, line = _explain_one(err, root or Scenario)
        first_field = first_field or field
        if line not in lines:
            lines.append(line)
    prefix = f"{source}: " if source else ""
    if len(lines) == 1:
        return ScenarioError(prefix + lines[0], first_field)
    body = "\n".join(f"  {line}" for line in lines)
    return ScenarioError(f"{prefix}{len(lines)} problems:\n{body}", first_field)


# --------------------------------------------------------------------------- loading


def scenario_from_dict(
    data: Mapping[str, Any], base_dir: str | Path | None = None, *, source: str | None = None
) -> Scenario:
    """Validate a scenario given as nested dicts (parsed TOML).

    `base_dir` anchors relative paths (profile, trace CSV) and the profile search;
    `source` (a file name) prefixes error messages.
    """
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source or 'scenario'}: expected a table, got {_fmt_value(data)}")
    context = {"base_dir": Path(base_dir) if base_dir is not None else None}
    try:
        return Scenario.model_validate(dict(data), context=context)
    except ValidationError as exc:
        raise _explain(exc, source) from None


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read a scenario TOML file, apply "dotted.key=value" overrides, validate.

    `name` defaults to the file stem. Raises ScenarioError for any bad input.
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such scenario file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: cannot read: {exc}") from None
    data = apply_overrides(data, overrides)
    data.setdefault("name", p.stem)
    return scenario_from_dict(data, p.parent, source=str(p))


def parse_override_value(raw: str) -> Any:
    """An override value as a TOML value (512, 1.5, true, "x", [1, 2]), else the bare string."""
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    return doc["v"] if set(doc) == {"v"} else raw


def _is_str_field(annotation: Any) -> bool:
    if annotation is str:
        return True
    return get_origin(annotation) is not None and str in get_args(annotation)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each "dotted.key=value" override set.

    Keys are checked against the schema, so a typo fails here with the allowed keys
    at that level instead of being silently added. A value for a string field is
    kept as typed (so `name=123` is the string "123").
    """
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            raise ScenarioError(
                f"override {item!r}: expected dotted.key=value, e.g. decode.page_size=32"
            )
        value: Any = parse_override_value(raw.strip())
        cls: type[BaseModel] | None = Scenario
        node = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = f"[{'.'.join(parts[:i])}]" if i else "the top level"
            if cls is not None:
                field = cls.model_fields.get(part)
                if field is None:
                    if cls.model_config.get("extra") == "allow":
                        cls = None  # free-form table ([faults]): any key
                    else:
                        raise ScenarioError(
                            f"override {item!r}: unknown key {part!r} in {where}; allowed: "
                            f"{', '.join(cls.model_fields)}",
                            key,
                        )
                else:
                    ann = field.annotation
                    sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
                    if last and _is_str_field(ann) and not isinstance(value, str):
                        value = raw.strip()
                    if not last and sub is None and get_origin(ann) is dict:
                        # a mapping field (faults.drop.WATERMARK=0.01): keys are
                        # checked by the schema when the scenario validates
                        cls = None
                        node = node.setdefault(part, {})
                        continue
                    if not last and sub is None:
                        raise ScenarioError(
                            f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, "
                            "not a table",
                            key,
                        )
                    cls = sub
            if last:
                node[part] = value
            else:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ScenarioError(
                        f"override {item!r}: {'.'.join(parts[: i + 1])} is "
                        f"{_fmt_value(child)}, not a table",
                        key,
                    )
                node = child
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


# --------------------------------------------------------------------------- TOML out

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_str(key)


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # shortest round-trip form, always valid TOML
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, datetime | date | time):
        return v.isoformat()
    if isinstance(v, Mapping):
        inner = ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items())
        return "{" + (f" {inner} " if inner else "") + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        raise TypeError("TOML has no null")
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for nested dicts of str/int/float/bool/lists (None skipped).

    tomllib only reads; this writes what tomllib reads back to the same dict.
    """
    lines: list[str] = []
    _emit_table(data, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _emit_table(data: Mapping[str, Any], prefix: tuple[str, ...], lines: list[str]) -> None:
    scalars = [(k, v) for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, Mapping)]
    if prefix and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_toml_key(p) for p in prefix) + "]")
    for k, v in scalars:
        lines.append(f"{_toml_key(str(k))} = {_toml_value(v)}")
    for k, v in tables:
        _emit_table(v, (*prefix, str(k)), lines)
