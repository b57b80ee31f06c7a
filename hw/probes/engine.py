"""The hardware probe of `kvstage calibrate`: measure this machine's engine.

Two real processes (hw/probes/harness.py start_child, talking to the parent over Pipes)
measure what the simulator's profile numbers stand for, on the real engine, and hand back the
raw points (`measure`); fitting them and writing the profile is the application's
part (kvstage/calibrate/profile.py).

- bulk writes: one write of each size of a sweep (4 KiB .. 64 MiB), several reps, from
  `Transport.write` until `poll` says done;
- per-request overhead: one batch of n ops of s bytes for a sweep of n;
- control messages: ping-pong of real protocol messages (shared.protocol codec) over
  the ZMQ PUSH/PULL control plane of hw/control/plane.py, and the pinging process's CPU
  time per ping (a message's CPU cost in a rank loop);
- gather / scatter: hw/rank/kernels.py on KV pools of this device;
- the hardware-mode prefill 'forward' (hw.kvpool.fill_pattern, what a prefill rank
  runs per chunk) for a sweep of chunk sizes;
- a matmul (the profile schema's gpu_tflops);
- the CPU an idle engine process burns: the receiver's CPU time while it only waits;
- extra measurements the caller names (`Extra`), run in the sender after the kernels:
  module-level functions, so they travel to the spawned child by reference. The
  calibration command adds the state machine's per-event cost this way; this module
  imports nothing beyond kvstage.shared and kvstage.hw.

Every wait here is bounded; a child that dies or hangs fails the measurement
(`CalibrationError`) with the tail of its log.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import wait as wait_connections
from typing import Any

import numpy as np

from kvstage.hw.probes.harness import (
    CalibrationError,
    ProgressFn,
    child_setup,
    expect,
    probe_context,
    reap,
    start_child,
    tail,
    usable_cores,
)

__all__ = [
    "KERNEL_GEOMETRY",
    "CalibrationPlan",
    "Extra",
    "measure",
]

KIB = 1 << 10
MIB = 1 << 20

# One extra measurement: a name for its raw points, and a module-level function that
# takes a progress callback and returns them (it runs in the sender process).
Extra = tuple[str, Callable[[ProgressFn], dict[str, Any]]]


# =========================================================================== plan


@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure; `quick()` keeps a run to a few seconds of measuring."""

    sizes: tuple[int, ...]
    reps: int
    batch_counts: tuple[int, ...]
    batch_op_bytes: int
    batch_reps: int
    control_pings: int
    kernel_pages: tuple[int, ...]
    kernel_reps: int
    fill_pages: tuple[int, ...]
    step_timeout_s: float = 90.0  # longest silence from the children before giving up
    write_timeout_s: float = 30.0  # bound of one write
    quick: bool = False

    @classmethod
    def full(cls) -> CalibrationPlan:
        return cls(
            sizes=tuple(4 * KIB * 4**k for k in range(8)),  # 4 KiB .. 64 MiB
            reps=7,
            batch_counts=(1, 4, 16, 64, 256, 1024),
            batch_op_bytes=4 * KIB,
            batch_reps=7,
            control_pings=1000,
            kernel_pages=(1, 2, 4, 8, 16, 32, 64, 128),
            kernel_reps=7,
            fill_pages=(1, 2, 4, 8, 16, 32, 64),
        )

    @classmethod
    def quick_plan(cls) -> CalibrationPlan:
        return cls(
            sizes=(4 * KIB, 32 * KIB, 256 * KIB, 2 * MIB, 16 * MIB),
            reps=3,
            batch_counts=(1, 16, 128, 512),
            batch_op_bytes=4 * KIB,
            batch_reps=3,
            control_pings=200,
            kernel_pages=(1, 4, 16, 64),
            # fills to 64 pages, 5 timed each: a small fill's time is mostly its fixed
            # cost, so over 1-16 pages a busy host's noise (3 reps, beside other work
            # on 2 cores) once hid the byte term and the fit found no slope
            kernel_reps=5,
            fill_pages=(1, 4, 16, 64),
            step_timeout_s=60.0,
            quick=True,
        )

    @property
    def buffer_bytes(self) -> int:
        batch = max(self.batch_counts) * 2 * self.batch_op_bytes
        return max(max(self.sizes), batch)


