"""The scenario schema: one pydantic model per TOML table, and `Scenario` on top.

A scenario (docs/reference.md, "Scenario sections") is the single input of both modes: the simulator
and the hardware driver read the same resolved `Scenario`, and a run directory stores
it back as TOML (`Scenario.to_toml`) so a run can be replayed exactly.

Validation is also resolution: the model preset is filled in, relative paths are
anchored at the scenario file, the [links] profile is read (profiles.py), and the
cross-field checks (TP mapping, staging pool >= one chunk) run. A failing check
raises `_FieldProblem`, which `errors._explain` turns into one clear ScenarioError.
The schema itself stays a pure function of its input plus the profile file it names.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from kvstage.shared.cluster import fold_problem, shard_problem
from kvstage.shared.faults import FaultsConfig
from kvstage.shared.layout import DTYPE_BYTES, Geometry, LayoutError, validate_tp
from kvstage.shared.scenario.cluster_table import ClusterConfig
from kvstage.shared.scenario.engines import ENGINE_PRESETS, EnginePreset
from kvstage.shared.scenario.errors import _FieldProblem
from kvstage.shared.scenario.fieldtypes import (
    MIB,
    NonNegFloat,
    NonNegInt,
    PoolMiB,
    PosFloat,
    PosInt,
    TPSize,
    _Table,
    mib_to_bytes,
)
from kvstage.shared.scenario.presets import PRESETS
from kvstage.shared.scenario.profiles import (
    ResolvedLinks,
    _ProfileNumbers,
    _resolve_links,
    links_table,
)
from kvstage.shared.scenario.slo_table import SloConfig
from kvstage.shared.scenario.toml_out import dumps_toml
from kvstage.shared.serving.gpus import (
    DEFAULT_GPU,
    GPUS,
    WEIGHT_BYTES,
    Gpu,
    gpu_names,
)
from kvstage.shared.serving.memory import memory_problem
from kvstage.shared.serving.prefill_tbo import DEEPEP_RESERVED_SMS

__all__ = [
    "DecodeConfig",
    "ExpectConfig",
    "HardwareConfig",
    "LinksConfig",
    "ModelConfig",
    "PrefillConfig",
    "ScaleDown",
    "Scenario",
    "ServingConfig",
    "SpeculativeConfig",
    "TransferConfig",
    "WorkloadConfig",
]


Dtype = Literal["bf16", "fp16", "fp32", "fp8"]
# weights may also be 4-bit: int4 (GPTQ / AWQ, group-scaled) or fp4 (NVFP4); the KV not
WeightDtype = Literal["bf16", "fp16", "fp32", "fp8", "int4", "fp4"]


class ModelConfig(_Table):
    """[model]: a preset, or explicit geometry; explicit fields override the preset.

    `attention = "mla"` (DeepSeek-V2/V3, Kimi-K2) caches one latent vector of
    `latent_dim` elements per token per layer (kv_lora_rank + rope dim), no separate
    V, replicated on every TP rank. Its geometry is one "head" of width latent_dim:
    kv_heads resolves to 1 and head_dim to latent_dim (explicit values must agree).
    """

    preset: str | None = None
    attention: Literal["mha", "mla"] = "mha"
    layers: PosInt
    kv_heads: Annotated[int, Field(ge=1, le=1024)]
    head_dim: PosInt
    latent_dim: PosInt | None = None  # MLA only: the latent width per token per layer
    params_b: PosFloat  # billions of parameters (all experts of a MoE model)
    # billions of parameters a token passes through (a MoE model's active experts), for
    # 2 * active params * tokens FLOPs; absent: params_b (a dense model)
    active_params_b: PosFloat | None = None
    # the weights' dtype (memory, bytes a decode step reads, the matmul rate) and the KV
    # cache's (what is transferred); `dtype = X` is the old spelling of both = X
    weight_dtype: WeightDtype = "bf16"
    kv_dtype: Dtype = "bf16"
    # FP8 weights only: one scale per tensor ("tensor") or per 128 x 128 block
    # ("block", DeepSeek-V3's checkpoint): the engines' FP8 GEMMs differ (their rates:
    # shared/serving/gpus.py `Efficiency.gemm_table`); a preset gives its checkpoint's
    fp8_scaling: Literal["tensor", "block"] = "tensor"
    # the transformer's width and query heads (attention FLOPs, all-reduce bytes,
    # activations); absent: attention_heads = kv_heads, hidden_size = heads x head_dim
    hidden_size: PosInt | None = None
    attention_heads: PosInt | None = None
    # MoE: routed experts and how many each token picks (0: dense)
    experts: NonNegInt = 0
    experts_per_token: NonNegInt = 0
    # the context length the engines serve (a preset's max_position_embeddings, or what
    # --context-length / --max-model-len set): a longer request is refused at admission
    # (shared/admission.py); absent: no limit
    context_tokens: PosInt | None = None
    # the vocabulary (0: unknown, every parameter a matmul's) and whether the LM head
    # is the embedding matrix (counted once in params_b): the embedding is a lookup and
    # a prefill runs the LM head on each sequence's last token only
    vocab_size: NonNegInt = 0
    tied_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        data = _old_dtype(data)
        if not isinstance(data, dict) or data.get("preset") is None:
            return _mla_geometry(data)
        name = data["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            raise _FieldProblem(
                {"preset": name}, f"unknown model preset; allowed: {', '.join(PRESETS)}"
            )
        p = PRESETS[name]
        base: dict[str, Any] = {"layers": p.layers, "params_b": p.params_b}
        if p.attention == "mla":
            base |= {"attention": "mla", "latent_dim": p.latent_dim}
        else:
            base |= {"kv_heads": p.kv_heads, "head_dim": p.head_dim}
        if p.active_params_b is not None and "params_b" not in data:
            base["active_params_b"] = p.active_params_b  # not with an explicit params_b
        if p.hidden_size:
            base |= {"hidden_size": p.hidden_size, "attention_heads": p.attention_heads}
        if p.vocab_size:
            base |= {"vocab_size": p.vocab_size, "tied_embeddings": p.tied_embeddings}
        if p.experts:
            base |= {"experts": p.experts, "experts_per_token": p.experts_per_token}
        if p.context_tokens:
            base["context_tokens"] = p.context_tokens
        if p.fp8_scaling != "tensor":
            base["fp8_scaling"] = p.fp8_scaling
        return _mla_geometry({**base, **data})

    @model_validator(mode="after")
    def _experts_consistent(self) -> ModelConfig:
        if self.experts_per_token > self.experts:
            raise _FieldProblem(
                {"experts_per_token": self.experts_per_token, "experts": self.experts},
                "a token cannot pick more experts than there are (0 and 0: a dense model)",
            )
        return self

    @model_validator(mode="after")
    def _active_within_total(self) -> ModelConfig:
        if self.active_params_b is not None and self.active_params_b > self.params_b:
            raise _FieldProblem(
                {"active_params_b": self.active_params_b, "params_b": self.params_b},
                "a token cannot pass through more parameters than the model has",
            )
        return self

    @model_validator(mode="after")
    def _latent_consistent(self) -> ModelConfig:
        if self.attention == "mha":
            if self.latent_dim is not None:
                raise _FieldProblem(
                    {"latent_dim": self.latent_dim},
                    'only with attention = "mla" (allowed attention: "mha", "mla"); '
                    "an MHA/GQA model gives kv_heads and head_dim",
                )
            return self
        if self.latent_dim is None:
            raise _FieldProblem({"latent_dim": None}, _LATENT_REQUIRED)
        if (self.kv_heads, self.head_dim) != (1, self.latent_dim):
            raise _FieldProblem(
                {"kv_heads": self.kv_heads, "head_dim": self.head_dim},
                f'with attention = "mla" the KV is one latent vector of latent_dim = '
                f"{self.latent_dim} per token per layer: kv_heads must be 1 and head_dim "
                f"{self.latent_dim} (or leave both out)",
            )
        return self

    @property
    def vocab_params_b(self) -> tuple[float, float]:
        """(embedding, LM head) parameters in billions, within params_b: vocab x hidden
        each, the head 0 when tied (the embedding matrix serves both)."""
        table = self.vocab_size * self.hidden / 1e9
        return table, 0.0 if self.tied_embeddings else table

    @property
    def flops_params_b(self) -> float:
        """Billions of parameters of the forward's FLOPs: active ones, else all."""
        return self.active_params_b if self.active_params_b is not None else self.params_b

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one KV element (what the layout and the transfer move)."""
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def dtype(self) -> str:
        """The KV cache's dtype (the name hardware mode's KV pools take)."""
        return self.kv_dtype

    @property
    def weight_bytes(self) -> float:
        """Bytes of all the weights (every expert) at weight_dtype."""
        return self.params_b * 1e9 * WEIGHT_BYTES[self.weight_dtype]

    @property
    def mla_widths(self) -> tuple[int, int, int, int] | None:
        """The preset's MLA widths (qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
        kv_lora_rank), or None when the model names no preset that gives them."""
        p = PRESETS.get(self.preset or "")
        if p is None or not p.v_head_dim:
            return None
        return (p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim, p.kv_lora_rank)

    @property
    def mla_q_lora_rank(self) -> int | None:
        """The preset's q_lora_rank (the query's low-rank width), or None when the model
        names no preset that gives it."""
        p = PRESETS.get(self.preset or "")
        return p.q_lora_rank or None if p is not None else None

    @property
    def heads(self) -> int:
        """Query heads (attention FLOPs)."""
        return self.attention_heads or self.kv_heads

    @property
    def hidden(self) -> int:
        """The residual stream's width (all-reduce bytes, activations)."""
        return self.hidden_size or self.heads * self.head_dim


