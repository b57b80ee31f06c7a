"""`kvstage calibrate --fit-serving`: the efficiencies of a serving deployment from two
measurements (issue 22 item 1).

Given one measured prefill throughput (tokens/s of one prefill instance at a prompt
length) and one decode step time (at a batch and a context per request), find the
`prefill.mfu` and `decode.hbm_efficiency` under which shared/serving/compute.py reproduces
them, the rest of the scenario (GPUs, TP, EP, model, links) as given:

- prefill: the prompt's chunks (chunked_prefill_size, each after the ones before) at
  one flat MFU m; throughput rises with m, so bisect m in (0, 1];
- decode: the step at batch B with B x context tokens of KV; it falls as the HBM share
  h rises until the step is compute bound, so bisect h in (0, 1]. A step no HBM share
  explains (faster than the datasheet's HBM allows, or slower only through FLOPs) is
  refused with the reason.

Pure functions of the scenario file and the figures; the CLI prints the lines to paste.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstage.shared.scenario import Scenario, load_scenario
from kvstage.shared.serving.compute import decode_step, prefill_forward_s

__all__ = ["ServingFit", "ServingFitError", "fit_decode_hbm", "fit_prefill_mfu", "fit_serving"]

_LO = 1e-3  # the smallest share either fit reports
_STEPS = 40  # bisection steps: (1 - _LO) / 2^40, far below the 3 digits printed


class ServingFitError(ValueError):
    """A measurement the model cannot reproduce with any share in (0, 1]."""


@dataclass(frozen=True, slots=True)
class ServingFit:
    prefill_mfu: float | None
    decode_hbm_efficiency: float | None

    def toml_lines(self) -> list[str]:
        out: list[str] = []
        if self.prefill_mfu is not None:
            out += ["[prefill]", f"mfu = {self.prefill_mfu:.3f}"]
        if self.decode_hbm_efficiency is not None:
            out += ["[decode]", f"hbm_efficiency = {self.decode_hbm_efficiency:.3f}"]
        return out


def _prompt_time_s(s: Scenario, prompt: int) -> float:
    chunk = s.prefill.chunked_prefill_size
    return sum(prefill_forward_s(s, min(chunk, prompt - p), p) for p in range(0, prompt, chunk))


def _bisect(f, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the increasing f crosses 0."""
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_prefill_mfu(path: Path, tokens_per_s: float, prompt_tokens: int) -> float:
    """The flat prefill MFU under which one prefill instance computes `prompt_tokens`
    prompts at `tokens_per_s`."""
    if not tokens_per_s > 0:
        raise ServingFitError(f"--prefill-tokens-per-s = {tokens_per_s}: must be > 0")
    if prompt_tokens < 1:
        raise ServingFitError(f"--prompt-tokens = {prompt_tokens}: must be >= 1")
    given = load_scenario(path).prefill
    if given.tflops is not None or given.tokens_per_s is not None:
        raise ServingFitError(
            "the scenario sets prefill.tflops or prefill.tokens_per_s, which replace the "
            "MFU model: remove it to fit prefill.mfu"
        )

    def speed(m: float) -> float:
        s = load_scenario(path, [f"prefill.mfu={m}"])
        return prompt_tokens / _prompt_time_s(s, prompt_tokens)

    top = speed(1.0)
    if tokens_per_s > top:
        raise ServingFitError(
            f"--prefill-tokens-per-s = {tokens_per_s:,.0f}: faster than this prefill "
            f"instance computes {prompt_tokens:,}-token prompts at 100% MFU ({top:,.0f} "
            "tokens/s, with its attention and all-reduces); check the GPU, TP and model"
        )
    if tokens_per_s < speed(_LO):
        raise ServingFitError(
            f"--prefill-tokens-per-s = {tokens_per_s:,.0f}: slower than {_LO:.1%} MFU; "
            "is it per instance (not per request)?"
        )
    return _bisect(lambda m: speed(m) - tokens_per_s, _LO, 1.0)


def fit_decode_hbm(path: Path, step_s: float, batch: int, context: int) -> float:
    """The decode HBM share under which a step of `batch` requests of `context` tokens
    of KV each takes `step_s`."""
    if not step_s > 0:
        raise ServingFitError(f"--decode-step-ms = {step_s * 1e3}: must be > 0")
    if batch < 1:
        raise ServingFitError(f"--decode-batch = {batch}: must be >= 1")
    if context < 0:
        raise ServingFitError(f"--decode-context = {context}: must be >= 0")

    def step(h: float) -> float:
        s = load_scenario(path, [f"decode.hbm_efficiency={h}"])
        return decode_step(s, batch, batch * context).total_s

    fastest = step(1.0)
    if step_s < fastest:
        raise ServingFitError(
            f"--decode-step-ms = {step_s * 1e3:.3f}: faster than the model's step at 100% "
            f"of HBM ({fastest * 1e3:.3f} ms for batch {batch} x {context:,} tokens of KV, "
            "with its FLOPs, overhead and all-reduces); check the GPU, TP and batch"
        )
    if step_s > step(_LO):
        raise ServingFitError(
            f"--decode-step-ms = {step_s * 1e3:.3f}: slower than {_LO:.1%} of HBM explains"
        )
    h = _bisect(lambda h: step_s - step(h), _LO, 1.0)
    parts = decode_step(load_scenario(path, [f"decode.hbm_efficiency={h}"]), batch, batch * context)
    if parts.compute_s >= parts.memory_s:
        raise ServingFitError(
            f"--decode-batch = {batch}: the model's step is compute bound there "
            f"({parts.compute_s * 1e3:.2f} ms of FLOPs vs {parts.memory_s * 1e3:.2f} ms of "
            "reads), so it says nothing of HBM; measure a smaller batch"
        )
    return h


def fit_serving(
    path: Path,
    *,
    prefill: tuple[float, int] | None = None,
    decode: tuple[float, int, int] | None = None,
) -> ServingFit:
    """prefill: (tokens/s, prompt tokens); decode: (step seconds, batch, context)."""
    if prefill is None and decode is None:
        raise ServingFitError(
            "--fit-serving needs a prefill measurement (--prefill-tokens-per-s and "
            "--prompt-tokens) or a decode one (--decode-step-ms, --decode-batch, "
            "--decode-context), or both"
        )
    return ServingFit(
        fit_prefill_mfu(path, *prefill) if prefill else None,
        fit_decode_hbm(path, *decode) if decode else None,
    )