# Kernel geometry: a fan-in pair P2 -> D1 with 8 KV heads, 4 layers, head_dim 128, bf16
# (128 KiB per page of a 4-head pool): gather of a writer's 4 heads (contiguous rows),
# gather of 2 of 4 heads (strided, the fan-out case), scatter of a 2-writer region.
KERNEL_GEOMETRY = {"layers": 4, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "page_size": 16}


# =========================================================================== children


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _spin_wait(transport: Any, handle: Any, timeout_s: float, what: str) -> None:
    """Poll until done, as a rank's busy loop does (no back-off sleeps that would
    quantise the measurement), yielding the GIL each turn; bounded."""
    deadline = time.perf_counter() + timeout_s
    while not transport.poll(handle):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not done within {timeout_s:g} s")
        time.sleep(0)


def _receiver_main(
    backend: str, device: str, plan: CalibrationPlan, conn: Any, log_path: str, place: Any = None
) -> None:
    try:
        child_setup(log_path, place, "receiver")
        import torch

        from kvstage.hw.control.plane import ControlPlane
        from kvstage.hw.transport.base import make_transport
        from kvstage.shared.protocol import Abort

        opts = place.transport_options(backend) if place is not None else {}
        transport = make_transport(backend, f"kvstage-cal-recv-{os.getpid()}", device, **opts)
        dst = torch.zeros(plan.buffer_bytes, dtype=torch.uint8, device=device)
        transport.register(dst)
        conn.send(("metadata", transport.agent_name, transport.metadata()))
        cp = ControlPlane(place.address) if place is not None else ControlPlane()
        conn.send(("control", cp.address, cp.identity))
        _, peer_addr, peer = expect(conn, "control", plan.step_timeout_s * 3)
        cp.connect("ping", peer_addr, peer)
        # Echo every message back until the pinger's Abort (bounded).
        deadline = time.monotonic() + plan.step_timeout_s
        stop = False
        while not stop and time.monotonic() < deadline:
            for msg in cp.receive(0.2):
                if isinstance(msg, Abort):
                    stop = True
                    break
                cp.send("ping", msg)
        conn.send(("echo-done", stop))
        # While the sender runs its kernels, this process only waits on the pipe: the CPU
        # it still burns is the engine's own threads (e.g. a busy-polling progress thread).
        cpu0, wall0 = time.process_time(), time.perf_counter()
        expect(conn, "bye", plan.step_timeout_s * 3)
        wall = time.perf_counter() - wall0
        conn.send(("result", "idle_cpu", {"cpu_s": time.process_time() - cpu0, "wall_s": wall}))
        cp.close()
        transport.close()
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _progress(conn: Any, stage: str, done: int, total: int) -> None:
    conn.send(("progress", stage, done, total))


def _shuffled_reps(
    rng: np.random.Generator, points: int, reps: int, conn: Any, stage: str
) -> Iterator[tuple[int, int]]:
    """(rep, point index) for reps + 1 rounds over `points` points, each round in a fresh
    random order, with a progress message after each; rep 0 is the warm-up (connections,
    page tables, caches) whose times are not kept."""
    total = (reps + 1) * points
    n = 0
    for rep in range(reps + 1):
        for i in rng.permutation(points):
            yield rep, i
            n += 1
            _progress(conn, stage, n, total)