_LATENT_REQUIRED = (
    'required when attention = "mla": the latent width per token per layer, '
    "kv_lora_rank + qk_rope_head_dim (e.g. 512 + 64 = 576 for DeepSeek-V3)"
)


def _old_dtype(data: Any) -> Any:
    """`dtype = X`, the old single key, reads as weight_dtype = kv_dtype = X.

    Kept as an alias (not refused) because every run directory written before the
    split stores `dtype` in its scenario.toml, and `kvstage check`/`compare` reload
    them; with either new key it is ambiguous and refused.
    """
    if not isinstance(data, dict) or "dtype" not in data:
        return data
    if "weight_dtype" in data or "kv_dtype" in data:
        raise _FieldProblem(
            {"dtype": data["dtype"]},
            "model.dtype is the old name for both weight_dtype and kv_dtype; "
            "with either of them given, drop dtype",
        )
    data = dict(data)
    old = data.pop("dtype")
    return {**data, "weight_dtype": old, "kv_dtype": old}


def _mla_geometry(data: Any) -> Any:
    """MLA's geometry as one "head" of width latent_dim: fill kv_heads and head_dim.

    Only fills what is absent; a contradicting explicit value is reported by
    `ModelConfig._latent_consistent`, naming the field.
    """
    if not isinstance(data, dict) or data.get("attention") != "mla":
        return data
    latent = data.get("latent_dim")
    if latent is None:
        raise _FieldProblem({"latent_dim": None}, _LATENT_REQUIRED)
    # A bad latent_dim is reported on latent_dim alone: head_dim then gets a
    # placeholder that never survives (validation fails on latent_dim).
    valid = isinstance(latent, int) and not isinstance(latent, bool) and latent >= 1
    width = latent if valid else 1
    return {"kv_heads": 1, "head_dim": width, **data}


