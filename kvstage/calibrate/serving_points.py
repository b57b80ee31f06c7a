"""The measured points `kvstage calibrate --fit-serving --from RUN` fits the serving
model to, taken from measured run directories (`kvstage import`, docs/workflow.md).

- decode steps, from an SGLang decode log (`Decode batch` lines): with R requests
  running through a log interval and G tokens/s generated over it, a step took R / G
  seconds, at batch R with the line's `#token` tokens of KV in use (kvstage/measured/
  sglang_log.py names the lines' source);
- prefill forwards, from an SGLang prefill log (`Prefill batch` lines): a line's input
  throughput is its new tokens over the time since the previous line, which is the
  previous batch's forward when that batch left requests queued (the scheduler went
  straight on); so the previous batch's forward took new tokens / throughput of this
  line. Only a PD prefill server's log (no decode steps between) gives these;
- requests that found the system idle (no earlier request still streaming when they
  arrived), from a client's per-request file: their TTFT against their prompt;
- every finished request of a client's file that has send times (vllm's
  `start_times`, AIPerf's `request_start_ns`): the load it met, replayed through the
  simulation with the fitted model to score TTFT against load.

Each kind of file identifies what its points vary: decode steps the HBM share and the
per-step cost, prefill forwards the prefill MFU, idle requests the per-request cost
outside the forward (front end, plus the transfer of an idle system).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstage.metrics.rooms import client_tokens, request_figures, room_latencies
from kvstage.run.rundir import Run

__all__ = ["DecodePoint", "Points", "PrefillPoint", "RequestPoint", "points_from_runs"]


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    kv_tokens: int
    step_s: float


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    cached: int
    forward_s: float


@dataclass(frozen=True)
class RequestPoint:
    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class LoadedRequest:
    """A request of a client's run with its send time: the load it met is the run's."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float


@dataclass
class Points:
    decode: list[DecodePoint] = field(default_factory=list)
    prefill: list[PrefillPoint] = field(default_factory=list)
    requests: list[RequestPoint] = field(default_factory=list)
    loaded: list[list[LoadedRequest]] = field(default_factory=list)  # one list per run
    notes: list[str] = field(default_factory=list)


def _log_points(run: Run, out: Points) -> None:
    log = run.summary.get("server_log") or {}
    for s in log.get("decode_steps", []):
        if s["running"] > 0 and s["gen_tokens_per_s"] > 0:
            out.decode.append(
                DecodePoint(s["running"], s["tokens"], s["running"] / s["gen_tokens_per_s"])
            )
    batches = log.get("prefill_batches", [])
    if batches and log.get("decode_steps"):
        out.notes.append(f"{run.path}: prefill lines of a server that also decodes: not used")
        return
    for prev, cur in zip(batches, batches[1:], strict=False):
        if prev["queue"] > 0 and cur["input_tokens_per_s"] > 0:
            forward = cur["new_tokens"] / cur["input_tokens_per_s"]
            out.prefill.append(PrefillPoint(prev["new_tokens"], prev["cached_tokens"], forward))


def _idle_requests(run: Run, out: Points) -> None:
    rooms = room_latencies(run.records)
    done = sorted(
        (info["arrival"], client_tokens(info)[1], info, figs)
        for info in rooms.values()
        if (figs := request_figures(info)) is not None and info.get("prompt_tokens")
    )
    if len(done) > 1 and len({a for a, *_ in done}) > 1:  # send times: a load to replay
        out.loaded.append(
            [
                LoadedRequest(
                    a, int(i["prompt_tokens"]), int(i.get("output_tokens", 0)), f["ttft_s"]
                )
                for a, _, i, f in done
            ]
        )
    busy_until = float("-inf")
    for arrival, last, info, figs in done:
        if arrival >= busy_until:
            out.requests.append(RequestPoint(int(info["prompt_tokens"]), figs["ttft_s"]))
        busy_until = max(busy_until, last)


def points_from_runs(runs: list[Run]) -> Points:
    """Every point the runs hold (see the module docstring)."""
    out = Points()
    for run in runs:
        if run.mode != "measured":
            out.notes.append(f"{run.path}: a {run.mode} run, not a measured one: not used")
            continue
        _log_points(run, out)
        _idle_requests(run, out)
    return out
