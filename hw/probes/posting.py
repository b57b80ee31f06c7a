"""The posting probe of `kvstage calibrate`: what a transfer request costs the rank that
posts it, whether two batches posted at once serialise, and the small-write message rate.

Three processes (hw/probes/harness.py start_child, Pipes to the parent): a receiver that only
registers memory, and two senders A and B, each one rank with its own engine. The
engine is called directly (NIXL agent, Mooncake TransferEngine: the adapters' own
objects, so registration and metadata are hardware mode's), because what is measured
is the engine's cost, not kvstage's op validation around it:

- sweep (sender A): batches of n writes of `op_bytes` each (non-adjacent, shuffled
  destinations, so no engine can merge them) for a sweep of n, timed to "posted" (the
  call that hands the batch to the engine returned) and to "done" (the engine says
  complete). `fresh`: descriptors built for every batch (NIXL get_xfer_descs +
  initialize_xfer; Mooncake batch_transfer_async_write with new lists);
  `prepped` (NIXL only): descriptor lists prepared once (prep_xfer_dlist), each batch
  made from indices (make_prepped_xfer), as a KV connector that registers its pages
  once does.
- two ranks: A and B post a batch of `pair_ops` writes at the same wall-clock instant
  (a start time both processes wait for) to the one receiver; each round first times
  one batch of A alone, the baseline.
- two threads (A): two threads of one process, each with its own engine instance
  (a rank's engine is not shared between threads in hardware mode), post at once
  (threading.Barrier); again each round first times one batch alone.

Every time is seconds from the batch's start. Fitting is kvstage/calibrate/posting.py.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
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

__all__ = ["PostingPlan", "measure_posting"]


@dataclass(frozen=True)
class PostingPlan:
    """What the posting probe measures; `quick_plan()` keeps it to a few seconds."""

    counts: tuple[int, ...] = (1, 16, 128, 1024, 4096, 16384)
    op_bytes: int = 64
    reps: int = 5
    pair_ops: int = 4096
    pair_reps: int = 7
    timeout_s: float = 60.0  # longest silence from a child before giving up
    quick: bool = False

    @classmethod
    def quick_plan(cls) -> PostingPlan:
        return cls(
            counts=(1, 64, 512, 4096),
            reps=3,
            pair_ops=2048,
            pair_reps=3,
            timeout_s=45.0,
            quick=True,
        )

    @property
    def max_ops(self) -> int:
        return max(max(self.counts), self.pair_ops)

    @property
    def buffer_bytes(self) -> int:
        return 2 * self.op_bytes * self.max_ops  # stride 2 * op_bytes: gaps between ops


# =========================================================================== engines


class _Poster:
    """One sender's engine, driven directly: post a batch of the first n ops, wait."""

    def __init__(
        self, backend: str, name: str, plan: PostingPlan, metadata: bytes, peer: str
    ) -> None:
        import torch

        from kvstage.hw.transport.base import make_transport

        self.backend = backend
        self.transport = make_transport(backend, name, "cpu")
        self.src = torch.randint(0, 256, (plan.buffer_bytes,), dtype=torch.uint8)
        local = self.transport.register(self.src)
        self.transport.add_peer(peer, metadata)
        self.peer = self.transport.peer(peer)
        remote = self.peer.regions[0]
        stride, n = 2 * plan.op_bytes, plan.max_ops
        rng = np.random.default_rng(17)
        self.ops = np.stack(
            [
                local.addr + np.arange(n, dtype=np.int64) * stride,
                remote.addr + rng.permutation(n).astype(np.int64) * stride,
                np.full(n, plan.op_bytes, dtype=np.int64),
            ],
            axis=1,
        )
        self._prepped: tuple[Any, Any] | None = None
        self._warm()

    def _warm(self) -> None:
        """One write first: connection setup (UCX wire-up, Mooncake handshake) is not timed."""
        self.wait(self.post_fresh(1))

    def post_fresh(self, n: int) -> Any:
        ops = self.ops[:n]
        if self.backend == "nixl":
            agent, t = self.transport._agent, self.transport
            local = np.empty((n, 3), dtype=np.uint64)
            local[:, 0], local[:, 1], local[:, 2] = ops[:, 0], ops[:, 2], t.device_id
            remote = np.empty((n, 3), dtype=np.uint64)
            remote[:, 0], remote[:, 1], remote[:, 2] = ops[:, 1], ops[:, 2], self.peer.device_id
            xfer = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, t._mem_type),
                agent.get_xfer_descs(remote, self.peer.native),
                self.peer.name,
            )
            agent.transfer(xfer)
            return xfer
        engine = self.transport._engine
        batch = engine.batch_transfer_async_write(
            self.peer.native, ops[:, 0].tolist(), ops[:, 1].tolist(), ops[:, 2].tolist()
        )
        if batch in (0, -1, 2**64 - 1):
            raise RuntimeError(f"mooncake refused a batch of {n} writes (returned {batch})")
        return batch

    def prepare(self) -> None:
        """NIXL: descriptor lists of every op, prepared once (not timed)."""
        agent, t, n = self.transport._agent, self.transport, len(self.ops)
        local = np.stack([self.ops[:, 0], self.ops[:, 2], np.full(n, t.device_id)], axis=1).astype(
            np.uint64
        )
        remote = np.stack([self.ops[:, 1], self.ops[:, 2], np.full(n, self.peer.device_id)], axis=1)
        self._prepped = (
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, t._mem_type),
            agent.prep_xfer_dlist(self.peer.name, remote.astype(np.uint64), self.peer.native),
        )
        self._index = np.arange(n, dtype=np.int32)

    def post_prepped(self, n: int) -> Any:
        assert self._prepped is not None
        agent = self.transport._agent
        idx = self._index[:n]
        xfer = agent.make_prepped_xfer("WRITE", self._prepped[0], idx, self._prepped[1], idx)
        agent.transfer(xfer)
        return xfer

    def wait(self, handle: Any, timeout_s: float = 30.0) -> None:
        deadline = time.perf_counter() + timeout_s
        if self.backend == "nixl":
            agent = self.transport._agent
            while (state := agent.check_xfer_state(handle)) != "DONE":
                if state == "ERR" or time.perf_counter() > deadline:
                    raise RuntimeError(f"nixl batch {'failed' if state == 'ERR' else 'timed out'}")
                time.sleep(0)
            handle.release()
            return
        rc = self.transport._engine.get_batch_transfer_status([handle])  # blocks, GIL released
        if rc != 0:
            raise RuntimeError(f"mooncake batch status {rc}")

    def timed(self, post: Callable[[int], Any], n: int) -> tuple[float, float]:
        """(seconds to posted, seconds to done) of one batch of n writes."""
        t0 = time.perf_counter()
        handle = post(n)
        t1 = time.perf_counter()
        self.wait(handle)
        return t1 - t0, time.perf_counter() - t0


