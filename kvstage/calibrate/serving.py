"""`kvstage calibrate --fit-serving`: the efficiencies of a serving deployment from two
measurements (issue 22 item 1).

Given one measured prefill throughput (tokens/s of one prefill instance at a prompt
length) and one decode step time (at a batch and a context per request), find the
`prefill.mfu` and `decode.hbm_efficiency` under which shared/serving/compute.py reproduces
them, the rest of the scenario (GPUs, TP, EP, model, links) as given:

- prefill: the prompt's chunks as the simulator forwards them (whole pages, each after
  the ones before: shared/serving/capacity.py `prompt_forward_s`) at one flat MFU m; throughput rises with m, so bisect m in (0, 1];
- decode: the step at batch B with B x context tokens of KV; it falls as the HBM share
  h rises until the step is compute bound, so bisect h in (0, 1]. A step no HBM share
  explains (faster than the datasheet's HBM allows, or slower only through FLOPs) is
  refused with the reason.

Pure functions of the scenario file and the figures; the CLI prints the lines to paste.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstage.shared.scenario import load_scenario
from kvstage.shared.scenario.loading import SERVING_PROFILE_KEYS
from kvstage.shared.serving.capacity import prompt_forward_s
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
        return prompt_tokens / prompt_forward_s(s, prompt_tokens)

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


# --- from measured runs (issue 36 item 4): many points, held-out error ---------------------

HOLD_EVERY = 4  # every 4th point (in file order) is held out of the fit and scored


@dataclass(frozen=True)
class PointsFit:
    """One fit of measured points: the values, the points used and held out, and the
    held-out error (mean absolute relative error of the model against the held-out
    points; None when fewer than HOLD_EVERY points came)."""

    values: dict[str, float]
    fitted: int
    held_out: int
    held_out_mape: float | None
    what: str


def split_points(points: list) -> tuple[list, list]:
    """(fit, held out): every HOLD_EVERY-th point held out when there are enough."""
    if len(points) < HOLD_EVERY:
        return list(points), []
    held = [p for i, p in enumerate(points) if i % HOLD_EVERY == HOLD_EVERY - 1]
    return [p for i, p in enumerate(points) if i % HOLD_EVERY != HOLD_EVERY - 1], held


def _mape(pairs: list[tuple[float, float]]) -> float | None:
    """Mean |model - measured| / measured over (measured, model) pairs."""
    return sum(abs(b - a) / a for a, b in pairs) / len(pairs) if pairs else None


def fit_decode_points(path: Path, points: list) -> PointsFit:
    """decode.hbm_efficiency and decode.step_overhead_ms from decode steps (batch, KV,
    step time): a memory-bound step is overhead + bytes / (HBM x h) + the kernels' fixed
    costs, a draft's and the collectives (the model's own, taken off first), a line
    in the step's bytes-at-full-HBM time (kvstage.calibrate.fit.fit_line, relative
    weights): its intercept the overhead, its slope 1 / h. Compute-bound steps say
    nothing of h and are left out."""
    from kvstage.calibrate.fit import fit_line

    base = load_scenario(path, ["decode.hbm_efficiency=1", "decode.step_overhead_ms=0"])
    parts = [(p, decode_step(base, p.batch, p.kv_tokens)) for p in points]
    bound = [(p, d) for p, d in parts if d.memory_s >= d.compute_s]
    train, held = split_points(bound)
    if len(train) < 2:
        raise ServingFitError(
            f"{len(bound)} memory-bound decode steps in the runs: a line needs 2 or more "
            "(import an SGLang decode log with kvstage import)"
        )
    line = fit_line(
        [d.memory_s for _, d in train],
        [p.step_s - d.allreduce_s - d.alltoall_s - d.fixed_s - d.draft_s for p, d in train],
        what="decode steps",
    )
    if not line.slope_s > 0:
        raise ServingFitError("decode step time does not grow with the bytes read: no HBM share")
    h = min(1.0, 1.0 / line.slope_s)
    fitted = load_scenario(
        path, [f"decode.hbm_efficiency={h}", f"decode.step_overhead_ms={line.intercept_s * 1e3}"]
    )
    score = [(p.step_s, decode_step(fitted, p.batch, p.kv_tokens).total_s) for p, _ in held]
    return PointsFit(
        {"decode.hbm_efficiency": h, "decode.step_overhead_ms": line.intercept_s * 1e3},
        len(train),
        len(held),
        _mape(score),
        "decode step time",
    )


def _golden(f, lo: float, hi: float) -> float:
    """The x in [lo, hi] that minimises the unimodal f."""
    g = (5**0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(_STEPS):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return (a + b) / 2


def fit_prefill_points(path: Path, points: list) -> PointsFit:
    """prefill.mfu from prefill forwards (new tokens, cached tokens, seconds): the flat
    MFU that minimises the squared relative error of the model's forward times."""
    given = load_scenario(path).prefill
    if given.tflops is not None or given.tokens_per_s is not None:
        raise ServingFitError(
            "the scenario sets prefill.tflops or prefill.tokens_per_s, which replace the "
            "MFU model: remove it to fit prefill.mfu"
        )
    train, held = split_points(points)
    if not train:
        raise ServingFitError(
            "no prefill forward in the runs (import a PD prefill server's log: its "
            "Prefill batch lines of back-to-back batches)"
        )

    def times(m: float, pts: list) -> list[float]:
        s = load_scenario(path, [f"prefill.mfu={m}"])
        return [prefill_forward_s(s, p.tokens, p.cached) for p in pts]

    def loss(m: float) -> float:
        return sum(
            ((t - p.forward_s) / p.forward_s) ** 2
            for p, t in zip(train, times(m, train), strict=True)
        )

    m = _golden(loss, _LO, 1.0)
    score = list(zip([p.forward_s for p in held], times(m, held), strict=True))
    return PointsFit(
        {"prefill.mfu": m}, len(train), len(held), _mape(score), "prefill forward time"
    )


