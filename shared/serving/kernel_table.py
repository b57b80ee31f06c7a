"""A measured per-op table for the user's GPUs (`[serving] kernels = "FILE.csv"`).

The defaults price a matmul at the share of the GPU's peak a published kernel benchmark
reached (shared/serving/gpus.py `Efficiency.gemm_tables`, `prefill_mfu`) and attention
at `attention_mfu` of the BF16 peak (or `attention_tables`' curve of the GPU). A user who profiled their own GPU (as
AIConfigurator and Vidur keep profiling databases) gives the times instead, and they
override the defaults for the (GPU, dtype) pairs the file names, in prefill and decode
alike.

The file is a CSV with a header naming these columns (any order, more allowed):

    op       gemm | attention
    gpu      a catalogue GPU (kvstage presets) or one of the scenario's [gpus.NAME]
    dtype    gemm: the weights' dtype (bf16, fp16, fp8, int4, fp4, fp32);
             attention: the KV's (bf16, fp8)
    M        gemm: rows (tokens); attention: query tokens
    N        gemm: output columns; attention: keys each query attends to (the mean)
    K        gemm: the reduction; attention: heads x (d_qk + d_v) (MHA: 2 x head_dim
             per head; MLA prefill: 192 + 128 per head)
    time_us  the measured kernel time, microseconds
    source   where the figure comes from (a tool and date, a URL); never empty

Both kinds count 2 M N K FLOPs, so a row is an achieved FLOP rate. A gemm row becomes
the share of the dtype's peak (`Gpu.peak_flops`) at M rows; rows at the same M (other
shapes) are averaged, and between the measured M the share is interpolated in log2(M),
flat beyond them (the default tables' rule). The largest M's share is the plateau a
compute-bound decode step's matmuls reach. An attention row becomes the share of the
BF16 peak (FP8 rows: the FP8 attention rate, which then replaces `attention_fp8_gain`
x the BF16 one), interpolated in log2(N) (the keys), averaged at equal N.

Any problem (a missing file, a missing column, an unknown op, GPU or dtype, a number
that is not positive, an empty source) is one KernelTableError `FILE:LINE: what is wrong;
what is allowed`.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstage.shared.csv_file import read_csv_file
from kvstage.shared.serving.gpus import GPUS, WEIGHT_BYTES, Gpu

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["COLUMNS", "KernelTable", "KernelTableError", "kernel_table", "read_kernel_table"]

COLUMNS = ("op", "gpu", "dtype", "M", "N", "K", "time_us", "source")
OPS = ("gemm", "attention")
ATTENTION_DTYPES = ("bf16", "fp8")


class KernelTableError(ValueError):
    """A bad kernel table: one line, `FILE:LINE: what is wrong; what is allowed` (the
    scenario loader raises it as a ScenarioError naming serving.kernels)."""


Curve = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class KernelTable:
    """A kernel table's curves: per (GPU, dtype), share of the peak by M (gemm) and by
    keys (attention), each a tuple of (x, share) sorted by x."""

    path: str
    gemm: tuple[tuple[str, str, Curve], ...]
    attention: tuple[tuple[str, str, Curve], ...]

    def attention_curve(self, gpu: str, dtype: str) -> Curve | None:
        for name, dt, pts in self.attention:
            if name == gpu and dt == dtype:
                return pts
        return None


def _curves(points: dict[tuple[str, str], dict[int, list[float]]]) -> tuple:
    return tuple(
        (gpu, dtype, tuple((x, sum(v) / len(v)) for x, v in sorted(by_x.items())))
        for (gpu, dtype), by_x in sorted(points.items())
    )


def _positive(p: Path, line: int, row: dict[str, str], col: str, kind: type) -> float:
    raw = (row.get(col) or "").strip()
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > 0:
        what = "a whole number" if kind is int else "a number"
        raise KernelTableError(f"{p}:{line}: {col} = {raw!r}: must be {what} > 0")
    return float(value)


def _row(
    p: Path, line: int, row: dict[str, str], gpus: Callable[[str], Gpu | None], allowed: str
) -> tuple[str, str, str, int, float]:
    """(op, gpu, dtype, x, share) of one row; x: M (gemm) or N (attention)."""
    op, name, dtype = (row.get(c, "").strip() for c in ("op", "gpu", "dtype"))
    if op not in OPS:
        raise KernelTableError(f"{p}:{line}: op = {op!r}; allowed: {', '.join(OPS)}")
    gpu = gpus(name)
    if gpu is None:
        raise KernelTableError(f"{p}:{line}: gpu = {name!r} is no known GPU; allowed: {allowed}")
    dtypes = tuple(WEIGHT_BYTES) if op == "gemm" else ATTENTION_DTYPES
    if dtype not in dtypes:
        raise KernelTableError(
            f"{p}:{line}: dtype = {dtype!r} for {op}; allowed: {', '.join(dtypes)}"
        )
    m = _positive(p, line, row, "M", int)
    n = _positive(p, line, row, "N", int)
    k = _positive(p, line, row, "K", int)
    t = _positive(p, line, row, "time_us", float) * 1e-6
    if not (row.get("source") or "").strip():
        raise KernelTableError(f"{p}:{line}: source is empty; say where the time comes from")
    peak = gpu.peak_flops(dtype if op == "gemm" else "bf16")
    if op == "attention" and dtype == "fp8" and gpu.fp8_tflops is None:
        raise KernelTableError(
            f"{p}:{line}: fp8 attention on {name}, which has no FP8 tensor cores"
        )
    share = 2.0 * m * n * k / t / peak
    return op, name, dtype, int(m if op == "gemm" else n), share


def _parse(p: Path, rows: Iterable[dict[str, str]], header: list[str], gpus, allowed: str):
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise KernelTableError(
            f"{p}:1: the header lacks {', '.join(missing)}; a kernel table's columns: "
            f"{', '.join(COLUMNS)}"
        )
    points: dict[str, dict] = {op: defaultdict(lambda: defaultdict(list)) for op in OPS}
    count = 0
    for line, row in rows:
        if not any((v or "").strip() for v in row.values()):
            continue  # a blank line
        op, name, dtype, x, share = _row(p, line, row, gpus, allowed)
        points[op][(name, dtype)][x].append(share)
        count += 1
    if not count:
        raise KernelTableError(f"{p}: no rows; a kernel table needs at least one")
    return _curves(points["gemm"]), _curves(points["attention"])


def read_kernel_table(
    path: str | Path, gpus: Callable[[str], Gpu | None], allowed: str
) -> KernelTable:
    """The kernel table at `path`; `gpus(name)` gives the Gpu a row's name means (None:
    unknown), `allowed` lists the names for the error message."""
    p = Path(path)

    def parse(reader: csv.DictReader) -> tuple[Any, Any]:
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        rows = ((reader.line_num, r) for r in reader)
        return _parse(p, rows, header, gpus, allowed)

    gemm, attention = read_csv_file(
        p, "kernel table", "serving.kernels", KernelTableError, parse, dicts=True
    )
    return KernelTable(str(p), gemm, attention)


# tables read, by path, a digest of the file's bytes and the scenario's own GPUs (a
# row's GPU name may mean one of them): a plan loads one scenario per configuration,
# all naming the same file
_READ: dict[tuple[str, bytes, str], KernelTable] = {}
_READ_KEEP = 4  # tables kept


def _content_key(path: str, s: Scenario) -> tuple[str, bytes, str] | None:
    try:
        digest = hashlib.blake2b(Path(path).read_bytes(), digest_size=16).digest()
    except OSError:
        return None  # the reader names the problem
    own = json.dumps({k: v.model_dump(mode="json") for k, v in s.gpus.items()}, sort_keys=True)
    return path, digest, own


def kernel_table(s: Scenario) -> KernelTable:
    """Scenario `s`'s kernel table (`serving.kernels`), read once and kept on the
    scenario (the loader reads it at load, so a bad file fails there); the same bytes
    with the same own GPUs give the table read before (it is immutable)."""
    kept = s.serving.table
    if kept is not None:
        return kept

    def gpu(name: str) -> Gpu | None:
        own = s.gpus.get(name)
        return own.gpu(name) if own is not None else GPUS.get(name)

    path = str(s.serving.kernels)
    key = _content_key(path, s)
    table = _READ.get(key) if key is not None else None
    if table is None:
        table = read_kernel_table(path, gpu, ", ".join([*GPUS, *s.gpus]))
        if key is not None and _content_key(path, s) == key:  # not rewritten while read
            if len(_READ) >= _READ_KEEP:
                del _READ[next(iter(_READ))]
            _READ[key] = table
    s.serving.keep_table(table)
    return table