Utilization = Annotated[float, Field(gt=0, le=1)]
# Expert parallelism (shared/serving/compute.py): the GPUs one expert group spans. 1: every
# expert split over the TP group (as TP alone); tp: each GPU of the group holds
# experts / tp whole experts; a multiple of tp above it: the group spans ep / tp
# instances, each running its own attention (DP attention), experts / ep per GPU.
ExpertParallel = Annotated[int, Field(ge=1, le=4096)]


# Pipeline-parallel stages (shared/serving/pipeline.py); at most one a layer
PipelineSize = Annotated[int, Field(ge=1, le=256)]
_NO_DECODE_PP = (
    "pipeline parallelism is modelled on the prefill side only (prefill.pp); "
    "kvstage's decode step has no pipeline stages, and SGLang's PD decode takes a PP size "
    "only equal to the prefill's or 1 (disaggregation/common/conn.py); remove decode.pp"
)


def _check_ep_tp(cfg: Any) -> Any:
    if cfg.ep != 1 and cfg.ep % cfg.tp:
        raise _FieldProblem(
            {"ep": cfg.ep, "tp": cfg.tp},
            f"ep must be 1 or a multiple of tp (e.g. {cfg.tp} or {cfg.tp * 2})",
        )
    return cfg


class PrefillConfig(_Table):
    """[prefill]: TP size, the GPU, and how long a forward takes.

    The forward's time is its FLOPs at the GPU's peak x MFU (`prefill_forward_s`,
    shared/serving/compute.py); `mfu` replaces the default table (gpus.Efficiency),
    `tflops` sets the sustained FLOP/s per GPU outright and `tokens_per_s` the whole
    forward.
    """

    tp: TPSize
    gpu: str = DEFAULT_GPU
    chunked_prefill_size: PosInt = 8192
    memory_utilization: Utilization = 0.9  # the share of GPU memory for weights and KV
    tokens_per_s: PosFloat | None = None  # if set: forward time = tokens / tokens_per_s
    tflops: PosFloat | None = None  # sustained per GPU; absent: peak x MFU
    mfu: Utilization | None = None  # absent: the default table by forward size
    ep: ExpertParallel = (
        1  # expert-parallel size (shared/serving/compute.py); 1: experts split by TP
    )
    # with ep > 1: EPLB's redundant experts even the ranks' loads out, or the routing's
    # own skew stays (shared/serving/ep_balance.py: the busiest rank sets the layer)
    eplb: bool = True
    # pipeline-parallel stages of one instance, each of tp GPUs holding its share of the
    # layers ([C] SGLang's --pp-size; shared/serving/pipeline.py). The serving model and
    # `kvstage plan` take it; the transfer protocol does not (shared/cluster.py
    # `pipeline_problem`: simulation and hardware mode refuse pp > 1)
    pp: PipelineSize = 1
    # two micro-batches a forward, one's DeepEP dispatch and combine under the other's
    # compute ([C] SGLang's --enable-two-batch-overlap; shared/serving/prefill_tbo.py);
    # needs the all-to-all (a MoE model with ep > tp): `_check_tbo`
    two_batch_overlap: bool = False

    _ep = model_validator(mode="after")(lambda self: _check_ep_tp(self))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class GpuTable(_Table):
    """[gpus.NAME]: a GPU of the user's own, named by `prefill.gpu` / `decode.gpu` like a
    catalogue entry (shared/serving/gpus.py). Every number is the datasheet's, dense
    (no sparsity); `source` says where they come from (a datasheet URL, a measurement).
    The achieved shares of it are the defaults' (`Efficiency`), as for any GPU without
    a kernel table of its own."""

    memory_gib: PosFloat
    hbm_gbs: PosFloat  # GB/s
    bf16_tflops: PosFloat  # dense
    fp8_tflops: PosFloat | None = None  # dense; absent: no FP8 tensor cores
    scaleup_gbs: PosFloat  # per direction per GPU
    scaleup: Annotated[str, Field(min_length=1)]  # "NVLink ...", "PCIe ...": the latency
    allreduce_latency_us: PosFloat | None = None  # 2 GPUs; absent: by the link's kind
    fp4_tflops: PosFloat | None = None  # dense; absent: no FP4 tensor cores
    cuda: bool = True  # runs CUDA kernels (false: ROCm; FP4 weights need one or the other)
    source: Annotated[str, Field(min_length=1)]

    def gpu(self, name: str) -> Gpu:
        lat = self.allreduce_latency_us
        return Gpu(
            name,
            self.memory_gib,
            self.hbm_gbs,
            self.bf16_tflops,
            self.fp8_tflops,
            self.scaleup_gbs,
            self.scaleup,
            self.source,
            None if lat is None else lat * 1e-6,
            self.fp4_tflops,
            self.cuda,
        )


