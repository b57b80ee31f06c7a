"""Engine-neutral transport interface for hardware mode.

One abstract class, :class:`Transport`, moves bytes from this process's registered
memory into a peer's registered memory with one-sided WRITEs. The engine adapters
(``hw/transport/nixl.py``, ``hw/transport/mooncake.py``) only translate between this
interface and their engine's calls; everything that would otherwise be written twice
lives here, once:

- the metadata envelope (engine identity, agent name, device, region list, and the
  engine's own opaque blob),
- op validation: every local range must lie inside a region registered here and every
  remote range inside a region the peer advertised, checked before anything is posted,
  so a bad offset raises :class:`TransferError` and never writes outside,
- the bounded wait loop, handle bookkeeping, counters, and an orderly close.

A transport is owned by one thread; it is not safe to share one between threads.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import itertools
import json
import logging
import math
import os
import queue
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

    from kvstage.hw.transport.jobcpu import JobCpu

log = logging.getLogger("kvstage.hw.transport.base")

__all__ = [
    "BACKENDS",
    "EngineUnavailableError",
    "PeerInfo",
    "Region",
    "Transport",
    "TransferError",
    "XferHandle",
    "make_transport",
    "probe_engine",
]


class TransferError(RuntimeError):
    """A transfer could not be set up, posted, or completed.

    The message always says which engine, which peer (when there is one) and what
    failed, so a line in a rank's log is enough to act on.
    """


class EngineUnavailableError(ImportError):
    """The transfer engine's Python module cannot be imported on this machine."""


@dataclass(frozen=True)
class Region:
    """A registered local memory region: ``nbytes`` bytes starting at ``addr``."""

    addr: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


@dataclass
class PeerInfo:
    """What we know about a peer after :meth:`Transport.add_peer`."""

    name: str
    device_type: str  # "cpu" | "cuda"
    device_id: int
    regions: tuple[Region, ...]
    engine_blob: bytes  # the engine's own metadata, opaque to the base class
    index: _RegionIndex = field(repr=False)
    native: Any = field(default=None, repr=False)  # whatever the adapter keeps per peer


@dataclass(eq=False)
class XferHandle:
    """One posted batch of writes. Pass it to :meth:`Transport.poll` / ``wait``."""

    peer: str
    nops: int
    nbytes: int
    posted_at: float  # time.monotonic() when posted
    native: Any = field(default=None, repr=False)
    done: bool = False
    error: str | None = None
    owner: int = field(default=0, repr=False)  # id() of the transport that posted it
    #: [first, end) of the local bytes its ops read: deregister() refuses a region in it
    local_span: tuple[int, int] = field(default=(0, 0), repr=False)
    #: the registered regions its ops read, where the transport's regions are disjoint
    #: (None: any region in local_span counts), so that a region of one write can be taken
    #: off while another write reads regions on both sides of it (the slice path's spans)
    reads: frozenset[Region] | None = field(default=None, repr=False)


@dataclass(eq=False)
class LaneBatch:
    """A batch an adapter carries out on its peer's lane thread (Transport._on_lane):
    `event` is set when it ended, `error` says how it failed."""

    event: threading.Event = field(default_factory=threading.Event, repr=False)
    error: BaseException | None = None

    def ended(self) -> bool:
        """True once the lane finished it; raises what it failed with."""
        if not self.event.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(f"the engine raised {self.error!r}")
        return True