def _timed_writes(
    transport: Any,
    peer: str,
    points: int,
    reps: int,
    rng: np.random.Generator,
    make_ops: Callable[[int], tuple[np.ndarray, str]],
    timeout_s: float,
    conn: Any,
    stage: str,
) -> dict[str, Any]:
    """Seconds to completion and to post of each point's write (`make_ops(i)` gives its
    ops and a name for errors), `reps` times each after a warm-up."""
    seconds: list[list[float]] = [[] for _ in range(points)]
    post: list[list[float]] = [[] for _ in range(points)]
    for rep, i in _shuffled_reps(rng, points, reps, conn, stage):
        ops, what = make_ops(i)
        total_s, post_s = _timed_write(transport, peer, ops, timeout_s, what)
        if rep:
            seconds[i].append(total_s)
            post[i].append(post_s)
    return {"seconds": seconds, "post_seconds": post}


def _measure_writes(
    transport: Any, peer: str, src_addr: int, dst_addr: int, plan: CalibrationPlan, conn: Any
) -> dict[str, Any]:
    sizes = list(plan.sizes)

    def one_op(i: int) -> tuple[np.ndarray, str]:
        return np.array([[src_addr, dst_addr, sizes[i]]], dtype=np.int64), f"write of {sizes[i]} B"

    timed = _timed_writes(
        transport,
        peer,
        len(sizes),
        plan.reps,
        np.random.default_rng(11),
        one_op,
        plan.write_timeout_s,
        conn,
        "writes",
    )
    return {"sizes": sizes, **timed}


def _timed_write(
    transport: Any, peer: str, ops: np.ndarray, timeout_s: float, what: str
) -> tuple[float, float]:
    """(seconds to completion, seconds to post) of one batch, polled as a rank polls."""
    t0 = time.perf_counter()
    handle = transport.write(peer, ops)
    t1 = time.perf_counter()
    _spin_wait(transport, handle, timeout_s, what)
    return time.perf_counter() - t0, t1 - t0


def _measure_batches(
    transport: Any, peer: str, src_addr: int, dst_addr: int, plan: CalibrationPlan, conn: Any
) -> dict[str, Any]:
    s = plan.batch_op_bytes
    stride = 2 * s  # gaps between ops, so no engine can merge neighbours into one
    counts = list(plan.batch_counts)
    rng = np.random.default_rng(12)

    def batch(i: int) -> tuple[np.ndarray, str]:
        k = counts[i]
        idx = np.arange(k, dtype=np.int64)
        ops = np.stack(
            [
                src_addr + idx * stride,
                dst_addr + rng.permutation(k).astype(np.int64) * stride,
                np.full(k, s, dtype=np.int64),
            ],
            axis=1,
        )
        return ops, f"batch of {k} x {s} B"

    timed = _timed_writes(
        transport,
        peer,
        len(counts),
        plan.batch_reps,
        rng,
        batch,
        plan.write_timeout_s,
        conn,
        "batches",
    )
    return {"op_bytes": s, "counts": counts, **timed}


