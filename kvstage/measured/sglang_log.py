"""SGLang server logs: its scheduler's `Prefill batch` and `Decode batch` lines, PD or not.

Format from SGLang `python/sglang/srt/managers/scheduler_metrics_mixin.py`
(`report_prefill_stats`, `report_decode_stats`, read 2026-12-03), each line prefixed
by the logger's `[YYYY-MM-DD HH:MM:SS <DP/TP ranks>]`:

- `Prefill batch[ [iter]], #new-seq: S, #new-token: N, #cached-token: C, <token
  usage>, #running-req: R, #queue-req: Q, #pending-token: P, [#prealloc-req: ..,
  #inflight-req: .. (PD prefill)] cuda graph: B, input throughput (token/s): X`,
  where X = N / the time since the previous prefill line;
- `Decode batch[ [iter]], #running-req: R, #token: T, token usage: U, [pre-allocated
  usage: .., #prealloc-req: .., #transfer-req: .., #retracted-req: .. (PD decode)]
  cuda graph: B, gen throughput (token/s): G, #queue-req: Q`, printed every
  `--decode-log-interval` steps (40 by default), G = the tokens generated over those
  steps / their time. Older releases wrote `Decode batch. #running-req: ...`; both
  are read.

With R requests running through the interval, a step took R / G seconds: the points
`kvstage calibrate --fit-serving` fits the decode step against the batch with
(kvstage/calibrate/serving.py). Only the logging rank's lines are written (TP 0).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from kvstage.measured.measurement import DecodeStep, MeasuredError, Measurement, PrefillBatch

FORMAT = "sglang-log"
TOOL = "SGLang scheduler log (scheduler_metrics_mixin.py)"
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_KIND = re.compile(r"\b(Prefill|Decode) batch\b")
_FIELD = re.compile(r"(#?[a-z][a-z -]*?(?: \(token/s\))?): (-?[0-9.]+)")
DECODE_FIELDS = ("#running-req", "gen throughput (token/s)")
PREFILL_FIELDS = ("#new-token",)  # older releases write no input throughput


def looks_like(text: str) -> bool:
    return bool(_KIND.search(text))


def _fields(line: str) -> dict[str, float]:
    return {k.strip(): float(v) for k, v in _FIELD.findall(line)}


def _stamp(path: Path, n: int, line: str) -> float:
    m = _STAMP.search(line)
    if m is None:
        raise MeasuredError(path, str(n), "(timestamp)", "no [YYYY-MM-DD HH:MM:SS] prefix")
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))


def _need(path: Path, n: int, fields: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key not in fields:
            raise MeasuredError(path, str(n), key, "missing from the batch line")


def read(path: Path) -> Measurement:
    m = Measurement(Path(path), FORMAT, TOOL)
    t0 = None
    pd = False
    for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        kind = _KIND.search(line)
        if kind is None:
            continue
        t = _stamp(path, n, line)
        t0 = t if t0 is None else t0
        f = _fields(line[kind.end() :])
        pd = pd or "#prealloc-req" in f or "#transfer-req" in f or "#inflight-req" in f
        if kind.group(1) == "Decode":
            _need(path, n, f, DECODE_FIELDS)
            m.decode_steps.append(
                DecodeStep(
                    time_s=t - t0,
                    running=int(f["#running-req"]),
                    gen_tokens_per_s=f["gen throughput (token/s)"],
                    tokens=int(f.get("#token", 0)),
                    queue=int(f.get("#queue-req", 0)),
                )
            )
        else:
            _need(path, n, f, PREFILL_FIELDS)
            m.prefill_batches.append(
                PrefillBatch(
                    time_s=t - t0,
                    new_tokens=int(f["#new-token"]),
                    cached_tokens=int(f.get("#cached-token", 0)),
                    input_tokens_per_s=f.get("input throughput (token/s)", 0.0),
                    queue=int(f.get("#queue-req", 0)),
                    running=int(f.get("#running-req", 0)),
                )
            )
    if t0 is None:
        raise MeasuredError(path, "", "Prefill batch / Decode batch", "no batch line in the file")
    m.reported = {"pd": pd, "decode_lines": len(m.decode_steps)}
    m.reported["prefill_lines"] = len(m.prefill_batches)
    return m