class _RegionIndex:
    """Containment test of many [addr, addr+n) ranges against a set of regions.

    Regions may overlap (two views of one tensor can both be registered), so they are
    merged into disjoint intervals first; a range is valid when it lies inside one
    merged interval. Vectorised with numpy because a KV chunk is posted as thousands of
    ops and this check sits on the write path.
    """

    def __init__(self, regions: Sequence[Region]) -> None:
        merged: list[list[int]] = []
        for r in sorted(regions, key=lambda r: r.addr):
            if merged and r.addr <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], r.end)
            else:
                merged.append([r.addr, r.end])
        self.starts = np.array([m[0] for m in merged], dtype=np.int64)
        self.ends = np.array([m[1] for m in merged], dtype=np.int64)
        self.ordered = tuple(sorted(regions, key=lambda r: r.addr))
        self.disjoint = all(a.end <= b.addr for a, b in itertools.pairwise(self.ordered))
        self.region_starts = np.array([r.addr for r in self.ordered], dtype=np.int64)

    def outside(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Indices of the ranges that are not inside any region."""
        if len(self.starts) == 0:
            return np.arange(len(addrs))
        slot = np.searchsorted(self.starts, addrs, side="right") - 1
        inside = slot >= 0
        safe = np.where(inside, slot, 0)
        inside &= addrs + nbytes <= self.ends[safe]
        return np.flatnonzero(~inside)

    def containing(self, addrs: np.ndarray, nbytes: np.ndarray) -> frozenset[Region] | None:
        """The regions that ranges inside them (outside() found none outside) lie in, when
        the regions are disjoint; None when they overlap, or a range runs across two that
        adjoin (it lies in more than one)."""
        if not self.disjoint or len(addrs) == 0:
            return None
        first = np.searchsorted(self.region_starts, addrs, side="right") - 1
        last = np.searchsorted(self.region_starts, addrs + nbytes - 1, side="right") - 1
        if (first != last).any():
            return None
        runs = first[np.flatnonzero(np.diff(first, prepend=-1))]  # ops come in address runs
        return frozenset(self.ordered[int(i)] for i in np.unique(runs))


# ---------------------------------------------------------------------------
# Metadata envelope: MAGIC | version u8 | header length u32 | JSON header | engine blob
# A JSON header keeps it debuggable (print it) and versioned; the engine blob rides
# behind it untouched.
# ---------------------------------------------------------------------------
_MAGIC = b"KVST"
_VERSION = 1
_PREFIX = struct.Struct("!4sBI")


def _pack_metadata(header: dict[str, Any], blob: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(_MAGIC, _VERSION, len(head)) + head + blob


def _unpack_metadata(data: bytes) -> tuple[dict[str, Any], bytes]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise ValueError(f"metadata too short ({len(data)} bytes)")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("metadata does not start with the kvstage envelope")
    if version != _VERSION:
        raise ValueError(f"metadata envelope version {version}, this build reads {_VERSION}")
    end = _PREFIX.size + hlen
    if len(data) < end:
        raise ValueError("metadata header truncated")
    header = json.loads(data[_PREFIX.size : end].decode())
    for key in ("engine", "agent", "device_type", "device_id", "regions"):
        if key not in header:
            raise ValueError(f"metadata header lacks {key!r}")
    return header, data[end:]


def _parse_device(device: str) -> tuple[str, int | None]:
    """'cpu' -> ('cpu', 0); 'cuda' -> ('cuda', None: current device); 'cuda:N' -> ('cuda', N)."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string, got {type(device).__name__}")
    text = device.strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", None
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise ValueError(f"unknown device {device!r}: allowed are 'cpu', 'cuda', 'cuda:N'")


def _as_ops(ops: Sequence[tuple[int, int, int]] | np.ndarray) -> np.ndarray:
    """Ops as an (N, 3) int64 array of (local_addr, remote_addr, nbytes)."""
    try:
        arr = np.asarray(ops, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            f"ops must be (local_addr, remote_addr, nbytes) integer triples: {e}"
        ) from e
    if arr.size == 0:
        return arr.reshape(0, 3)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(
            f"ops must be (local_addr, remote_addr, nbytes) triples, got shape {arr.shape}"
        )
    return arr