def _measure_control(plan: CalibrationPlan, conn: Any, place: Any = None) -> dict[str, Any]:
    from kvstage.hw.control.plane import ControlPlane
    from kvstage.shared.protocol import Abort, Watermark

    cp = ControlPlane(place.address) if place is not None else ControlPlane()
    conn.send(("control", cp.address, cp.identity))
    _, echo_addr, echo = expect(conn, "control", plan.step_timeout_s)
    cp.connect("echo", echo_addr, echo)
    timeout = min(10.0, plan.step_timeout_s)
    rtts: list[float] = []
    warm = max(10, plan.control_pings // 10)
    total = warm + plan.control_pings
    try:
        for i in range(total):
            msg = Watermark(round=i, tail=i, prefill_rank=0, decode_rank=0)
            t0 = time.perf_counter()
            cp.send("echo", msg)
            got = None
            while got is None:
                left = timeout - (time.perf_counter() - t0)
                if left <= 0:
                    raise TimeoutError(f"control ping {i}: no echo within {timeout:g} s")
                for m in cp.receive(left):
                    if isinstance(m, Watermark) and m.round == i:
                        got = m
            if i == warm - 1:
                cpu0 = time.process_time()
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
            if i % 20 == 0 or i == total - 1:
                _progress(conn, "control", i + 1, total)
        cpu = time.process_time()
    finally:
        cp.send("echo", Abort(room=0, prefill_rank=0, decode_rank=0, reason="calibration done"))
        time.sleep(0.05)
        cp.close()
    # this process's CPU (every thread: ZMQ's I/O thread too) per measured ping: one
    # message out and one in, each framed, authenticated and (de)coded
    return {"rtt_s": rtts, "cpu_per_ping_s": (cpu - cpu0) / len(rtts) if rtts else 0.0}


def _time_call(fn: Callable[[], None], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _measure_kernels(device: str, plan: CalibrationPlan, conn: Any) -> dict[str, Any]:
    import torch

    from kvstage.hw.rank.kernels import block_bytes, gather, scatter
    from kvstage.hw.rank.kvpool import KVPool
    from kvstage.shared.layout import Geometry

    kg = KERNEL_GEOMETRY
    geo = Geometry(
        prefill_tp=2,
        decode_tp=1,
        total_kv_heads=kg["kv_heads"],
        layers=kg["layers"],
        head_dim=kg["head_dim"],
        dtype_bytes=2,
        page_size=kg["page_size"],
        chunked_prefill_size=kg["page_size"] * max(plan.kernel_pages),
    )
    max_pages = max(max(plan.kernel_pages), max(plan.fill_pages))
    src = KVPool(
        kg["layers"],
        max_pages,
        kg["page_size"],
        geo.prefill_heads,
        kg["head_dim"],
        kg["dtype"],
        device=device,
        fill_byte=7,
    )
    dst = KVPool(
        kg["layers"],
        max_pages,
        kg["page_size"],
        geo.decode_heads,
        kg["head_dim"],
        kg["dtype"],
        device=device,
        fill_byte=0,
    )
    heads = geo.prefill_heads
    out = torch.zeros(block_bytes(src, max_pages, heads), dtype=torch.uint8, device=device)
    region = torch.zeros(geo.region_bytes(max_pages), dtype=torch.uint8, device=device)
    pages = list(plan.kernel_pages)
    res: dict[str, Any] = {
        "geometry": dict(kg),
        "gather": {
            "bytes": [block_bytes(src, p, heads) for p in pages],
            "seconds": [[] for _ in pages],
        },
        "gather_sub": {
            "bytes": [block_bytes(src, p, heads // 2) for p in pages],
            "seconds": [[] for _ in pages],
        },
        "scatter": {
            "bytes": [geo.region_bytes(p) for p in pages],
            "launches": len(geo.writers(0)),
            "seconds": [[] for _ in pages],
        },
    }
    rng = np.random.default_rng(13)
    for rep, i in _shuffled_reps(rng, len(pages), plan.kernel_reps, conn, "kernels"):
        p = int(pages[i])
        g_out = out[: block_bytes(src, p, heads)]
        t = _time_call(lambda p=p, g_out=g_out: gather(src, 0, p, 0, heads, g_out), device)
        s_out = out[: block_bytes(src, p, heads // 2)]
        ts = _time_call(lambda p=p, s_out=s_out: gather(src, 0, p, 1, heads // 2, s_out), device)
        layout = geo.staging_layout(0, p)
        reg = region[: layout.region_bytes]
        tc = _time_call(lambda p=p, reg=reg, layout=layout: scatter(dst, 0, p, reg, layout), device)
        if rep:
            res["gather"]["seconds"][i].append(t)
            res["gather_sub"]["seconds"][i].append(ts)
            res["scatter"]["seconds"][i].append(tc)
    res["fill"] = _measure_fill(src, heads, plan, rng, conn, device)
    res["matmul"] = _measure_matmul(device, plan.kernel_reps)
    return res


def _measure_fill(
    src: Any, heads: int, plan: CalibrationPlan, rng: Any, conn: Any, device: str
) -> dict[str, Any]:
    """The hardware-mode prefill 'forward': fill_pattern of a chunk's pages."""
    from kvstage.hw.rank.kernels import block_bytes
    from kvstage.hw.rank.kvpool import fill_pattern

    fpages = list(plan.fill_pages)
    global_heads = list(range(heads))
    page_bytes = block_bytes(src, 1, heads)
    fill = {
        "bytes": [p * page_bytes for p in fpages],
        "seconds": [[] for _ in fpages],
        "bytes_per_token": page_bytes // KERNEL_GEOMETRY["page_size"],
    }
    for rep, i in _shuffled_reps(rng, len(fpages), plan.kernel_reps, conn, "fill"):
        p = int(fpages[i])
        t = _time_call(lambda p=p, room=rep: fill_pattern(src, 0, p, room, 0, global_heads), device)
        if rep:
            fill["seconds"][i].append(t)
    return fill


def _measure_matmul(device: str, reps: int) -> dict[str, Any]:
    """gpu_tflops: fp32 matmul (the profile schema needs it; bf16 on cuda)."""
    import torch

    dim = 512 if device == "cpu" else 4096
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a = torch.randn(dim, dim, dtype=dtype, device=device)
    b = torch.randn(dim, dim, dtype=dtype, device=device)
    mm = [_time_call(lambda: torch.mm(a, b), device) for _ in range(reps + 1)][1:]
    return {"n": dim, "dtype": str(dtype), "seconds": mm}


def _sender_main(
    backend: str,
    device: str,
    plan: CalibrationPlan,
    conn: Any,
    log_path: str,
    extras: Sequence[Extra] = (),
    place: Any = None,
) -> None:
    try:
        child_setup(log_path, place, "sender")
        import torch

        from kvstage.hw.transport.base import make_transport

        opts = place.transport_options(backend) if place is not None else {}
        transport = make_transport(backend, f"kvstage-cal-send-{os.getpid()}", device, **opts)
        src = torch.randint(
            0,
            256,
            (plan.buffer_bytes,),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(5),
        ).to(device)
        local = transport.register(src)
        _, peer, metadata = expect(conn, "metadata", plan.step_timeout_s * 3)
        transport.add_peer(peer, metadata)
        remote = transport.peer(peer).regions[0]
        conn.send(
            (
                "result",
                "write",
                _measure_writes(transport, peer, local.addr, remote.addr, plan, conn),
            )
        )
        conn.send(
            (
                "result",
                "batch",
                _measure_batches(transport, peer, local.addr, remote.addr, plan, conn),
            )
        )
        conn.send(("result", "transport_used", transport.used()))  # what carried the writes
        transport.close()
        conn.send(("result", "control", _measure_control(plan, conn, place)))
        conn.send(("result", "kernels", _measure_kernels(device, plan, conn)))
        for name, extra in extras:
            conn.send(("result", name, extra(partial(_progress, conn))))
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# =========================================================================== parent


@dataclass
class _Children:
    """The two measuring processes, the parent's ends of their pipes, and what came back."""

    procs: dict[str, Any]
    conns: dict[str, Any]
    logs: dict[str, str]
    logdir: str
    raw: dict[str, Any] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    waiting_for: str = "the measuring processes to start"

    @classmethod
    def spawn(
        cls,
        backend: str,
        device: str,
        plan: CalibrationPlan,
        extras: Sequence[Extra],
        hosts: dict[str, Any] | None = None,
    ) -> _Children:
        from kvstage.hw.control.plane import SECRET_ENV, new_secret

        os.environ.setdefault(
            SECRET_ENV, new_secret().hex()
        )  # the children's control planes share it
        ctx = probe_context()
        logdir = tempfile.mkdtemp(prefix="kvstage-calibrate-")
        logs = {
            "receiver": os.path.join(logdir, "receiver.log"),
            "sender": os.path.join(logdir, "sender.log"),
        }
        r_parent, r_child = ctx.Pipe()
        s_parent, s_child = ctx.Pipe()
        receiver_args = (backend, device, plan, r_child, logs["receiver"])
        sender_args = (backend, device, plan, s_child, logs["sender"], tuple(extras))
        procs = {
            "receiver": start_child(
                ctx,
                _receiver_main,
                (*receiver_args, (hosts or {}).get("receiver")),
                "kvstage-cal-recv",
            ),
            "sender": start_child(
                ctx, _sender_main, (*sender_args, (hosts or {}).get("sender")), "kvstage-cal-send"
            ),
        }
        r_child.close()
        s_child.close()
        return cls(procs, {"receiver": r_parent, "sender": s_parent}, logs, logdir)

    def run(self, step_timeout_s: float, progress: ProgressFn | None, started: float) -> None:
        """Relay messages between the children until both are done (bounded)."""
        last_news = started
        while self.finished != set(self.procs):
            live = [c for name, c in self.conns.items() if name not in self.finished]
            ready = wait_connections(live, timeout=1.0)
            now = time.monotonic()
            self._check_alive()
            if not ready:
                if now - last_news > step_timeout_s:
                    raise CalibrationError(
                        f"no progress for {step_timeout_s:.0f} s while waiting for {self.waiting_for} "
                        f"(logs in {self.logdir})"
                    )
                continue
            last_news = now
            for c in ready:
                name = "receiver" if c is self.conns["receiver"] else "sender"
                self._route(name, self._receive(name), progress)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if name not in self.finished and not proc.is_alive() and not self.conns[name].poll():
                raise CalibrationError(
                    f"the {name} process died (exit code {proc.exitcode}) while waiting for "
                    f"{self.waiting_for}; its log {self.logs[name]}:\n{tail(self.logs[name])}"
                )

    def _receive(self, name: str) -> tuple:
        try:
            msg = self.conns[name].recv()
        except EOFError:
            raise CalibrationError(
                f"the {name} process closed its pipe while waiting for {self.waiting_for}; "
                f"its log:\n{tail(self.logs[name])}"
            ) from None
        if msg[0] == "error":
            raise CalibrationError(
                f"the {name} process failed:\n{msg[1]}\nlog tail:\n{tail(self.logs[name])}"
            )
        return msg

    def _route(self, name: str, msg: tuple, progress: ProgressFn | None) -> None:
        kind = msg[0]
        if kind == "progress":
            self.waiting_for = f"{msg[1]} ({msg[2]}/{msg[3]})"
            if progress is not None:
                progress(msg[1], msg[2], msg[3])
        elif kind == "metadata":
            self.conns["sender"].send(msg)
        elif kind == "control":
            self.conns["sender" if name == "receiver" else "receiver"].send(msg)
        elif kind == "result":
            self.raw[msg[1]] = msg[2]
        elif kind == "done":
            self.finished.add(name)
            if name == "sender":
                self.conns["receiver"].send(("bye",))
        # "echo-done" needs nothing: the receiver goes on to measure its idle CPU

    def abort(self) -> None:
        for c in self.conns.values():
            try:
                c.send(("abort", "calibration failed in the parent"))
            except (OSError, ValueError):
                pass

    def reap(self) -> None:
        reap(self.procs.values(), self.conns)


def measure(
    backend: str,
    device: str = "cpu",
    plan: CalibrationPlan | None = None,
    progress: ProgressFn | None = None,
    extras: Sequence[Extra] = (),
    hosts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the two measuring processes; return the raw points (see module docstring).
    `hosts`: "sender" / "receiver" -> where each runs (hw/probes/hosts.py ProbeHost).

    `extras`: further measurements for the sender to run after the kernels, each
    stored under its name in the raw points."""
    from kvstage.hw.transport.base import probe_engine

    plan = plan or CalibrationPlan.full()
    why = probe_engine(backend)
    if why is not None:
        raise CalibrationError(f"{backend}: engine not usable here: {why}")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise CalibrationError(f"device {device!r} not allowed (allowed: cpu, cuda, cuda:N)")
    children = _Children.spawn(backend, device, plan, extras, hosts)
    start = time.monotonic()
    try:
        children.run(plan.step_timeout_s, progress, start)
    except BaseException:
        children.abort()
        raise
    finally:
        children.reap()
    raw = children.raw
    raw["elapsed_s"] = time.monotonic() - start
    raw["host_cores"] = usable_cores()
    return raw