def fit_request_points(path: Path, points: list, overrides: list[str]) -> PointsFit:
    """The per-request cost outside the prefill forward: the median over requests that
    found the system idle of TTFT less the model's forward of their prompt (with the
    fitted `overrides`). It holds the front end (HTTP, tokenizer, streaming) and an idle
    system's KV transfer; the held-out error is of TTFT = that cost + the forward."""
    train, held = split_points(points)
    if not train:
        raise ServingFitError("no request that found the system idle in the runs")
    s = load_scenario(path, overrides)
    rest = sorted(p.ttft_s - prompt_forward_s(s, p.prompt_tokens) for p in train)
    cost = rest[len(rest) // 2] if len(rest) % 2 else sum(rest[len(rest) // 2 - 1 :][:2]) / 2
    score = [(p.ttft_s, cost + prompt_forward_s(s, p.prompt_tokens)) for p in held]
    return PointsFit({"request_ms": cost * 1e3}, len(train), len(held), _mape(score), "idle TTFT")


PROFILE_KEYS = SERVING_PROFILE_KEYS


def profile_text(fits: list[PointsFit], sources: list[str], scenario: Path) -> str:
    """A serving profile: the fitted keys as scenario tables, each fit's points and
    held-out error as comments; a scenario names it with `[serving] profile = "FILE"`."""
    lines = [
        "# kvstage serving profile: `kvstage calibrate --fit-serving "
        f"{scenario} --from ...` (docs/workflow.md)",
        f"# measured runs: {', '.join(sources)}",
    ]
    tables: dict[str, list[str]] = {}
    for f in fits:
        err = "-" if f.held_out_mape is None else f"{f.held_out_mape:.1%}"
        lines.append(
            f"# {f.what}: {f.fitted} points fitted, {f.held_out} held out, held-out error {err}"
        )
        for key, value in f.values.items():
            table, _, name = key.partition(".")
            if table in PROFILE_KEYS:
                tables.setdefault(table, []).append(f"{name} = {value:.6g}")
            else:  # no scenario key carries it (yet): on record
                lines.append(f"# {key} = {value:.6g} (not a scenario key: on record only)")
    for table, entries in tables.items():
        lines += [f"[{table}]", *entries]
    return "\n".join(lines) + "\n"


LOAD_REPLAY_MAX = 2000  # requests of one run replayed to score TTFT under its load


def ttft_under_load(path: Path, requests: list, overrides: list[str], workdir: Path) -> PointsFit:
    """TTFT against load: a client run's finished requests (sorted by send time) written
    as a Mooncake trace, simulated with the fitted `overrides`, each request's TTFT
    against the measured one (matched by order of arrival). Nothing is fitted here: all
    its points are held out; the error is the mean absolute relative error."""
    import json

    from kvstage.metrics.rooms import request_figures, room_latencies
    from kvstage.sim.driver import simulate

    reqs = sorted(requests, key=lambda r: r.arrival_s)[:LOAD_REPLAY_MAX]
    t0 = reqs[0].arrival_s
    trace = workdir / "measured-load.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": (r.arrival_s - t0) * 1e3,
                    "input_length": max(1, r.prompt_tokens),
                    "output_length": r.output_tokens,
                }
            )
            + "\n"
            for r in reqs
        )
    )
    sets = [*overrides, f'workload.trace="{trace}"', 'workload.arrival="trace"']
    sets += ['workload.prompt="trace"', f"workload.requests={len(reqs)}"]
    rooms = room_latencies(simulate(load_scenario(path, sets)).records)
    pairs = []
    for i, r in enumerate(reqs):
        figs = request_figures(rooms.get(i, {}))
        if figs is not None and r.ttft_s > 0:
            pairs.append((r.ttft_s, figs["ttft_s"]))
    return PointsFit({}, 0, len(pairs), _mape(pairs), "TTFT under the measured load (simulated)")
