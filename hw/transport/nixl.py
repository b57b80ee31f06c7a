"""NIXL adapter: UCX backend, DRAM segments on cpu, VRAM on cuda.

Thin on purpose: envelope, validation, waiting and counters live in hw/transport/base.py.
Metadata is shipped by the caller (no NIXL listen thread), after registration, so the
peer never sees a snapshot that lacks our memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvstage.hw.transport.base import LaneBatch, PeerInfo, TransferError, Transport
from kvstage.hw.transport.placement import ENGINE_LOG_LEVELS
from kvstage.hw.transport.used import UCX_LOG_ENV, read_ucx_log

_MEM_TYPE = {"cpu": "DRAM", "cuda": "VRAM"}

# NIXL's Python API hard-codes pthrDelay = 0: the UCX progress thread then never blocks
# and spins a whole core per agent, idle or not (measured here: 0.93 core per agent, so
# three ranks on a 2-core host left the transfers themselves about half a core). With a
# delay the thread sleeps on the UCX worker's event fd and still wakes on every event;
# the delay only bounds how long it sleeps without one (measured: 0.01-0.02 core idle,
# 4 MiB CMA writes as fast). KVSTAGE_NIXL_PROGRESS_DELAY_US overrides it (0: NIXL's spin).
PROGRESS_DELAY_ENV = "KVSTAGE_NIXL_PROGRESS_DELAY_US"
PROGRESS_DELAY_US = 1000
# A lane waiting for a batch that transfer() left in flight looks again after this long,
# doubling up to the max (on CPU, CMA writes are done when transfer() returns).
LANE_POLL_MIN_S = 50e-6
LANE_POLL_MAX_S = 1e-3
_AGENT_LOCK = threading.Lock()


def progress_delay_us() -> int:
    text = os.environ.get(PROGRESS_DELAY_ENV, "").strip()
    if not text:
        return PROGRESS_DELAY_US
    if not text.isdigit():
        raise ValueError(
            f"{PROGRESS_DELAY_ENV} must be a whole number of microseconds, got {text!r}"
        )
    return int(text)


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Make agents created meanwhile use `delay_us` (nixl_agent offers no parameter for it)."""
    bind = api.nixlBind
    with _AGENT_LOCK:
        make = bind.nixlAgent

        def agent_with_delay(name: str, config: Any) -> Any:
            config.pthrDelay = delay_us
            return make(name, config)

        bind.nixlAgent = agent_with_delay
        try:
            yield
        finally:
            bind.nixlAgent = make


@dataclass(eq=False)
class _NixlXfer(LaneBatch):
    ops: np.ndarray | None = None  # until the lane posts them
    handle: Any = None  # nixl_xfer_handle


