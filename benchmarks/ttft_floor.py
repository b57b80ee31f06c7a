"""Where a TTFT row's gap lies: a floor (fixed per request) or a slope (per prompt token).

A client's TTFT at concurrency 1 is about a + b x prompt: a the request path and the
forward's fixed part, b the forward's cost per token. Fitting both to the published
figures and to kvstage's tells which part a miss is in: a host-side floor kvstage does
not price moves a; kernels or collectives priced too fast move b.

Two reads of the slopes point at a mechanism. The rise from b (200 -> 2,000 tokens) to b2
(2,000 -> 7,000) is where attention, quadratic in the prompt, shows: read as attention
alone it gives the rate a GPU's attention would have to run at
(`implied_attention_tflops`), to set beside the kernels' published rates. And between
configurations that differ only in TP, b(TP hi) - b(TP lo) x lo / hi is what the larger
group pays a token beyond dividing the work (`tp_cost`): the all-reduces, mostly.

Published: NVIDIA DLI's NIM set (TensorRT-LLM engines, GenAI-Perf, concurrency 1; the
mean TTFT over the output lengths at 200, 2,000 and 7,000 input tokens), as
republished in github.com/wbing520/ai-performance-engineering (code/ch10_inference/
inference_gpu_cluster_sizing/dataset/nim.csv, commit 0e25b2e; the 200-token rows are
the ones benchmarks/published_serving.py leaves out of its table), and TensorRT-LLM
issue #5929 (DeepSeek-R1 FP8 on 8 H200, TP8, trtllm-serve v0.21.0rc2, LLMPerf P50 at
1,600 and 8,192 tokens). Simulated: the request path (SGLang's measured 6.6 ms,
shared/scenario/engines.py `request_us`) plus the prompt's forwards.

    nice -n 5 .venv/bin/python benchmarks/ttft_floor.py      # ~2 s
"""

from __future__ import annotations

from pathlib import Path

from kvstage.shared.scenario import Scenario, load_scenario
from kvstage.shared.scenario.engines import ENGINE_PRESETS
from kvstage.shared.serving.capacity import prompt_forward_s
from kvstage.shared.serving.compute import attention_flops

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
REQUEST_MS = ENGINE_PRESETS["sglang-nixl"].request_us / 1e3
NIM_CSV = (
    "https://github.com/wbing520/ai-performance-engineering/blob/0e25b2e/code/ch10_inference/"
    "inference_gpu_cluster_sizing/dataset/nim.csv"
)
TRT_ISSUE = "https://github.com/NVIDIA/TensorRT-LLM/issues/5929"
PROMPTS = (200, 2000, 7000)

# (model preset, GPU, TP, weight dtype, mean TTFT ms at 200 / 2,000 / 7,000 tokens):
# the nim.csv rows at concurrency 1, averaged over their output lengths
NIM = (
    ("llama-3-8b", "a100-80g", 1, "fp16", (25.71, 147.73, 556.55)),
    ("llama-3-8b", "a100-80g", 2, "fp16", (21.94, 90.35, 319.86)),
    ("llama-3-8b", "h100-sxm", 1, "fp16", (13.29, 52.76, 203.52)),
    ("llama-3-8b", "h100-sxm", 1, "fp8", (9.71, 35.58, 129.52)),
    ("llama-3-8b", "h100-sxm", 2, "fp16", (12.06, 38.57, 127.21)),
    ("llama-3-8b", "h100-sxm", 2, "fp8", (10.45, 30.64, 97.21)),
    ("llama-3-70b", "a100-80g", 4, "fp16", (69.87, 404.21, 1357.23)),
    ("llama-3-70b", "a100-80g", 8, "bf16", (51.59, 267.99, 841.92)),
    ("llama-3-70b", "h100-sxm", 4, "fp16", (35.61, 162.15, 550.42)),
    ("llama-3-70b", "h100-sxm", 4, "fp8", (28.15, 113.59, 380.47)),
    ("llama-3-70b", "h100-sxm", 8, "fp16", (29.66, 112.22, 333.59)),
    ("llama-3-70b", "h100-sxm", 8, "fp8", (26.78, 93.58, 279.27)),
)
# DeepSeek-R1 FP8, H200 TP8 (EP none), TTFT P50 ms at 1,600 and 8,192 tokens
TRT = ((1600, 164.63), (8192, 515.83))


def _load(*sets: str) -> Scenario:
    return load_scenario(BASE, ['transfer.path="slice"', *sets])


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a ms, b us a token) of the line through the first two points."""
    (x0, y0), (x1, y1) = points[0], points[1]
    b = (y1 - y0) / (x1 - x0)
    return y0 - b * x0, b * 1e3


def client_ms(s: Scenario, prompt: int) -> float:
    return REQUEST_MS + prompt_forward_s(s, prompt) * 1e3


def slopes() -> dict[tuple[str, str, int, str], tuple[float, float, float, float]]:
    """Per NIM configuration (model, GPU, TP, dtype): b and b2 (us a token), published
    and kvstage's: (pb, pb2, sb, sb2)."""
    out = {}
    for preset, gpu, tp, dtype, ttft in NIM:
        s = _config(preset, gpu, tp, dtype)
        pub = list(zip(PROMPTS, ttft, strict=True))
        sim = [(p, client_ms(s, p)) for p in PROMPTS]
        out[preset, gpu, tp, dtype] = (fit(pub)[1], fit(pub[1:])[1], fit(sim)[1], fit(sim[1:])[1])
    return out


def _config(preset: str, gpu: str, tp: int, dtype: str) -> Scenario:
    return _load(f"model.preset={preset}", f"model.weight_dtype={dtype}", f"prefill.gpu={gpu}",
                 f"decode.gpu={gpu}", f"prefill.tp={tp}", f"decode.tp={tp}")  # fmt: skip