class Transport(abc.ABC):
    """One endpoint of a one-sided WRITE transport.

    Life cycle: ``register`` tensors -> ship ``metadata()`` to peers (any channel) ->
    peers ``add_peer`` it -> ``write`` / ``poll`` / ``wait`` -> ``close``. Metadata is a
    snapshot: a peer only sees regions registered before ``metadata()`` was called, so
    register everything first (or re-send and re-add after registering more).

    Adapters implement the ``_*`` hooks below and nothing else.
    """

    name: ClassVar[str] = "abstract"
    #: module whose import proves the engine is usable, e.g. "nixl._api"
    engine_module: ClassVar[str] = ""
    #: how to get the engine, quoted in the error when it is missing
    install_hint: ClassVar[str] = ""
    #: environment defaults applied (setdefault) before the engine is imported
    engine_env_defaults: ClassVar[dict[str, str]] = {}
    #: how long close() lets in-flight writes finish before giving up on them
    close_drain_s: ClassVar[float] = 10.0
    #: True when the adapter calls ``on_complete`` as a batch finishes (from its own
    #: thread): a caller may then sleep until woken instead of polling. Adapters that
    #: post through ``_on_lane`` do.
    signals_completion: ClassVar[bool] = False
    #: False when an engine thread may spin (never block): then it must not be raised
    #: above the rank's other threads (hw/rank/priority.py WritePriority)
    engine_threads_block: bool = True
    #: False when a lane's engine call busy-waits for its batch (same reason)
    lanes_block: ClassVar[bool] = True
    #: False when the engine's threads may be raised only together with the lanes (they
    #: share a lock: a raised thread would wait on, or spin for, a lane that cannot run)
    engine_alone: ClassVar[bool] = True
    #: False when a write the engine reports complete may not have landed in the peer's
    #: memory yet (its completion is the initiator's: the bytes handed to a socket);
    #: the decode then re-checks a block that fails its write tag before rejecting it
    #: (hw/rank/decode.py `_checked`)
    lands_on_completion: bool = True
    #: False when the engine reads a write's source without it being registered (Mooncake
    #: over TCP: a send from the address), so memory only written from is never given to
    #: the engine, which serves what is registered to any peer (register_many `source`)
    sources_on_engine: bool = True

    def __init__(self, agent_name: str, device: str = "cpu") -> None:
        if not isinstance(agent_name, str) or not agent_name.strip():
            raise ValueError("agent_name must be a non-empty string")
        self.agent_name = agent_name
        self.device_type, device_id = _parse_device(device)
        if device_id is None:
            device_id = self._current_cuda_device()
        self.device_id = device_id
        self.device = "cpu" if self.device_type == "cpu" else f"cuda:{device_id}"
        self._regions: list[Region] = []
        self._local_index = _RegionIndex(())
        # Strong references: the engine holds raw pointers, so the tensors must outlive
        # their registration (until close()).
        self._tensors: list[torch.Tensor] = []
        # the memory of regions taken off, kept until close (storage address -> storage):
        # an engine may still write there (deregister())
        self._retired: dict[int, Any] = {}
        self._off_engine: set[Region] = set()  # sources kvstage checks, the engine not given
        self._peers: dict[str, PeerInfo] = {}
        self._outstanding: dict[int, XferHandle] = {}
        self._closed = False
        #: ops (transfer requests) posted to the engine, for the trace
        self.requests_posted = 0
        #: batched posts (calls to write() that reached the engine)
        self.writes_posted = 0
        #: bytes posted
        self.bytes_posted = 0
        #: called (from an engine thread) when a batch finished, if the adapter
        #: `signals_completion`; must be thread-safe and quick
        self.on_complete: Callable[[], None] | None = None
        self._lanes: dict[str, queue.SimpleQueue] = {}  # peer -> FIFO of (batch, run)
        #: the rank's job CPU totals (hw/transport/jobcpu.py): an adapter whose lane copies the bytes
        #: itself (NIXL's CMA) counts each batch there as a "write" job
        self.job_cpu: JobCpu | None = None
        #: called on each lane thread as it starts (the rank sets its scheduling class)
        self.on_lane_start: Callable[[], None] | None = None
        #: a context each batch runs in on its lane (the rank: its scheduling class while
        #: the engine copies, hw/rank/priority.py WritePriority.lane_batch)
        self.lane_guard: Callable[[], contextlib.AbstractContextManager[Any]] | None = None

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _register_native(self, addr: int, nbytes: int) -> None:
        """Register [addr, addr+nbytes) on self.device with the engine."""

    @abc.abstractmethod
    def _deregister_native(self, addr: int, nbytes: int) -> None:
        """Take [addr, addr+nbytes), registered by _register_native, off the engine."""

    def _register_native_many(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register several (addr, nbytes) spans, all or none: one at a time unless the
        engine takes a list in one call (an adapter overrides this)."""
        done: list[tuple[int, int]] = []
        try:
            for addr, nbytes in spans:
                self._register_native(addr, nbytes)
                done.append((addr, nbytes))
        except BaseException:
            self._deregister_native_many(done)
            raise

    def _deregister_native_many(self, spans: Sequence[tuple[int, int]]) -> None:
        """Take several spans off the engine: one at a time unless the engine takes a list."""
        for addr, nbytes in spans:
            self._deregister_native(addr, nbytes)

    @abc.abstractmethod
    def _native_metadata(self) -> bytes:
        """The engine's own blob a peer needs to reach us (after registration)."""

    @abc.abstractmethod
    def _add_peer_native(self, peer: PeerInfo) -> Any:
        """Load a peer's engine blob; return what the adapter wants kept in peer.native."""

    @abc.abstractmethod
    def _post(self, peer: PeerInfo, ops: np.ndarray) -> Any:
        """Post all validated ops as ONE batch; return an engine handle. Raise on failure."""

    @abc.abstractmethod
    def _check(self, native: Any) -> bool:
        """True when the batch completed; False while in flight; raise on failure."""

    def _release(self, native: Any) -> None:  # noqa: B027 - optional hook
        """Free the engine handle of a finished batch (success or failure)."""

    def _idle(self, handle: XferHandle, seconds: float) -> None:
        """Pause between polls; a batch on a lane wakes it when it ends."""
        if isinstance(handle.native, LaneBatch):
            handle.native.event.wait(seconds)
        else:
            time.sleep(seconds)

    # --------------------------------------------------------------- lanes
    def _on_lane(
        self, peer: PeerInfo, batch: LaneBatch, run: Callable[[PeerInfo, Any], None]
    ) -> None:
        """Carry out `run(peer, batch)` on the peer's lane: one daemon thread per peer that
        takes its batches in order. An engine call that copies the bytes itself (NIXL's
        CMA) or blocks until the batch is done (Mooncake's status) then holds that thread,
        not the caller's loop; both release the GIL meanwhile."""
        lane = self._lanes.get(peer.name)
        if lane is None:
            lane = self._lanes[peer.name] = queue.SimpleQueue()
            threading.Thread(
                target=self._run_lane,
                args=(peer, lane),
                daemon=True,
                name=f"{self.name}-lane-{peer.name}",
            ).start()
        lane.put((batch, run))

    def _run_lane(self, peer: PeerInfo, lane: queue.SimpleQueue) -> None:
        if self.on_lane_start is not None:
            self.on_lane_start()
        while True:
            item = lane.get()
            if item is None:  # the transport closed
                return
            batch, run = item
            guard = self.lane_guard
            try:
                with guard() if guard is not None else contextlib.nullcontext():
                    run(peer, batch)
            except BaseException as e:  # surfaced by _check on the owner's thread
                batch.error = e
            finally:
                batch.event.set()
                wake = self.on_complete
                if wake is not None:
                    wake()

    @abc.abstractmethod
    def _close_native(self, in_flight: bool) -> None:
        """Tear the engine down. in_flight: some write never finished (do not free its memory)."""

    # --------------------------------------------------------------- engine import
    @classmethod
    def _import_engine(cls) -> ModuleType:
        """Import the engine module, or raise EngineUnavailableError saying how to get it."""
        for key, value in cls.engine_env_defaults.items():
            os.environ.setdefault(key, value)
        try:
            return importlib.import_module(cls.engine_module)
        except Exception as e:  # C extensions fail with ImportError, OSError, RuntimeError...
            raise EngineUnavailableError(
                f"{cls.name}: cannot import {cls.engine_module} ({type(e).__name__}: {e}); "
                f"install with: {cls.install_hint}"
            ) from e

    @staticmethod
    def _current_cuda_device() -> int:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        return int(torch.cuda.current_device())

    # ------------------------------------------------------------------ public API
    @property
    def regions(self) -> tuple[Region, ...]:
        """Local regions registered so far."""
        return tuple(self._regions)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def peer(self, peer_name: str) -> PeerInfo:
        """What add_peer learned about ``peer_name`` (its regions, device)."""
        return self._peer(peer_name)

    def register(self, tensor: torch.Tensor, *, source: bool = False) -> Region:
        """Register a contiguous tensor on this transport's device; keep it alive.
        `source`: memory only this transport's own writes read (register_many)."""
        return self.register_many([tensor], source=source)[0]

    def register_many(
        self, tensors: Sequence[torch.Tensor], *, source: bool = False
    ) -> list[Region]:
        """register() for several tensors, all or none, in one engine call where the
        engine has one (the slice path's runs of pages: hw/rank/prefill.py). With
        `source`, memory no peer needs to reach, only this transport's writes read (a
        send block, a slice write's pages): the engine is given it only where it needs it
        (`sources_on_engine`); write() checks ops against it either way."""
        self._check_open()
        regions = [self._region_of(t) for t in tensors]
        try:
            if source and not self.sources_on_engine:
                self._off_engine.update(regions)
            else:
                self._register_native_many([(r.addr, r.nbytes) for r in regions])
        except TransferError:
            raise
        except Exception as e:
            what = f"{sum(r.nbytes for r in regions)} B in {len(regions)} region(s)"
            if len(regions) == 1:
                what = f"{regions[0].nbytes} B at {regions[0].addr:#x}"
            raise TransferError(
                f"{self.name}: agent {self.agent_name!r} failed to register {what} on "
                f"{self.device}: {e}"
            ) from e
        self._tensors.extend(tensors)
        self._regions.extend(regions)
        self._local_index = _RegionIndex(self._regions)
        return regions

    def _region_of(self, tensor: torch.Tensor) -> Region:
        """The region of a tensor register() may take, or ValueError naming what is wrong."""
        if not tensor.is_contiguous():
            raise ValueError(f"{self.name}: only contiguous tensors can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= 0:
            raise ValueError(f"{self.name}: cannot register an empty tensor")
        dev = tensor.device
        if dev.type != self.device_type or (dev.type == "cuda" and dev.index != self.device_id):
            raise ValueError(
                f"{self.name}: tensor on {dev} cannot be registered by a transport on {self.device}"
            )
        return Region(int(tensor.data_ptr()), int(nbytes))

    def deregister(self, region: Region) -> None:
        """Take a region that register() returned off the engine again: no peer reaches
        it through the engine any more, and no write may read from it. Refused while a
        posted write still reads from it (wait for it first): the engine would read
        memory it no longer holds. The tensor's memory stays allocated until close():
        an engine may still write into it, as Mooncake over TCP does with a request whose
        header it accepted before (docs/results/2026-12-04-mooncake-inflight.md), and
        freed memory is whatever the process puts there next."""
        self.deregister_many([region])

    def deregister_many(self, regions: Sequence[Region]) -> None:
        """deregister() for several regions, all or none, in one engine call where the
        engine has one."""
        self._check_open()
        gone = Counter(regions)
        have = Counter(self._regions)
        missing = [r for r, n in gone.items() if have[r] < n]
        if missing:
            raise ValueError(
                f"{self.name}: {missing[0]} is not registered by agent {self.agent_name!r}; "
                f"allowed: a region register() returned and not yet deregistered "
                f"({len(self._regions)} registered)"
            )
        for region in gone:
            busy = [
                h
                for h in self._outstanding.values()
                if h.local_span[0] < region.end
                and region.addr < h.local_span[1]
                and (h.reads is None or region in h.reads)
            ]
            if busy:
                raise TransferError(
                    f"{self.name}: cannot deregister {region.nbytes} B at {region.addr:#x}: "
                    f"{len(busy)} posted write(s) to {sorted({h.peer for h in busy})} still "
                    f"read from it (wait for them first)"
                )
        try:
            on = [(r.addr, r.nbytes) for r in regions if r not in self._off_engine]
            if on:
                self._deregister_native_many(on)
        except Exception as e:
            what = f"{len(regions)} region(s)" if len(regions) > 1 else f"{regions[0].nbytes} B"
            raise TransferError(
                f"{self.name}: agent {self.agent_name!r} failed to deregister {what} "
                f"at {regions[0].addr:#x}: {e}"
            ) from e
        keep = []
        for region, tensor in zip(self._regions, self._tensors, strict=True):
            if gone[region]:
                gone[region] -= 1
                if region not in self._off_engine:  # what the engine never had it cannot write
                    storage = tensor.untyped_storage()  # views of one buffer: kept once
                    self._retired.setdefault(storage.data_ptr(), storage)
            else:
                keep.append((region, tensor))
        self._regions = [r for r, _ in keep]
        self._tensors = [t for _, t in keep]
        self._off_engine.intersection_update(self._regions)
        self._local_index = _RegionIndex(self._regions)

    def used(self) -> dict[str, Any]:
        """What this engine chose to move the bytes (hw/transport/used.py), for the report."""
        return {"source": "not recorded by this engine"}

    def metadata(self) -> bytes:
        """Everything a peer needs to write into the regions registered so far."""
        self._check_open()
        header = {
            "engine": self.name,
            "agent": self.agent_name,
            "device_type": self.device_type,
            "device_id": self.device_id,
            "regions": [[r.addr, r.nbytes] for r in self._regions if r not in self._off_engine],
        }
        return _pack_metadata(header, self._native_metadata())

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        """Learn a peer from its metadata(). Adding the same peer again refreshes it."""
        self._check_open()
        try:
            header, blob = _unpack_metadata(metadata)
            regions = tuple(Region(int(a), int(n)) for a, n in header["regions"])
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise TransferError(
                f"{self.name}: metadata for peer {peer_name!r} is malformed: {e}"
            ) from e
        if header["engine"] != self.name:
            raise TransferError(
                f"{self.name}: metadata for peer {peer_name!r} comes from engine "
                f"{header['engine']!r}; both ends must use the same backend"
            )
        if header["agent"] != peer_name:
            # The name is the engine's identity of the peer (NIXL routes by it), so a
            # mismatch is a wiring bug: metadata of one rank handed in for another.
            raise TransferError(
                f"{self.name}: metadata handed in for peer {peer_name!r} belongs to agent "
                f"{header['agent']!r}"
            )
        if header["agent"] == self.agent_name:
            raise TransferError(f"{self.name}: peer {peer_name!r} has this agent's own name")
        info = PeerInfo(
            name=peer_name,
            device_type=str(header["device_type"]),
            device_id=int(header["device_id"]),
            regions=regions,
            engine_blob=blob,
            index=_RegionIndex(regions),
        )
        try:
            info.native = self._add_peer_native(info)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{self.name}: cannot add peer {peer_name!r}: {e}") from e
        self._peers[peer_name] = info

    def write(self, peer_name: str, ops: Sequence[tuple[int, int, int]] | np.ndarray) -> XferHandle:
        """Post all ops (local_addr, remote_addr, nbytes) to one peer as ONE batch.

        Returns at once; completion is observed with poll()/wait(). Every range is
        checked first: nothing is posted if any op falls outside a registered region.
        """
        self._check_open()
        peer = self._peer(peer_name)
        try:
            arr = _as_ops(ops)
        except ValueError as e:
            raise TransferError(f"{self.name}: write to peer {peer_name!r}: {e}") from e
        self._validate(peer, arr)
        nbytes = int(arr[:, 2].sum()) if len(arr) else 0
        handle = XferHandle(peer_name, len(arr), nbytes, time.monotonic(), owner=id(self))
        if len(arr) == 0:
            handle.done = True  # nothing to move; no engine round trip
            return handle
        handle.local_span = (int(arr[:, 0].min()), int((arr[:, 0] + arr[:, 2]).max()))
        handle.reads = self._local_index.containing(arr[:, 0], arr[:, 2])
        try:
            handle.native = self._post(peer, arr)
        except Exception as e:
            raise TransferError(
                f"{self.name}: posting {len(arr)} op(s), {nbytes} B to peer {peer_name!r} failed: {e}"
            ) from e
        self.requests_posted += len(arr)
        self.writes_posted += 1
        self.bytes_posted += nbytes
        self._outstanding[id(handle)] = handle
        return handle

    def poll(self, handle: XferHandle) -> bool:
        """True when the batch is done; raises TransferError if it failed."""
        if handle.owner != id(self):
            raise TransferError(f"{self.name}: handle was not posted by agent {self.agent_name!r}")
        if handle.error is not None:
            raise TransferError(handle.error)
        if handle.done:
            return True
        try:
            finished = self._check(handle.native)
        except Exception as e:
            handle.error = (
                f"{self.name}: write of {handle.nops} op(s), {handle.nbytes} B to peer "
                f"{handle.peer!r} failed: {e}"
            )
            self._finish(handle)
            raise TransferError(handle.error) from e
        if finished:
            handle.done = True
            self._finish(handle)
        return finished

    def wait(self, handle: XferHandle, timeout_s: float, what: str = "") -> None:
        """Block until the batch is done, at most timeout_s seconds.

        On timeout the batch stays posted (poll it again, or close()); the error names
        ``what`` so the log says which chunk or phase hung.
        """
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        delay = 0.0
        while not self.poll(handle):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                label = what or "write"
                raise TransferError(
                    f"{self.name}: timed out after {timeout_s:g} s waiting for {label} "
                    f"({handle.nops} op(s), {handle.nbytes} B) to peer {handle.peer!r}"
                )
            # Spin briefly (small batches finish in microseconds), then back off to 1 ms
            # so a long transfer does not burn a core the engine may need.
            delay = min(max(delay * 2, 2e-5), 1e-3)
            self._idle(handle, min(delay, remaining))

    def close(self) -> None:
        """Let in-flight writes finish (bounded), then release the engine. Idempotent."""
        if self._closed:
            return
        stuck = False
        for handle in list(self._outstanding.values()):
            try:
                self.wait(handle, self.close_drain_s, "in-flight write at close")
            except TransferError as e:
                stuck = stuck or not (handle.done or handle.error)
                log.warning("%s", e)
        self._closed = True
        for lane in self._lanes.values():
            lane.put(None)  # each lane thread ends once its batches are done
        try:
            self._close_native(in_flight=stuck)
        finally:
            if stuck:
                # The engine may still touch these buffers: keep them alive for good
                # rather than hand freed memory to a DMA in progress.
                log.warning(
                    "%s: leaking registered memory of %r: a write never finished",
                    self.name,
                    self.agent_name,
                )
            else:
                self._tensors.clear()
                self._retired.clear()
            self._peers.clear()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.agent_name!r} on {self.device}, "
            f"{len(self._regions)} region(s), {len(self._peers)} peer(s)>"
        )

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: transport {self.agent_name!r} is closed")

    def _peer(self, peer_name: str) -> PeerInfo:
        try:
            return self._peers[peer_name]
        except KeyError:
            raise TransferError(
                f"{self.name}: unknown peer {peer_name!r} for agent {self.agent_name!r} "
                f"(add_peer it first; known: {sorted(self._peers)})"
            ) from None

    def _validate(self, peer: PeerInfo, ops: np.ndarray) -> None:
        if len(ops) == 0:
            return
        bad = np.flatnonzero((ops[:, 2] <= 0) | (ops[:, 0] < 0) | (ops[:, 1] < 0))
        if len(bad):
            i = int(bad[0])
            raise TransferError(
                f"{self.name}: write to peer {peer.name!r}: op {i} {tuple(int(x) for x in ops[i])} "
                f"has a negative address or a non-positive length"
            )
        bad = self._local_index.outside(ops[:, 0], ops[:, 2])
        if len(bad):
            i = int(bad[0])
            raise TransferError(
                f"{self.name}: write to peer {peer.name!r}: op {i} local range "
                f"[{int(ops[i, 0]):#x}, +{int(ops[i, 2])}) is outside the regions registered by "
                f"{self.agent_name!r} ({len(bad)} bad op(s) of {len(ops)}; nothing posted)"
            )
        bad = peer.index.outside(ops[:, 1], ops[:, 2])
        if len(bad):
            i = int(bad[0])
            raise TransferError(
                f"{self.name}: write to peer {peer.name!r}: op {i} remote range "
                f"[{int(ops[i, 1]):#x}, +{int(ops[i, 2])}) is outside the {len(peer.regions)} "
                f"region(s) the peer registered ({len(bad)} bad op(s) of {len(ops)}; nothing posted)"
            )

    def _finish(self, handle: XferHandle) -> None:
        self._outstanding.pop(id(handle), None)
        native, handle.native = handle.native, None
        if native is not None:
            try:
                self._release(native)
            except Exception as e:  # a leak, not a failed transfer
                log.warning("%s: releasing a finished transfer handle failed: %s", self.name, e)


