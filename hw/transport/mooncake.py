"""Mooncake adapter: P2PHANDSHAKE (no etcd), protocol "tcp" on CPU, "rdma" when asked.

Thin on purpose: envelope, validation, waiting and counters live in hw/transport/base.py.

Posting and completion. ``batch_transfer_async_write`` submits the whole batch to the
engine and returns at once, so a write is really posted when write() returns. Its
companion ``get_batch_transfer_status`` is not a poll: it blocks (GIL released) until
the batch completes, fails, or the engine's own timeout (MC_TRANSFER_TIMEOUT, 30 s, plus
1 ns per byte) runs out. So each batch gets a small daemon thread that makes that one
blocking call and sets an event; poll() reads the event. Measured here, async + waiter
and batch_transfer_sync_write in a thread move bytes at the same speed; the async form
keeps submission errors on the caller's thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvstage.hw.transport.base import LaneBatch, PeerInfo, TransferError, Transport
from kvstage.hw.transport.placement import ENGINE_LOG_LEVELS
from kvstage.hw.transport.used import mooncake_used

# batch_transfer_async_write answers 0 when it could not submit (e.g. the peer did not
# answer the handshake); the C++ code can also return (uint64)-1. Neither is a batch.
_BAD_BATCH_IDS = (0, -1, 2**64 - 1)
_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"


# Ops per posted sub-batch (see MooncakeTransport._post).
SUB_BATCH = 4096


@dataclass(eq=False)
class _McBatch(LaneBatch):
    batch_id: int = 0
    rest: list = field(default_factory=list)  # sub-batches, posted one after another
    rc: int | None = None


class MooncakeTransport(Transport):
    name: ClassVar[str] = "mooncake"
    signals_completion: ClassVar[bool] = True  # the lane thread finishes every batch
    # get_batch_transfer_status polls without sleeping (measured: a lane took a core for as
    # long as its batch ran), so a lane must not be raised above the engine's threads
    lanes_block: ClassVar[bool] = False
    engine_module: ClassVar[str] = "mooncake.engine"
    install_hint: ClassVar[str] = (
        'pip install "mooncake-transfer-engine-non-cuda==0.3.13.post1" (CPU; needs the '
        "Debian package libibverbs1) or mooncake-transfer-engine (CUDA)"
    )
    engine_env_defaults: ClassVar[dict[str, str]] = {
        "MC_LOG_LEVEL": ENGINE_LOG_LEVELS["MC_LOG_LEVEL"],
        # The TCP transport queues at most 1024 transfers per peer (+1024 waiting for
        # admission) and FAILS a larger batch outright; worse, the failure leaves the
        # connection to that peer unusable (every later batch fails too). A KV chunk
        # in slice mode is thousands of ops, so raise both to the engine's maximum.
        _QUEUE_ENV: "65535",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    }

    def __init__(
        self,
        agent_name: str,
        device: str = "cpu",
        *,
        protocol: str = "tcp",
        host: str = "127.0.0.1",
        device_name: str = "",
    ) -> None:
        super().__init__(agent_name, device)
        # Keep the TCP data path on the advertised address (loopback in tests).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        mod = self._import_engine()
        self.protocol = protocol
        # [C] Mooncake's TCP transport (kvcache-ai/Mooncake, tcp_transport.cpp,
        # ClientSession::writeBody): a write is COMPLETED once its last chunk is written
        # to the socket, with no word from the peer, whose server session copies the
        # bytes from its socket into the buffer afterwards. RDMA's completion comes
        # after the peer's NIC placed them.
        self.lands_on_completion = protocol != "tcp"
        # [M] over TCP the engine sends a write's source from its address, registered or
        # not (tests/test_transport.py: a write from memory never registered lands), and
        # serves registered memory to any peer that reaches its port: a source stays off
        # it. RDMA needs the source's memory key.
        self.sources_on_engine = protocol != "tcp"
        self._engine = mod.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"mooncake: agent {agent_name!r} could not initialize (host {host}, protocol "
                f"{protocol!r}, device {device_name!r}): initialize returned {rc}"
            )
        # Asked for RDMA without an HCA, the engine initializes anyway and serves TCP:
        # fail closed, naming what it found (hw/transport/used.py)
        self._used = mooncake_used(protocol, self._engine.get_local_topology())
        if protocol == "rdma" and not self._used["hcas"]:
            raise TransferError(
                f"mooncake: protocol rdma{f' on {device_name}' if device_name else ''}, but the engine found "
                f"0 HCAs on this host, so it would move the bytes over TCP; allowed: a host with an RDMA "
                f'NIC (see /sys/class/infiniband), or hardware.mooncake_protocol = "tcp"'
            )
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        # Refuse (before posting) a batch the TCP queue would reject, so one oversized
        # batch cannot poison the connection for the rest of the run.
        self._max_ops = int(os.environ.get(_QUEUE_ENV, "1024")) if protocol == "tcp" else None
        self._batches: list[_McBatch] = []

    def used(self) -> dict[str, Any]:
        return dict(self._used)

    def _register_native(self, addr: int, nbytes: int) -> None:
        self._register_native_many([(addr, nbytes)])

    def _deregister_native(self, addr: int, nbytes: int) -> None:
        self._deregister_native_many([(addr, nbytes)])

    def _register_native_many(self, spans) -> None:
        # "*" lets the engine find the memory's NUMA node; on GPU name the device.
        location = "*" if self.device_type == "cpu" else f"cuda:{self.device_id}"
        addrs, sizes = [a for a, _ in spans], [n for _, n in spans]
        rc = self._engine.batch_register_memory(addrs, sizes, location)
        if rc != 0:
            raise RuntimeError(f"batch_register_memory of {len(spans)} span(s) returned {rc}")

    def _deregister_native_many(self, spans) -> None:
        rc = self._engine.batch_unregister_memory([a for a, _ in spans])
        if rc != 0:
            raise RuntimeError(f"batch_unregister_memory of {len(spans)} span(s) returned {rc}")

    def _native_metadata(self) -> bytes:
        return self.session.encode()

    def _add_peer_native(self, peer: PeerInfo) -> Any:
        session = peer.engine_blob.decode(errors="replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"mooncake: peer {peer.name!r} has a bad session name {session!r}")
        return session  # the handshake happens on the first write

    def _post(self, peer: PeerInfo, ops: np.ndarray) -> _McBatch:
        if self._max_ops is not None and len(ops) > self._max_ops:
            raise RuntimeError(
                f"{len(ops)} ops exceed the TCP queue of {self._max_ops} per peer "
                f"({_QUEUE_ENV}); raise it or post smaller batches"
            )
        # Mooncake's TCP transport queues a bounded number of ops per peer and, once
        # that overflows, stays broken for that peer; several slice-path batches in
        # flight together overflow it. So every batch to a peer goes through one FIFO
        # lane per peer, cut into sub-batches of SUB_BATCH ops posted one at a time:
        # at most SUB_BATCH ops are ever queued at the engine per peer.
        parts = [ops[i : i + SUB_BATCH] for i in range(0, len(ops), SUB_BATCH)]
        batch = _McBatch(rest=parts)
        self._on_lane(peer, batch, self._run_batch)
        self._batches.append(batch)
        return batch

    def _post_part(self, peer: PeerInfo, ops: np.ndarray) -> int:
        batch_id = self._engine.batch_transfer_async_write(
            peer.native, ops[:, 0].tolist(), ops[:, 1].tolist(), ops[:, 2].tolist()
        )
        if batch_id in _BAD_BATCH_IDS:
            raise RuntimeError(
                f"batch_transfer_async_write to session {peer.native} was refused "
                f"(returned {batch_id}); is the peer alive?"
            )
        return batch_id

    def _run_batch(self, peer: PeerInfo, batch: _McBatch) -> None:
        """Post a batch's sub-batches one at a time, each waited for (on its lane)."""
        try:
            batch.rc = 0
            for part in batch.rest:
                batch.batch_id = self._post_part(peer, part)
                batch.rc = self._engine.get_batch_transfer_status([batch.batch_id])
                if batch.rc != 0:
                    break
        finally:
            batch.rest = []

    def _check(self, native: _McBatch) -> bool:
        if not native.ended():
            return False
        if native.rc != 0:
            raise RuntimeError(
                f"get_batch_transfer_status returned {native.rc} (the engine log has the cause; "
                "after a failed TCP batch the connection to this peer may stay unusable)"
            )
        return True

    def _release(self, native: _McBatch) -> None:
        if native in self._batches:
            self._batches.remove(native)

    def _close_native(self, in_flight: bool) -> None:
        if in_flight or any(not b.event.is_set() for b in self._batches):
            # A waiter thread is still inside the engine: destroying it now would crash
            # the process. Keep engine and registrations alive until exit.
            return
        for region in self.regions:
            self._engine.unregister_memory(region.addr)
        del self._engine