class NixlTransport(Transport):
    name: ClassVar[str] = "nixl"
    signals_completion: ClassVar[bool] = True  # every batch ends on its lane
    # the UCX progress thread and a lane's transfer() share the worker's lock (measured:
    # the progress thread raised alone made staging writes 10x slower)
    engine_alone: ClassVar[bool] = False
    engine_module: ClassVar[str] = "nixl._api"
    install_hint: ClassVar[str] = 'pip install "torch==2.13.0" "nixl==1.5.1" (CPU)'
    # NIXL's Python logger prints INFO on stdout; WARN keeps rank logs readable.
    engine_env_defaults: ClassVar[dict[str, str]] = {
        "NIXL_LOG_LEVEL": ENGINE_LOG_LEVELS["NIXL_LOG_LEVEL"]
    }

    def __init__(self, agent_name: str, device: str = "cpu") -> None:
        super().__init__(agent_name, device)
        api = self._import_engine()
        config = api.nixl_agent_config(
            enable_prog_thread=True,  # UCX progresses in the background between polls
            enable_listen_thread=False,  # we ship metadata ourselves; no port to pick
            backends=["UCX"],
            # Without a listen thread NIXL's default is NIXL_THREAD_SYNC_NONE: no lock at
            # all. A prefill registers and deregisters a send block per write on its loop
            # (deregister) while lanes create and post transfers, so take NIXL's
            # reader-writer lock (src/core/sync.h): transfers share it, a registration
            # takes it alone, waiting for a post in progress (on CMA, its copy).
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        delay_us = progress_delay_us()
        self.engine_threads_block = delay_us > 0  # at 0 the progress thread spins
        try:
            with _progress_delay(api, delay_us):
                self._agent = api.nixl_agent(agent_name, config)
        except Exception as e:
            raise TransferError(f"nixl: cannot create agent {agent_name!r}: {e}") from e
        # nixl_agent only warns when a plugin is missing; without UCX nothing moves.
        if "UCX" not in self._agent.backends:
            raise TransferError(
                f"nixl: agent {agent_name!r} has no UCX backend "
                f"(plugins found: {self._agent.get_plugin_list()})"
            )
        self._mem_type = _MEM_TYPE[self.device_type]
        self._reg_spans: Counter[tuple[int, int]] = Counter()  # (addr, nbytes) registered
        # True: write() makes the descriptors on the caller's thread, the lane only runs
        # transfer() (a prefill rank's hardware.posting = "loop"); batches so prepared
        self.prepare_inline = False
        self.prepared_inline = 0

    def used(self) -> dict[str, Any]:
        """UCX's protocol choices for this process's writes, from the UCX log the rank
        asked for (hw/rank/main.py sets UCX_PROTO_INFO and UCX_LOG_FILE before NIXL loads)."""
        path = os.environ.get(UCX_LOG_ENV)
        return read_ucx_log(Path(path) if path else None)

    def _register_native(self, addr: int, nbytes: int) -> None:
        self._register_native_many([(addr, nbytes)])

    def _register_native_many(self, spans) -> None:
        """One registerMem call for every span (a descriptor list)."""
        descs = self._agent.register_memory(self._descs(spans), self._mem_type)
        if descs is None:
            raise TransferError(
                f"nixl: register_memory returned nothing for {len(spans)} span(s), the first "
                f"{spans[0][1]} B at {spans[0][0]:#x}"
            )
        self._reg_spans.update(spans)

    def _deregister_native(self, addr: int, nbytes: int) -> None:
        self._deregister_native_many([(addr, nbytes)])

    def _deregister_native_many(self, spans) -> None:
        """One deregisterMem call; NIXL finds each descriptor among those registered."""
        self._agent.deregister_memory(self._agent.get_reg_descs(self._descs(spans), self._mem_type))
        self._reg_spans.subtract(spans)
        self._reg_spans = +self._reg_spans  # without the spans no longer registered

    def _descs(self, spans) -> list[tuple[int, int, int, str]]:
        return [(addr, nbytes, self.device_id, "") for addr, nbytes in spans]

    def _native_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _add_peer_native(self, peer: PeerInfo) -> Any:
        if peer.device_type not in _MEM_TYPE:
            raise TransferError(f"nixl: peer {peer.name!r} has unknown device {peer.device_type!r}")
        loaded = self._agent.add_remote_agent(peer.engine_blob)
        # add_remote_agent returns the name as bytes in nixl 1.5.
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != peer.name:
            raise TransferError(f"nixl: metadata for peer {peer.name!r} loaded agent {loaded!r}")
        # Connect now so the first write does not pay the UCX wire-up.
        self._agent.make_connection(peer.name)
        return _MEM_TYPE[peer.device_type]

    def _post(self, peer: PeerInfo, ops: np.ndarray) -> _NixlXfer:
        # transfer() copies a CMA write's bytes itself before it returns (GIL released):
        # 20-60 ms for a chunk's block, held off the rank loop by posting on the lane.
        xfer = _NixlXfer(ops=ops)
        if self.prepare_inline:  # hardware.posting = "loop": descriptors on this thread
            self._prepare(peer, xfer)
            self.prepared_inline += 1
        run = self._transfer  # the lane's CPU is the copy's (Mooncake's lanes only wait)
        if self.job_cpu is not None:
            run = self.job_cpu.wrap("write", run, int(ops[:, 2].sum()))
        self._on_lane(peer, xfer, run)
        return xfer

    def _transfer(self, peer: PeerInfo, xfer: _NixlXfer) -> None:
        """Post one batch and wait for it to finish (on its peer's lane)."""
        if xfer.handle is None:
            self._prepare(peer, xfer)
        state = self._agent.transfer(xfer.handle)  # raises e.g. NIXL_ERR_REMOTE_DISCONNECT
        pause = LANE_POLL_MIN_S
        while state == "PROC":  # an engine that moves the bytes in the background (RDMA)
            time.sleep(pause)
            pause = min(LANE_POLL_MAX_S, pause * 2)
            state = self._agent.check_xfer_state(xfer.handle)
        if state == "ERR":
            raise RuntimeError("the transfer ended in ERR")

    def _prepare(self, peer: PeerInfo, xfer: _NixlXfer) -> None:
        """The batch's descriptor lists and transfer request (xfer.handle)."""
        # One initialize_xfer over N descriptors. Measured here against
        # prep_xfer_dlist + make_prepped_xfer for 1024 x 64 KiB, 4096 x 512 B and
        # 16384 x 256 B: same transfer time, and creating the request was cheaper
        # (0.20 vs 0.32 ms, 0.35 vs 0.62 ms, 7.8 vs 10.5 ms). Prepped lists only pay off
        # when the same descriptor list is reused, which arbitrary ops are not.
        ops, xfer.ops = xfer.ops, None
        n = len(ops)
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0] = ops[:, 0]
        local[:, 1] = ops[:, 2]
        local[:, 2] = self.device_id
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0] = ops[:, 1]
        remote[:, 1] = ops[:, 2]
        remote[:, 2] = peer.device_id
        local_descs = self._agent.get_xfer_descs(local, self._mem_type)
        remote_descs = self._agent.get_xfer_descs(remote, peer.native)
        xfer.handle = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer.name)

    def _check(self, native: _NixlXfer) -> bool:
        return native.ended()

    def _release(self, native: _NixlXfer) -> None:
        if native.handle is not None:
            native.handle.release()

    def _close_native(self, in_flight: bool) -> None:
        if in_flight:
            return  # keep agent and registrations: UCX may still be writing
        for name in self.peers:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass  # the peer may be gone already; nothing to undo
        if self._reg_spans:
            self._deregister_native_many(list(self._reg_spans.elements()))
        del self._agent