def _check_fp4(s: Scenario) -> None:
    """FP4 weights need FP4 tensor cores or CUDA's FP4 Marlin fallback (W4A16)."""
    if s.model.weight_dtype != "fp4":
        return
    for side, cfg in (("prefill", s.prefill), ("decode", s.decode)):
        own = s.gpus.get(cfg.gpu)
        gpu = own.gpu(cfg.gpu) if own is not None else GPUS[cfg.gpu]
        if gpu.fp4_tflops is None and not gpu.cuda:
            raise _FieldProblem(
                {"model.weight_dtype": "fp4", f"{side}.gpu": cfg.gpu},
                "FP4 weights run natively on FP4 tensor cores (b200, gb200) or as W4A16 "
                "through CUDA's FP4 Marlin kernel; this GPU has neither (use fp8 or int4)",
            )


class SpeculativeConfig(_Table):
    """[decode.speculative]: speculative decoding with a one-layer draft head.

    Each step a draft head proposes tokens in `steps` small forwards, then the model
    verifies `draft_tokens` tokens per request in one forward, and a request gains
    `accept_length` tokens on average (the verified bonus token included). "mtp" is
    DeepSeek-V3's multi-token-prediction module, one transformer block sharing the
    embedding and output head ([P] DeepSeek-V3 technical report, section 2.2,
    https://arxiv.org/abs/2412.19437); "eagle" is an EAGLE draft head, one decoder layer
    over the target's features ([P] https://arxiv.org/abs/2401.15077). SGLang runs both
    as `--speculative-algorithm NEXTN / EAGLE` with `--speculative-num-steps`,
    `--speculative-num-draft-tokens` ([C] sglang/srt/server_args.py). "ngram" drafts by
    matching the request's last tokens against n-grams of its prompt and output, on the
    host, with no draft forward on the GPU ([C] vLLM's `speculative_config` method
    "ngram", prompt-lookup decoding; SGLang's `--speculative-algorithm NGRAM`): its steps
    cost nothing on the GPU, only the verify. The acceptance length is the workload's (a
    measured figure): kvstage does not predict it.
    """

    method: Literal["mtp", "eagle", "ngram"]
    draft_tokens: Annotated[int, Field(ge=2, le=64)]
    accept_length: Annotated[float, Field(ge=1.0, le=64.0)]
    steps: Annotated[int, Field(ge=1, le=64)] | None = None  # absent: draft_tokens - 1

    @model_validator(mode="after")
    def _accept_within_draft(self) -> SpeculativeConfig:
        if self.accept_length > self.draft_tokens:
            raise _FieldProblem(
                {"accept_length": self.accept_length, "draft_tokens": self.draft_tokens},
                "accept_length (tokens gained per step) cannot exceed draft_tokens "
                f"(tokens verified per step); at most {self.draft_tokens}",
            )
        return self

    @property
    def draft_steps(self) -> int:
        """Draft forwards per step (a chain of draft_tokens - 1 when not given)."""
        return self.steps if self.steps is not None else self.draft_tokens - 1