# ---------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------
#: backend name -> (adapter module, class). Adapters import their engine lazily, so
#: importing them is cheap and never fails for a missing engine.
BACKENDS: dict[str, tuple[str, str]] = {
    "mooncake": ("kvstage.hw.transport.mooncake", "MooncakeTransport"),
    "nixl": ("kvstage.hw.transport.nixl", "NixlTransport"),
}


def _adapter_class(backend: str) -> type[Transport]:
    key = backend.strip().lower() if isinstance(backend, str) else backend
    if key not in BACKENDS:
        allowed = ", ".join(repr(b) for b in sorted(BACKENDS))
        raise ValueError(f"unknown transport backend {backend!r}: allowed are {allowed}")
    module, cls = BACKENDS[key]
    return getattr(importlib.import_module(module), cls)


def make_transport(backend: str, agent_name: str, device: str = "cpu", **options: Any) -> Transport:
    """Create the transport for ``backend`` ('nixl' or 'mooncake').

    Raises ValueError for an unknown backend (naming the allowed ones) and
    EngineUnavailableError (an ImportError) when the engine is not installed.
    ``options`` go to the adapter (e.g. mooncake: protocol="rdma", host=...).
    """
    return _adapter_class(backend)(agent_name, device, **options)


def probe_engine(backend: str) -> str | None:
    """None when the backend's engine imports here; otherwise the reason it does not."""
    cls = _adapter_class(backend)
    try:
        cls._import_engine()
    except EngineUnavailableError as e:
        return str(e)
    return None