# =========================================================================== children


def _receiver(backend: str, plan: PostingPlan, conn: Any, log: str) -> None:
    try:
        child_setup(log)
        import torch

        from kvstage.hw.transport.base import make_transport

        t = make_transport(backend, f"kvstage-post-recv-{os.getpid()}", "cpu")
        t.register(torch.zeros(plan.buffer_bytes, dtype=torch.uint8))
        conn.send(("metadata", t.agent_name, t.metadata()))
        expect(conn, "bye", plan.timeout_s * 20)
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _sweep(p: _Poster, plan: PostingPlan, conn: Any) -> dict[str, Any]:
    modes: dict[str, Callable[[int], Any]] = {"fresh": p.post_fresh}
    if p.backend == "nixl":
        p.prepare()
        modes["prepped"] = p.post_prepped
    rng = np.random.default_rng(19)
    out: dict[str, Any] = {"op_bytes": plan.op_bytes, "counts": list(plan.counts)}
    for mode, post in modes.items():
        points: list[list[tuple[float, float]]] = [[] for _ in plan.counts]
        for rep in range(plan.reps + 1):  # rep 0 warms up
            for i in rng.permutation(len(plan.counts)):
                t = p.timed(post, plan.counts[i])
                if rep:
                    points[i].append(t)
            conn.send(("progress", f"posting {mode}", rep + 1, plan.reps + 1))
        out[mode] = {
            "post_s": [[a for a, _ in pt] for pt in points],
            "done_s": [[b for _, b in pt] for pt in points],
        }
    return out


def _two_threads(p: _Poster, second: _Poster, plan: PostingPlan) -> dict[str, list]:
    """Each rep: one batch alone, then (posted, done) of the two threads' batches posted
    at the same instant (alternating, so both see the same conditions)."""
    reps: list[list[tuple[float, float]]] = []
    alone: list[tuple[float, float]] = []
    for _ in range(plan.pair_reps + 1):
        alone.append(p.timed(p.post_fresh, plan.pair_ops))
        barrier = threading.Barrier(2)
        res: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
        errors: list[BaseException] = []

        def run(i: int, poster: _Poster, barrier: threading.Barrier = barrier,
                res: list = res, errors: list = errors) -> None:  # fmt: skip
            try:
                barrier.wait(plan.timeout_s)
                res[i] = poster.timed(poster.post_fresh, plan.pair_ops)
            except BaseException as e:  # surfaced below, on the sender's main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, q)) for i, q in enumerate((p, second))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(plan.timeout_s)
        if errors or any(th.is_alive() for th in threads):
            raise RuntimeError(f"two-thread posting failed: {errors or 'a thread hung'}")
        reps.append(list(res))
    return {"alone": alone[1:], "pairs": reps[1:]}  # the first round warms up


def _at(start: float, p: _Poster, n: int) -> tuple[float, float]:
    """Post at wall-clock `start` (both ranks wait for the same instant); times from it."""
    while (left := start - time.time()) > 0.002:
        time.sleep(left - 0.001)
    while time.time() < start:
        pass
    t0 = time.time()
    handle = p.post_fresh(n)
    t1 = time.time()
    p.wait(handle)
    return t1 - t0, time.time() - t0