class DecodeConfig(_Table):
    """[decode]: TP size, KV paging and the staging pool of each decode rank."""

    tp: TPSize
    page_size: PosInt = 16
    staging_pool_mb: PoolMiB = 4096.0  # MiB per decode rank
    prefix_tokens: NonNegInt = 0  # decode-side cached prefix of every request
    gpu: str = DEFAULT_GPU
    # KV capacity (shared/serving/memory.py): the GPU's memory (gpu_memory_gib
    # overrides it), the share of it the engine takes, less weights and activations
    gpu_memory_gib: PosFloat | None = None
    memory_utilization: Utilization = 0.9
    # requests in one decode batch at most ([P] vLLM's default max_num_seqs = 256,
    # vllm/config SchedulerConfig); more wait for a slot
    max_running_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    hbm_efficiency: Utilization | None = None  # absent: gpus.Efficiency.decode_hbm
    step_overhead_ms: NonNegFloat | None = None  # absent: gpus.Efficiency.step_overhead_s
    ep: ExpertParallel = (
        1  # expert-parallel size (shared/serving/compute.py); 1: experts split by TP
    )
    # with ep > 1: EPLB's redundant experts even the ranks' loads out, or the routing's
    # own skew stays (shared/serving/ep_balance.py: the busiest rank sets the layer)
    eplb: bool = True
    speculative: SpeculativeConfig | None = None  # absent: one token per request a step
    # the engine whose host work a step pays (shared/serving/engine_step.py); absent: the
    # [engine] preset's family, else the default per-step overhead
    engine: Literal["sglang", "trtllm", "vllm-v1", "vllm-v0"] | None = None
    # expert-parallel all-to-all kernels (ep > tp): DeepEP's low-latency or normal mode
    # (shared/serving/compute.py `alltoall_s`); SGLang's `--deepep-mode auto` takes
    # low_latency for decode
    deepep_mode: Literal["low_latency", "normal"] = "low_latency"
    # two micro-batches, one's all-to-all under the other's compute ([C] SGLang's
    # --enable-two-batch-overlap; shared/serving/compute.py `decode_step`); needs the
    # all-to-all (a MoE model with ep > tp): `_check_tbo`
    two_batch_overlap: bool = False
    # which side streams a request's first token to the client: "decode" when the room
    # joins the decode's batch ([C] SGLang's PD: the prefill samples it and ships it with
    # the KV), "prefill" at the end of its last prefill forward ([C] DistServe,
    # distserve/engine.py: the context stage's step output goes to the client), so a
    # wait for the decode lands between the first and second tokens (TPOT), not in TTFT
    first_token: Literal["decode", "prefill"] = "decode"

    _ep = model_validator(mode="after")(lambda self: _check_ep_tp(self))
    # keys refused with a reason of their own (an override names it too: loading.py)
    REFUSED_KEYS: ClassVar[dict[str, str]] = {"pp": _NO_DECODE_PP}

    @model_validator(mode="before")
    @classmethod
    def _no_pipeline(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pp" in data:
            raise _FieldProblem({"pp": data["pp"]}, cls.REFUSED_KEYS["pp"])
        return data

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per decode step: the acceptance length, or 1."""
        return self.speculative.accept_length if self.speculative else 1.0

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
    # Hardware mode: each writer block's write tag rides in CHUNK_READY and the decode
    # checks the block against it before it scatters (staging) or counts the chunk
    # complete (slice path). "mac": Poly1305 then keyed BLAKE2b (hw/rank/writemac.py);
    # "checksum": keyed BLAKE2b of the whole block (slower); "none": opt out
    # (docs/hardware-mode.md). The simulator moves no bytes and checks none.
    verify_writes: Literal["none", "checksum", "mac"] = "mac"
    # Hardware mode, staging path: each writer block is ChaCha20 ciphertext from before
    # it is registered for its write until the decode opens it into memory of its own,
    # under a key of that writer and decode alone (hw/rank/cipher.py), so a process that
    # reads the ring through an engine's port reads no KV. "none": plaintext (opt out).
    # The slice path and OVERSIZED chunks move KV pool to KV pool and are not encrypted.
    encrypt_writes: Literal["none", "chacha20"] = "chacha20"

    @property
    def ring_cipher(self) -> str:
        """The cipher of the blocks in a staging ring: `encrypt_writes` on the staging
        path, "none" on the slice path (nothing goes through a ring there)."""
        return self.encrypt_writes if self.path == "staging" else "none"


class LinksConfig(_ProfileNumbers):
    """[links]: a named hardware profile plus optional per-field overrides.

    The profile is resolved at validation (see `profile_dirs`); `resolved()` gives
    the merged numbers in SI units.

    Host model (opt-in, HOST_FIELDS): `host_model = "cpu-loop"` makes the simulator
    model each rank as hardware mode's process (sim/host.py): a loop (`event_us` of
    CPU per delivered event, polling its threads every `loop_poll_us`), a forward
    thread (pattern fill `fill_latency_us` + KV bytes / `fill_bandwidth_gbs`, at nice
    `forward_nice`) and a copy thread, all sharing `host_cores` cores with their
    engines' `engine_thread_cores` each and other processes' `background_cores`.
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
        # Read the private dict itself: pydantic's attribute hook costs ~2 us a read,
        # and the simulator asks once per transfer (sim/driver.py).
        private = self.__pydantic_private__
        r = private.get("_resolved") if private else None
        if r is None:  # only when built without validation
            self._merged, r = _resolve_links(self, None)
            self._resolved = r
        return r


# requests of a workload whose arrivals are generated (not a trace), when not given
GENERATED_REQUESTS = 16


def _anchored(path: str, info: ValidationInfo) -> str:
    """`path` made absolute, a relative one against the scenario file's directory."""
    p = Path(path).expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return str(p.resolve())


