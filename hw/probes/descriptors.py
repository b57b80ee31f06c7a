"""The descriptor probe: what one KV-slice transfer descriptor costs a serving engine's
host, in parts, with the real NIXL here, and what the interpreter lock does between a
Python scheduler thread and a transfer worker.

One process, one NIXL agent (UCX) writing to itself (loopback: NIXL's own agent name
as the remote), host memory, or GPU memory with `device = "cuda[:N]"` (two torch
buffers on the GPU registered as VRAM, as a serving engine's KV pool is; the numpy work
is the same, the engine's calls then resolve GPU addresses). For each descriptor count
n of a sweep, timed per batch:

- build: the slice path's numpy work of SGLang's NIXL backend (read in
  sgl-project/sglang python/sglang/srt/disaggregation/nixl/conn.py,
  `send_kvcache_slice`): for every (layer, K/V, token) the source and destination
  address of one head slice, as two (n, 3) arrays (address, length, device);
- prepare: `get_xfer_descs` of both arrays plus `initialize_xfer` (the per-batch path
  of that code); `prep`: `make_prepped_xfer` from indices into lists prepared once
  (`prep_xfer_dlist`, SGLang PR #26406);
- post: `transfer` of the handle, to its return (over loopback UCX copies each
  write's bytes inside this call, so it is an upper bound of an RDMA post).

GIL: a transfer worker thread runs build + prepare + post of n descriptors in a loop
for `gil_s` seconds, alone and while the main thread runs pure-Python work (a
scheduler's loop); and the main thread's Python work alone and while the worker runs.
Each ratio is (rate alone) / (rate beside the other): 1 = no interference.

Fitting is kvstage/calibrate/descriptors.py; `kvstage calibrate --descriptors` runs both.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DescriptorPlan", "measure_descriptors"]


@dataclass(frozen=True)
class DescriptorPlan:
    counts: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    reps: int = 5
    slice_bytes: int = 64  # one head slice (tiny: the per-descriptor costs, not bandwidth)
    layers: int = 32
    gil_n: int = 4096
    gil_s: float = 1.0
    device: str = "cpu"  # or "cuda" / "cuda:N": the buffers in GPU memory (VRAM)


def _slice_addresses(base: int, n: int, layers: int, nbytes: int, device: int) -> np.ndarray:
    """(n, 3) descriptors of n head slices spread over 2 * layers planes, token-major:
    as the slice path computes them (numpy; one row per (layer, K/V, token))."""
    planes = 2 * layers
    tokens = max(1, n // planes)
    plane = np.arange(planes, dtype=np.uint64)[:, None]
    token = np.arange(tokens, dtype=np.uint64)[None, :]
    # each plane a region of tokens * 2 * nbytes: every other slot, so no two merge
    addr = base + (plane * tokens + token) * (2 * nbytes)
    out = np.empty((planes * tokens, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = nbytes
    out[:, 2] = device
    return out[:n] if len(out) >= n else np.resize(out, (n, 3))


class _Loopback:
    """One NIXL agent writing its source buffer into its destination buffer."""

    def __init__(self, plan: DescriptorPlan) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)
        self.agent = nixl_agent("kvstage-descriptor-probe", cfg)
        self.name = self.agent.name
        size = max(plan.counts) * plan.slice_bytes * 2 + 4096
        if plan.device == "cpu":
            self.mem, self.dev = "DRAM", 0
            self.src = np.zeros(size, dtype=np.uint8)
            self.dst = np.zeros(size, dtype=np.uint8)
            addrs = (self.src.ctypes.data, self.dst.ctypes.data)
        else:  # GPU memory: torch buffers on the device, registered as VRAM
            import torch

            dev = torch.device(plan.device)
            self.mem, self.dev = "VRAM", dev.index or 0
            self.src = torch.zeros(size, dtype=torch.uint8, device=dev)
            self.dst = torch.zeros(size, dtype=torch.uint8, device=dev)
            addrs = (self.src.data_ptr(), self.dst.data_ptr())
        self.addrs = addrs
        self._regs = [
            self.agent.register_memory([(a, size, self.dev, "")], self.mem) for a in addrs
        ]
        self.plan = plan

    def build(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.plan
        return (
            _slice_addresses(self.addrs[0], n, p.layers, p.slice_bytes, self.dev),
            _slice_addresses(self.addrs[1], n, p.layers, p.slice_bytes, self.dev),
        )

    def prepare(self, src: np.ndarray, dst: np.ndarray) -> Any:
        a = self.agent
        return a.initialize_xfer(
            "WRITE", a.get_xfer_descs(src, self.mem), a.get_xfer_descs(dst, self.mem), self.name
        )

    def post(self, handle: Any) -> None:
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("nixl: transfer failed")

    def finish(self, handle: Any) -> None:
        while (state := self.agent.check_xfer_state(handle)) != "DONE":
            if state == "ERR":
                raise RuntimeError("nixl: transfer failed")
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        for r in self._regs:
            self.agent.deregister_memory(r)


def _timed(fn, *args) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _sweep(lb: _Loopback, plan: DescriptorPlan) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {
        k: []
        for k in ("build_s", "pylist_s", "index_s", "descs_s", "prepare_s", "post_s", "prep_s")
        + ("prep_post_s",)
    }
    a = lb.agent
    for n in plan.counts:
        rows = {k: [] for k in out}
        src, dst = lb.build(n)
        lists = (
            a.prep_xfer_dlist("NIXL_INIT_AGENT", src, lb.mem),
            a.prep_xfer_dlist(lb.name, dst, lb.mem),
        )
        idx = np.arange(n, dtype=np.int64)
        for _ in range(plan.reps):
            t_build, (s, d) = _timed(lb.build, n)
            t_list, _ = _timed(_python_lists, s, d)
            t_index, _ = _timed(_indices, n, plan.layers)
            t_descs, _ = _timed(_xfer_descs, a, s, d, lb.mem)
            t_prep, handle = _timed(lb.prepare, s, d)
            t_post, _ = _timed(lb.post, handle)
            lb.finish(handle)
            t_mk, handle = _timed(a.make_prepped_xfer, "WRITE", lists[0], idx, lists[1], idx)
            t_mpost, _ = _timed(lb.post, handle)
            lb.finish(handle)
            times = (t_build, t_list, t_index, t_descs, t_prep, t_post, t_mk, t_mpost)
            for k, v in zip(rows, times, strict=True):
                rows[k].append(v)
        for k in out:
            out[k].append(rows[k])
        for h in lists:
            a.release_dlist_handle(h)
    return out


def _xfer_descs(agent: Any, src: np.ndarray, dst: np.ndarray, mem: str) -> tuple[Any, Any]:
    return agent.get_xfer_descs(src, mem), agent.get_xfer_descs(dst, mem)


def _python_lists(src: np.ndarray, dst: np.ndarray) -> tuple[list, list, list]:
    """Mooncake's slice path: Python lists of source and destination addresses and
    lengths, one element per descriptor (built in a Python loop, GIL held)."""
    s_addr, d_addr, lens = [], [], []
    for s_row, d_row in zip(src.tolist(), dst.tolist(), strict=True):
        s_addr.append(s_row[0])
        d_addr.append(d_row[0])
        lens.append(s_row[1])
    return s_addr, d_addr, lens


def _indices(n: int, layers: int) -> np.ndarray:
    """Prepared lists (SGLang PR #26406): the per-chunk work is the indices of the
    descriptors into the lists prepared once, per (layer, K/V) plane, numpy."""
    planes = 2 * layers
    tokens = max(1, n // planes)
    base = np.arange(planes, dtype=np.int64)[:, None] * (4 * tokens)
    return (base + np.arange(tokens, dtype=np.int64)[None, :]).reshape(-1)[:n]


def _python_work(stop: threading.Event) -> int:
    """A scheduler's Python-level work: bookkeeping over small objects, until stopped."""
    done = 0
    reqs = [{"rid": i, "len": i % 97} for i in range(64)]
    while not stop.is_set():
        total = 0
        for r in reqs:
            total += r["len"] * 3 + (r["rid"] & 7)
        done += 1
    return done


def _worker_loop(lb: _Loopback, n: int, stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        s, d = lb.build(n)
        h = lb.prepare(s, d)
        lb.post(h)
        lb.finish(h)
        count[0] += 1


def _run_for(seconds: float, worker: bool, python: bool, lb: _Loopback, n: int):
    stop = threading.Event()
    count = [0]
    th = None
    if worker:
        th = threading.Thread(target=_worker_loop, args=(lb, n, stop, count))
        th.start()
    t0 = time.perf_counter()
    py = 0
    if python:
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        py = _python_work(stop)
    else:
        time.sleep(seconds)
        stop.set()
    el = time.perf_counter() - t0
    if th is not None:
        th.join()
    return count[0] / el, py / el


def _gil(lb: _Loopback, plan: DescriptorPlan) -> dict[str, float]:
    w_alone, _ = _run_for(plan.gil_s, True, False, lb, plan.gil_n)
    _, p_alone = _run_for(plan.gil_s, False, True, lb, plan.gil_n)
    w_both, p_both = _run_for(plan.gil_s, True, True, lb, plan.gil_n)
    return {
        "n": plan.gil_n,
        "worker_batches_per_s_alone": w_alone,
        "worker_batches_per_s_beside_python": w_both,
        "python_iters_per_s_alone": p_alone,
        "python_iters_per_s_beside_worker": p_both,
    }


def measure_descriptors(plan: DescriptorPlan | None = None) -> dict[str, Any]:
    """The probe's raw points (see the module docstring)."""
    plan = plan or DescriptorPlan()
    lb = _Loopback(plan)
    try:
        sweep = _sweep(lb, plan)
        gil = _gil(lb, plan)
    finally:
        lb.close()
    return {
        "engine": "nixl",
        "memory": lb.mem,
        "device": plan.device,
        "counts": list(plan.counts),
        "slice_bytes": plan.slice_bytes,
        "sweep": sweep,
        "gil": gil,
    }