def _sender(backend: str, plan: PostingPlan, conn: Any, log: str, role: str) -> None:
    try:
        child_setup(log)
        _, peer, metadata = expect(conn, "metadata", plan.timeout_s * 3)
        p = _Poster(backend, f"kvstage-post-{role}-{os.getpid()}", plan, metadata, peer)
        conn.send(("ready",))
        while True:
            msg = expect(conn, "run", plan.timeout_s * 20)
            step = msg[1]
            if step == "sweep":
                conn.send(("result", "sweep", _sweep(p, plan, conn)))
            elif step == "alone":
                conn.send(("result", "alone", p.timed(p.post_fresh, plan.pair_ops)))
            elif step == "pair":
                conn.send(("result", f"pair-{role}", _at(msg[2], p, plan.pair_ops)))
            elif step == "threads":
                second = _Poster(
                    backend, f"kvstage-post-{role}2-{os.getpid()}", plan, metadata, peer
                )
                conn.send(("result", "threads", _two_threads(p, second, plan)))
            elif step == "stop":
                break
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# =========================================================================== parent


class _Run:
    """The three processes and the parent's ends of their pipes."""

    def __init__(self, backend: str, plan: PostingPlan) -> None:
        ctx = probe_context()
        self.plan = plan
        self.logdir = tempfile.mkdtemp(prefix="kvstage-posting-")
        self.logs = {n: os.path.join(self.logdir, f"{n}.log") for n in ("receiver", "A", "B")}
        self.conns: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        for name in ("receiver", "A", "B"):
            parent, child = ctx.Pipe()
            if name == "receiver":
                target, args = _receiver, (backend, plan, child, self.logs[name])
            else:
                target, args = _sender, (backend, plan, child, self.logs[name], name)
            self.procs[name] = start_child(ctx, target, args, f"kvstage-post-{name}")
            child.close()
            self.conns[name] = parent

    def recv(self, name: str, kind: str, progress: ProgressFn | None) -> tuple:
        """The next message of `kind` from child `name` (progress relayed; bounded)."""
        conn, deadline = self.conns[name], time.monotonic() + self.plan.timeout_s
        while True:
            if not wait_connections(
                [conn], timeout=max(0.0, min(1.0, deadline - time.monotonic()))
            ):
                if not self.procs[name].is_alive():
                    raise CalibrationError(
                        f"posting probe: {name} died; log:\n{tail(self.logs[name])}"
                    )
                if time.monotonic() > deadline:
                    raise CalibrationError(
                        f"posting probe: no {kind!r} from {name} within "
                        f"{self.plan.timeout_s:.0f} s (logs in {self.logdir})"
                    )
                continue
            try:
                msg = conn.recv()
            except EOFError:
                raise CalibrationError(
                    f"posting probe: {name} closed its pipe; log:\n{tail(self.logs[name])}"
                ) from None
            if msg[0] == "error":
                raise CalibrationError(f"posting probe: {name} failed:\n{msg[1]}")
            if msg[0] == "progress":
                deadline = time.monotonic() + self.plan.timeout_s
                if progress is not None:
                    progress(msg[1], msg[2], msg[3])
            elif msg[0] == kind:
                return msg

    def reap(self) -> None:
        goodbye = {n: ("bye",) if n == "receiver" else ("run", "stop") for n in self.conns}
        reap(self.procs.values(), self.conns, goodbye)


def measure_posting(backend: str, plan: PostingPlan | None = None,
                    progress: ProgressFn | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the posting probe on this machine's `backend` engine; the raw points."""
    plan = plan or PostingPlan()
    run = _Run(backend, plan)
    try:
        meta = run.recv("receiver", "metadata", progress)
        for s in ("A", "B"):
            run.conns[s].send(meta)
        for s in ("A", "B"):
            run.recv(s, "ready", progress)
        raw: dict[str, Any] = {
            "backend": backend,
            "cores": usable_cores(),
            "pair_ops": plan.pair_ops,
        }
        for step in ("sweep", "threads"):
            run.conns["A"].send(("run", step))
            raw[step] = run.recv("A", "result", progress)[2]
        alone, pairs = [], []
        for rep in range(plan.pair_reps + 1):  # alternating: one alone, then both at once
            run.conns["A"].send(("run", "alone"))
            alone.append(run.recv("A", "result", progress)[2])
            start = time.time() + 0.1
            for s in ("A", "B"):
                run.conns[s].send(("run", "pair", start))
            pairs.append([run.recv(s, "result", progress)[2] for s in ("A", "B")])
            if progress is not None:
                progress("posting pairs", rep + 1, plan.pair_reps + 1)
        raw["two_ranks"] = {"alone": alone[1:], "pairs": pairs[1:]}  # the first round warms up
        return raw
    finally:
        run.reap()