class WorkloadConfig(_Table):
    """[workload]: how many requests, when they arrive and how long their prompts are.

    See `shared.workload.generate_requests` for the exact processes.
    """

    # None (arrival = "trace" only): every row of the trace; other arrivals default to
    # GENERATED_REQUESTS (filled in before validation, so a resolved scenario says it)
    requests: PosInt | None = None
    arrival: Literal["poisson", "fixed", "burst", "trace"] = "poisson"
    rate_per_s: PosFloat = 2.0
    burst_size: PosInt = 8
    # a CSV (a name ending in .csv) with columns
    # arrival_s,prompt_tokens[,prefix_tokens][,output_tokens], or a Mooncake trace (JSON
    # Lines, a name ending in .jsonl); see shared/scenario/trace_csv.py
    trace: str | None = None
    trace_speedup: PosFloat = 1.0  # trace arrival times are divided by it (2: twice as fast)
    # "trace": the trace rows' own prompt lengths (and a Mooncake trace's hash ids); the
    # default when a trace is named (filled in before validation, like `arrival`)
    prompt: Literal["fixed", "uniform", "lognormal", "trace"] = "fixed"
    prompt_tokens: PosInt = 8192  # fixed length; lognormal median
    prompt_min: PosInt = 1024
    prompt_max: PosInt = 32768
    prompt_sigma: NonNegFloat = 0.5
    # Cap applied to every prompt after sampling (also trace rows); scale-down sets it.
    max_prompt_tokens: PosInt | None = None
    seed: Annotated[int, Field(ge=0)] = 0  # Random(-s) == Random(s): refuse negatives
    # tokens each request generates at the decode; 0: the decode's generation is not
    # modeled; unset: a trace row's output length where the trace has one, else 0
    output_tokens: NonNegInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _anchor_trace(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        if "trace_csv" in data:
            # Refused, not aliased: the name lied (it also reads .jsonl), and a trace
            # without `requests` now replays every row, not 16: an old file should be
            # looked at once, not silently run differently.
            raise _FieldProblem(
                {"trace_csv": data["trace_csv"]},
                "renamed workload.trace (a .csv or a Mooncake .jsonl); note that without "
                "workload.requests every trace row is replayed",
            )
        if data.get("prompt") == "csv":
            # Refused, not aliased: the name lied (a Mooncake trace is JSON Lines).
            raise _FieldProblem(
                {"prompt": "csv"},
                'renamed "trace" (the trace rows\' own prompt lengths, the default when '
                "workload.trace is set)",
            )
        if data.get("trace"):
            # A trace supplies everything it has unless the scenario says otherwise:
            # its arrivals and its prompts (with a Mooncake trace's hash ids).
            data = {"arrival": "trace", "prompt": "trace", **data}
        if data.get("requests") is None and data.get("arrival", "poisson") != "trace":
            data = {**data, "requests": GENERATED_REQUESTS}
        # A relative trace path means relative to the scenario file, so the resolved
        # scenario (and its run-directory copy) holds an absolute path.
        if isinstance(data.get("trace"), str) and data["trace"]:
            data = {**data, "trace": _anchored(data["trace"], info)}
        return data

    # the trace's rows (shared/scenario/trace_csv.py TraceRow), read once when the
    # scenario loads (loading.py `keep_rows`); None until then
    _rows: list[Any] | None = PrivateAttr(default=None)

    @property
    def rows(self) -> list[Any] | None:
        """The trace's rows as the loader read them; None when not (yet) read."""
        return self._rows

    def keep_rows(self, rows: list[Any]) -> None:
        """The loader hands over the rows it read, so nothing reads the file again."""
        self._rows = rows

    @property
    def uses_trace(self) -> bool:
        """Whether the requests read a trace file: whenever one is named (what the
        scenario does not override comes from it: arrivals, prompts, output lengths,
        prefixes)."""
        return bool(self.trace)

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
        needs_trace = self.arrival == "trace" or self.prompt == "trace"
        if needs_trace and not self.trace:
            raise _FieldProblem(
                {"trace": self.trace},
                'required when arrival = "trace" or prompt = "trace" '
                "(a CSV ending in .csv with columns arrival_s,prompt_tokens[,prefix_tokens]"
                "[,output_tokens], or a Mooncake trace: JSON Lines, a name ending in .jsonl)",
            )
        if self.trace and not Path(self.trace).is_file():
            raise _FieldProblem({"trace": self.trace}, "no such file")
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
    # "cpu" (host memory), "cuda" (the current GPU) or "cuda:N" (GPU N)
    device: str = "cpu"
    verify: Literal["full", "sample", "off"] = "full"
    forward_delay: bool = False  # sleep for the modeled prefill forward time
    # host/device memory for each rank's paged KV pool in hardware mode, MiB; rooms
    # wait for pages when it is full
    kv_pool_mb: PosInt = 512
    # Mooncake's transport ("tcp" or "rdma") and its device names (RDMA: e.g.
    # "mlx5_0,mlx5_1"; empty: the engine's choice); NIXL's UCX reads UCX_* variables
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""
    # which thread of a prefill rank does a write's descriptor work (hw/rank/prefill.py):
    # "lane" (the behaviour before this option): ops built and checked on the rank's loop
    # thread, NIXL's descriptors made on the peer's lane; "loop": all of it on the loop
    # thread, as [engine] preset sglang-nixl; "worker": all of it on one posting thread,
    # the loop only hands the write over, as sglang-nixl-prepped
    posting: Literal["lane", "loop", "worker"] = "lane"
    scale_down: ScaleDown = Field(default_factory=ScaleDown)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        kind, _, index = v.partition(":")
        if kind == "cpu" and not index or kind == "cuda" and (not _ or index.isdigit()):
            return v
        raise ValueError(f"device must be cpu, cuda or cuda:N (N a GPU index), got {v!r}")


class ServingConfig(_Table):
    """[serving]: `kernels`, a measured per-op table of the user's GPUs (a CSV,
    shared/serving/kernel_table.py) that overrides the default kernel efficiencies for
    the (GPU, dtype) pairs it names; relative to the scenario file. (`profile`, a
    serving profile, is merged into [prefill] / [decode] when the file is read.)"""

    kernels: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _anchor_kernels(cls, data: Any, info: ValidationInfo) -> Any:
        # relative to the scenario file, so the resolved scenario holds an absolute path;
        # "" (an override clearing it) is none
        if isinstance(data, dict) and data.get("kernels") == "":
            data = {**data, "kernels": None}
        if isinstance(data, dict) and isinstance(data.get("kernels"), str) and data["kernels"]:
            data = {**data, "kernels": _anchored(data["kernels"], info)}
        return data

    # the table as the loader read it (loading.py); None until then
    _table: Any = PrivateAttr(default=None)

    @property
    def table(self) -> Any:
        return self._table

    def keep_table(self, table: Any) -> None:
        self._table = table


class EngineConfig(_Table):
    """[engine]: the serving engine whose prefill host the simulator models
    (shared/scenario/engines.py, sim/engine_host.py), with the GPU model
    (links.host_model = "gpu"; the cpu-loop host model keeps its own loops); absent: the
    transfer engine's own posting threads (sim/links.py), as without it."""

    preset: str | None = None
    overlap: bool | None = None  # absent: the preset's

    @field_validator("preset")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in ENGINE_PRESETS:
            raise ValueError(
                f"unknown engine preset {v!r}; allowed: {list(ENGINE_PRESETS)} "
                "(kvstage presets lists them)"
            )
        return v

    def resolved(self) -> EnginePreset | None:
        """The preset with this table's overrides, or None without one."""
        if self.preset is None:
            return None
        p = ENGINE_PRESETS[self.preset]
        return p if self.overlap is None else replace(p, overlap=self.overlap)


class ExpectConfig(_Table):
    """[expect]: the outcome a (fault) scenario must end with; `kvstage sim`/`hw`
    check it and exit 1 when it does not hold."""

    # None: no expectation; [] : every room done; [2, 5]: exactly these rooms fail
    failed_rooms: list[Annotated[int, Field(ge=0)]] | None = None
    reason_contains: str = ""  # every failed room's reason contains this text
    hw_run_fails: bool = False  # hardware mode: the run itself must fail (e.g. a killed rank)


_MLA_NO_STAGING = (
    "MLA keeps the whole latent KV on every TP rank, so there are no heads to reshard "
    "and nothing to stage: each decode rank reads its pages from one prefill rank. "
    'Use transfer.path = "slice"'
)

_OPTIONAL_TABLES = (
    "transfer",
    "links",
    "workload",
    "hardware",
    "faults",
    "expect",
    "cluster",
    "slo",
    "serving",
)


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
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    gpus: dict[str, GpuTable] = Field(default_factory=dict)  # the user's own GPUs

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
        _check_pipeline(self)  # before any geometry: it holds the stages
        for side, cfg in (("prefill", self.prefill), ("decode", self.decode)):
            if cfg.gpu not in GPUS and cfg.gpu not in self.gpus:
                own = f"; [gpus.NAME] tables: {', '.join(self.gpus)}" if self.gpus else ""
                raise _FieldProblem(
                    {f"{side}.gpu": cfg.gpu},
                    f"unknown GPU; allowed: {gpu_names()}{own} (kvstage presets lists "
                    "them; a GPU of your own goes in a [gpus.NAME] table)",
                )
        _check_fp4(self)
        _check_chunk(self)
        if self.cluster.fold:
            problem = fold_problem(self)
            if problem:
                raise _FieldProblem({"cluster.fold": True}, f"cannot fold ranks: {problem}")
        if self.cluster.shard:
            problem = shard_problem(self)
            if problem:
                raise _FieldProblem({"cluster.shard": True}, f"cannot shard the cluster: {problem}")
        if self.transfer.path == "staging" and self.model.attention == "mla":
            raise _FieldProblem(
                {"transfer.path": "staging", "model.attention": "mla"}, _MLA_NO_STAGING
            )
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
                pool = min(self.pool_bytes, mib_to_bytes(sd.staging_pool_mb))
                _check_pool(sgeo, pool, {"hardware.scale_down.staging_pool_mb": sd.staging_pool_mb})
        _check_expert_parallel(self)  # shared/serving/compute.py
        _check_tbo(self)
        _check_memory(self)
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
            attention=self.model.attention,
            prefill_pp=self.prefill.pp,
        )

    @property
    def pool_bytes(self) -> int:
        """Staging pool of one decode rank in bytes (staging_pool_mb is MiB)."""
        return mib_to_bytes(self.decode.staging_pool_mb)

    @property
    def base_dir(self) -> Path | None:
        """Directory relative paths were resolved against (the scenario file's)."""
        return self._base_dir

    # --- transforms --------------------------------------------------------------
    def to_toml(self) -> str:
        """The resolved scenario as TOML; `load_scenario` of it gives this scenario back.

        Link numbers are written out explicitly, so the file still loads where the
        profile file is not found (a run directory copied elsewhere).
        """
        data = self.model_dump(exclude_none=True)
        data["links"] = links_table(self.links)
        r = self.links.resolved()
        header = (
            f"# kvstage scenario {self.name!r}, resolved (defaults, preset and profile\n"
            f"# {r.profile!r} filled in). Load it with load_scenario().\n"
        )
        return header + dumps_toml(data)


