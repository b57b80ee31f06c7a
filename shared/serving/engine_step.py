"""The serving engine's host work per decode step, and how much of it the GPU waits for.

Every decode step an engine's host (CPU) schedules the next batch, prepares its inputs,
launches (a CUDA-graph replay), samples and hands the tokens on. Where the engine runs
that work for step n + 1 while the GPU runs step n (an overlap scheduler), the step
takes max(GPU time, host time); where it does not, GPU time + host time.
`decode.engine` names the engine; absent, the `[engine]` preset's family (sglang-* ->
sglang, vllm-* -> vllm-v1); absent both, no engine: `Efficiency.step_overhead_s`, added
([A] 1 ms, shared/serving/gpus.py). `decode.step_overhead_ms` overrides all of it (a
fitted intercept: added, never hidden).

Per engine, the host time per step and whether it overlaps:

- sglang: 0.31 ms, [P] SGLang's CPU time per scheduler iteration around a mock forward
  (https://github.com/tenstorrent/tt-inference-server/issues/3560: median TPOT 2.94 ms
  around a 2.632 ms busy-wait forward, one request); overlapped, [C] SGLang's overlap
  scheduler is on unless `--disable-overlap-schedule`
  (https://lmsys.org/blog/2024-12-04-sglang-v0-4/, "zero-overhead batch scheduler").
- sglang with `decode.speculative` "mtp" or "eagle": 1.96 ms, not hidden. [C] SGLang's
  EAGLE worker (NEXTN, DeepSeek's MTP, runs in it) has no overlap scheduler: "Speculative
  decoding currently does not support overlap scheduling due to the sequential logic
  between the draft and target models" (https://github.com/sgl-project/sglang/pull/9588,
  2025-08); the overlapped speculative worker came after, opt-in (`SGLANG_ENABLE_SPEC_V2`,
  https://github.com/sgl-project/sglang/pull/11821). [P] What overlapping it hid on
  DeepSeek-R1, TP8 H200, EAGLE, one request: 512 tokens in 3.644 s without, 3.206 s with,
  accept length 2.296 (https://github.com/sgl-project/sglang/pull/12128): 0.438 s over
  512 / 2.296 = 223 steps, 1.96 ms of host work a step the GPU waited for. [A] "ngram"
  keeps the plain figure (no measurement of its host work found).
- trtllm: overlapped, [D] TensorRT-LLM's PyExecutor overlap scheduler is enabled by
  default (https://nvidia.github.io/TensorRT-LLM/features/overlap-scheduler.html); [A]
  SGLang's 0.31 ms of host work (the same Python executor loop: schedule, forward,
  sample, process the previous batch; no TensorRT-LLM figure was found).
- vllm-v1: 0.16 ms, not hidden: [P] the gap between two decode steps left with V1's
  asynchronous scheduling, 150-170 us at batch 256 (https://github.com/vllm-project/vllm/
  pull/11133; 5-6 ms before it). [C] vLLM turns asynchronous scheduling on by default
  where nothing incompatible is set (vllm/config/scheduler.py `async_scheduling: bool |
  None = None`, resolved to True in vllm/config/vllm.py); an older V1 without it left
  the 5-6 ms gap: name vllm-v0's figure, or `decode.step_overhead_ms`, for one.
- vllm-v0: 4 ms, not hidden: [P] the GPU bubble of every decode step in vLLM v0's
  profile, about 4 ms (https://github.com/vllm-project/vllm/issues/6854, the
  multi-step scheduling RFC: "5-13 ms of GPU bubble", each profiled one "about 4ms").

Left out: host work that grows with the batch (vLLM's output processing took 0.2 ms at
batch 1 and 3.4 ms at batch 32 in https://github.com/vllm-project/vllm/issues/6913).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.shared.serving.gpus import efficiency

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["DECODE_ENGINES", "SGLANG_SPECULATIVE", "EngineStep", "engine_step"]


@dataclass(frozen=True, slots=True)
class EngineStep:
    """The host's seconds per decode step, and whether they overlap the GPU's."""

    host_s: float
    overlapped: bool
    engine: str | None = None  # None: no engine named (the default overhead)

    def total_s(self, gpu_s: float) -> float:
        """A step whose GPU work takes `gpu_s`."""
        return max(gpu_s, self.host_s) if self.overlapped else gpu_s + self.host_s


DECODE_ENGINES: dict[str, EngineStep] = {
    "sglang": EngineStep(0.31e-3, True, "sglang"),
    "trtllm": EngineStep(0.31e-3, True, "trtllm"),
    "vllm-v1": EngineStep(0.16e-3, False, "vllm-v1"),
    "vllm-v0": EngineStep(4e-3, False, "vllm-v0"),
}
# SGLang's EAGLE worker (MTP, EAGLE): no overlap scheduler, its host work a step (above)
SGLANG_SPECULATIVE = EngineStep(0.438 / (512 / 2.296), False, "sglang")


def _family(preset: str | None) -> str | None:
    """The decode engine an `[engine]` preset (a KV-transfer preset) belongs to."""
    if preset is None:
        return None
    return "sglang" if preset.startswith("sglang") else "vllm-v1"


def engine_step(s: Scenario) -> EngineStep:
    """The decode step's host cost of scenario `s` (see the module's text)."""
    if s.decode.step_overhead_ms is not None:
        return EngineStep(s.decode.step_overhead_ms / 1e3, False)
    name = s.decode.engine or _family(s.engine.preset)
    if name is None:
        return EngineStep(efficiency(s).step_overhead_s, False)
    spec = s.decode.speculative
    if name == "sglang" and spec is not None and spec.method in ("mtp", "eagle"):
        return SGLANG_SPECULATIVE
    return DECODE_ENGINES[name]