def implied_attention_tflops(s: Scenario, b: float, b2: float) -> float:
    """The attention rate (TFLOP/s a GPU) a rise of the slope from b to b2 (us a token)
    implies if the attention alone made it: TTFT = a + c n + q n^2 through the three
    prompts gives q = (b2 - b) / (9,000 - 2,200) (the sums of the fits' end points), and
    causal attention costs attention_flops(n, n^2 / 2) / tp = k n^2, so the rate is k / q.
    Anything else that grows faster than the prompt (a GEMM slower at large M) is read as
    attention too, and a rate faster than every kernel's says the slope is not attention's."""
    q = (b2 - b) * 1e-6 / ((PROMPTS[1] + PROMPTS[2]) - (PROMPTS[0] + PROMPTS[1]))
    k = attention_flops(s, 1, 0.5, decode=False) / s.prefill.tp
    return k / q / 1e12 if q > 0 else float("inf")


def nim_lines() -> list[str]:
    out = [f"NIM set ({NIM_CSV}): a ms and b us a token from 200 and 2,000 tokens, "
           "b2 from 2,000 to 7,000; b/b2 ratio kvstage / published; att: the attention "
           "TFLOP/s a GPU the rise b -> b2 implies (`implied_attention_tflops`)",
           f"{'config':<28} {'published':>26}   {'kvstage':>26}   {'ratio b  b2':>11}",
           f"{'':<28} {'a':>8} {'b':>5} {'b2':>5} {'att':>5}   {'a':>8} {'b':>5} {'b2':>5} "
           f"{'att':>5}"]  # fmt: skip
    for preset, gpu, tp, dtype, ttft in NIM:
        s = _config(preset, gpu, tp, dtype)
        pub = list(zip(PROMPTS, ttft, strict=True))
        sim = [(p, client_ms(s, p)) for p in PROMPTS]
        (pa, pb), (_, pb2) = fit(pub), fit(pub[1:])
        (sa, sb), (_, sb2) = fit(sim), fit(sim[1:])
        pt, st = implied_attention_tflops(s, pb, pb2), implied_attention_tflops(s, sb, sb2)
        name = f"{preset} {gpu} TP{tp} {dtype}"
        out.append(f"{name:<28} {pa:8.1f} {pb:5.1f} {pb2:5.1f} {pt:5.0f}   {sa:8.1f} {sb:5.1f} "
                   f"{sb2:5.1f} {st:5.0f}   {sb / pb:5.2f} {sb2 / pb2:5.2f}")  # fmt: skip
    return out


# the NIM configurations that differ only in TP (model, GPU, dtype, TP lower, TP higher); the
# A100 70B pair is FP16 at TP4 and BF16 at TP8, the same tensor-core rate
TP_PAIRS = (
    ("llama-3-8b", "a100-80g", "fp16", 1, 2),
    ("llama-3-8b", "h100-sxm", "fp16", 1, 2),
    ("llama-3-8b", "h100-sxm", "fp8", 1, 2),
    ("llama-3-70b", "a100-80g", ("fp16", "bf16"), 4, 8),
    ("llama-3-70b", "h100-sxm", "fp16", 4, 8),
    ("llama-3-70b", "h100-sxm", "fp8", 4, 8),
)


def tp_cost(lo: float, hi: float, tp_lo: int, tp_hi: int) -> float:
    """The per-token cost (us) the higher TP pays beyond dividing the lower TP's slope:
    b(hi) - b(lo) x tp_lo / tp_hi (the collectives, and whatever else TP adds)."""
    return hi - lo * tp_lo / tp_hi


def tp_lines(b: dict[tuple[str, str, int, str], tuple[float, float, float, float]]) -> list[str]:
    out = ["TP's own cost a token: b(TP hi) - b(TP lo) x lo / hi, us (b from 200 -> 2,000 "
           "tokens, b2 from 2,000 -> 7,000)",
           f"{'config':<34} {'published b':>11} {'b2':>5}   {'kvstage b':>9} {'b2':>5}"]  # fmt: skip
    for preset, gpu, dtype, lo, hi in TP_PAIRS:
        d_lo, d_hi = dtype if isinstance(dtype, tuple) else (dtype, dtype)
        x, y = b[preset, gpu, lo, d_lo], b[preset, gpu, hi, d_hi]
        cost = [tp_cost(x[i], y[i], lo, hi) for i in range(4)]
        name = f"{preset} {gpu} {d_lo} TP{lo}->{hi}"
        out.append(f"{name:<34} {cost[0]:11.1f} {cost[1]:5.1f}   {cost[2]:9.1f} {cost[3]:5.1f}")
    return out


def trt_lines() -> list[str]:
    s = _load("model.preset=deepseek-v3", "model.weight_dtype=fp8", "model.kv_dtype=bf16",
              "prefill.gpu=h200", "decode.gpu=h200", "prefill.tp=8", "decode.tp=8")  # fmt: skip
    (pa, pb), (sa, sb) = fit(list(TRT)), fit([(p, client_ms(s, p)) for p, _ in TRT])
    return [f"TensorRT-LLM #5929 ({TRT_ISSUE}), DeepSeek-R1 FP8 H200 TP8:",
            f"  published a = {pa:.1f} ms, b = {pb:.1f} us a token; "
            f"kvstage a = {sa:.1f} ms, b = {sb:.1f} us"]  # fmt: skip


def main() -> None:
    print(__doc__.splitlines()[0])
    for line in nim_lines() + [""] + tp_lines(slopes()) + [""] + trt_lines():
        print(line)


if __name__ == "__main__":
    main()