# --------------------------------------------------------------------------- checks


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


def _check_chunk(s: Scenario) -> None:
    """A chunk is whole pages: chunked_prefill_size is read rounded down to them
    (Geometry.chunk_tokens), so it must hold one at least."""
    page = s.decode.page_size
    for key, cps in (
        ("prefill.chunked_prefill_size", s.prefill.chunked_prefill_size),
        ("hardware.scale_down.chunked_prefill_size", s.hardware.scale_down.chunked_prefill_size),
    ):
        if cps is not None and cps < page:
            raise _FieldProblem(
                {key: cps, "decode.page_size": page},
                f"a chunk is whole pages (chunked_prefill_size is rounded down to them, as "
                f"SGLang does); allowed: >= one page, {page} tokens",
            )


def _check_pipeline(s: Scenario) -> None:
    """Every pipeline stage holds one layer at least."""
    if s.prefill.pp > s.model.layers:
        raise _FieldProblem(
            {"prefill.pp": s.prefill.pp, "model.layers": s.model.layers},
            f"each pipeline stage holds one layer at least; allowed: 1..{s.model.layers}",
        )


def _check_expert_parallel(s: Scenario) -> None:
    for side, cfg in (("prefill", s.prefill), ("decode", s.decode)):
        if cfg.ep > 1 and cfg.ep > max(1, s.model.experts):
            raise _FieldProblem(
                {f"{side}.ep": cfg.ep, "model.experts": s.model.experts},
                "expert parallelism needs a MoE model with at least ep experts "
                "(a dense model takes ep = 1)",
            )


def _check_tbo(s: Scenario) -> None:
    """Two-batch overlap hides an expert-parallel all-to-all ([C] SGLang refuses it
    without one: "When enabling two batch overlap, moe_a2a_backend cannot be 'none'.";
    kvstage's serving model splits a forward only where there is one, compute.py
    `_dp_attention`), on either side; in prefill it also leaves DeepEP its SMs, which
    kvstage must know for the GPU (the decode step prices no SM share)."""
    for side, cfg in (("prefill", s.prefill), ("decode", s.decode)):
        if cfg.two_batch_overlap and not (s.model.experts and cfg.ep > cfg.tp):
            raise _FieldProblem(
                {f"{side}.two_batch_overlap": True, f"{side}.ep": cfg.ep, f"{side}.tp": cfg.tp},
                "two-batch overlap hides the expert-parallel all-to-all: it needs a MoE model "
                f"with {side}.ep > {side}.tp (DP attention + DeepEP); set it false here",
            )
    p = s.prefill
    if p.two_batch_overlap and p.gpu not in DEEPEP_RESERVED_SMS:
        raise _FieldProblem(
            {"prefill.two_batch_overlap": True, "prefill.gpu": p.gpu},
            "two-batch overlap prices the SMs DeepEP's kernels take from the GPU's SM count, "
            f"known for: {', '.join(DEEPEP_RESERVED_SMS)}",
        )


def _check_memory(s: Scenario) -> None:
    """Weights, activations and one chunk of KV fit one GPU on each side."""
    fit = memory_problem(s)
    if fit is None:
        return
    side, problem = fit
    cfg = s.prefill if side == "prefill" else s.decode
    fields: dict[str, Any] = {f"{side}.tp": cfg.tp, f"{side}.gpu": cfg.gpu}
    if side == "decode" and s.decode.gpu_memory_gib is not None:
        fields = {"decode.gpu_memory_gib": s.decode.gpu_memory_gib}
    raise _FieldProblem(fields, problem)


def _scaled_geometry(geo: Geometry, sd: ScaleDown) -> Geometry:
    layers = min(geo.layers, sd.layers) if sd.layers is not None else geo.layers
    cps = geo.chunked_prefill_size
    if sd.chunked_prefill_size is not None:
        cps = min(cps, sd.chunked_prefill_size)
    # stages of at most a layer each ([hardware] refuses stages: shared/cluster.py)
    pp = min(geo.prefill_pp, layers)
    return replace(geo, layers=layers, chunked_prefill_size=cps, prefill_pp=pp)


def _check_pool(geo: Geometry, pool_bytes: int, fields: dict[str, Any]) -> None:
    need = geo.chunk_bytes()
    if pool_bytes >= need:
        return
    tokens = geo.chunk_tokens
    heads = need // (2 * geo.layers * tokens * geo.head_dim * geo.dtype_bytes)
    raise _FieldProblem(
        fields,
        f"the staging pool ({_fmt_mib(pool_bytes)} MiB) is smaller than one full chunk on "
        f"a decode rank ({_fmt_mib(need)} MiB = {tokens} tokens x {geo.layers} layers x K,V "
        f"x {heads} heads x {geo.head_dim} x {geo.dtype_bytes} B); the minimum is "
        f'{math.ceil(need / MIB)} MiB (or use transfer.path = "slice")',
    )
