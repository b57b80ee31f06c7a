"""Control-plane messages between prefill and decode ranks, and their wire codec.

Messages are frozen dataclasses of ints, bools and at most one short string. On
the wire a message is ZMQ multipart frames:

    [b"KVS1:" + type tag, struct-packed ints/bools (network order), utf-8 string?]

`decode` validates everything (magic, tag, frame count, sizes, value ranges) and
raises only `ProtocolError`, so a peer's garbage can be logged and dropped by the
receiving driver without touching any state.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import ClassVar

MAGIC = b"KVS1:"
MAX_REASON_BYTES = 1024


class ProtocolError(ValueError):
    """A frame list that is not a valid kvstage message."""


# Upper bounds per field name, checked on decode (and on encode, so a bug cannot
# emit what the peer would reject). Lower bound is 0 for every int.
_LIMITS: dict[str, int] = {
    "room": 2**62,
    "chunk": 2**20,
    "num_pages": 2**31,
    "page_start": 2**31,
    "num_chunks": 2**20,
    "prefill_rank": 2**16,
    "writer": 2**16,
    "decode_rank": 2**16,
    "offset": 2**50,
    "end": 2**50,
    "tail": 2**50,
    "round": 2**62,
    "dst_page_base": 2**40,
    "checksum": 2**63,  # 63 bits of a keyed BLAKE2b digest (hw/control/keys.py `block_checksum`)
    "nonce": 2**63,  # a capability (shared/capability.py); 0: none
}


@dataclass(frozen=True, slots=True)
class StagingReq:
    """Prefill -> decode: reserve the staging region of one chunk (idempotent)."""

    TAG: ClassVar[bytes] = b"REQ"
    room: int
    chunk: int
    num_pages: int
    prefill_rank: int
    decode_rank: int


@dataclass(frozen=True, slots=True)
class StagingRsp:
    """Decode -> prefill: the chunk's region (or OVERSIZED: use the slice path).
    `nonce`: the grant's capability, which the writer's CHUNK_READY echoes."""

    TAG: ClassVar[bytes] = b"RSP"
    room: int
    chunk: int
    offset: int
    round: int
    end: int
    oversized: bool
    prefill_rank: int
    decode_rank: int
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class Watermark:
    """Decode -> prefill: regions up to (round, tail) are free to overwrite."""

    TAG: ClassVar[bytes] = b"WM"
    round: int
    tail: int
    prefill_rank: int
    decode_rank: int


@dataclass(frozen=True, slots=True)
class ChunkReady:
    """Prefill -> decode: this writer's block of the chunk has landed. `checksum`: with
    transfer.verify_writes = "checksum", the block's keyed checksum (0 otherwise, and in
    the simulator). `nonce`: the STAGING_RSP's grant nonce (on the slice path, the
    BOOTSTRAP's room nonce)."""

    TAG: ClassVar[bytes] = b"READY"
    room: int
    chunk: int
    page_start: int
    num_pages: int
    prefill_rank: int
    writer: int
    decode_rank: int
    checksum: int = 0
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class WriterDone:
    """Prefill -> decode: this writer has written all `num_chunks` chunks of the room.
    `nonce`: the room nonce of its BOOTSTRAP."""

    TAG: ClassVar[bytes] = b"DONE"
    room: int
    num_chunks: int
    prefill_rank: int
    writer: int
    decode_rank: int
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Decode -> prefill: the room exists at the decode; its KV pages start here.
    `nonce`: the room's capability for this writer (shared/capability.py)."""

    TAG: ClassVar[bytes] = b"BOOT"
    room: int
    dst_page_base: int
    prefill_rank: int
    decode_rank: int
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class Abort:
    """Either direction: the room failed at the sender; release what it holds.
    `nonce`: the room nonce of the writer (from the decode: what its BOOTSTRAP carried;
    from the writer: the echo, 0 if it never had one)."""

    TAG: ClassVar[bytes] = b"ABORT"
    room: int
    prefill_rank: int
    decode_rank: int
    reason: str
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class ReadyAck:
    """Decode -> prefill: this writer's CHUNK_READY of the chunk arrived. The writer
    re-sends CHUNK_READY until it has this; the decode acknowledges every copy."""

    TAG: ClassVar[bytes] = b"RACK"
    room: int
    chunk: int
    prefill_rank: int
    decode_rank: int


@dataclass(frozen=True, slots=True)
class DoneAck:
    """Decode -> prefill: this writer's WRITER_DONE arrived (re-sent until acknowledged)."""

    TAG: ClassVar[bytes] = b"DACK"
    room: int
    prefill_rank: int
    decode_rank: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either direction, between protocol messages: the sender is alive. Hardware
    ranks send it to every peer a few times a second; a peer silent for too long is
    declared lost (PeerLost), so its rooms fail while the others keep serving."""

    TAG: ClassVar[bytes] = b"BEAT"
    prefill_rank: int
    decode_rank: int
    from_decode: bool


Message = (
    StagingReq
    | StagingRsp
    | Watermark
    | ChunkReady
    | WriterDone
    | Bootstrap
    | Abort
    | ReadyAck
    | DoneAck
    | Heartbeat
)
MESSAGE_TYPES: tuple[type, ...] = (
    StagingReq,
    StagingRsp,
    Watermark,
    ChunkReady,
    WriterDone,
    Bootstrap,
    Abort,
    ReadyAck,
    DoneAck,
    Heartbeat,
)


@dataclass(frozen=True, slots=True)
class _Codec:
    cls: type
    int_fields: tuple[str, ...]  # ints and bools, in declaration order
    bool_fields: frozenset[str]
    str_field: str | None
    packer: struct.Struct


def _build_codec(cls: type) -> _Codec:
    ints: list[str] = []
    bools: set[str] = set()
    fmt = "!"
    str_field = None
    for f in dataclasses.fields(cls):
        if f.type in ("int", int):
            ints.append(f.name)
            fmt += "q"
        elif f.type in ("bool", bool):
            ints.append(f.name)
            bools.add(f.name)
            fmt += "?"
        elif f.type in ("str", str):
            assert str_field is None, "one string field per message"
            str_field = f.name
        else:  # pragma: no cover - a programming error caught at import
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {f.type}")
    return _Codec(cls, tuple(ints), frozenset(bools), str_field, struct.Struct(fmt))


_BY_TAG: dict[bytes, _Codec] = {MAGIC + c.TAG: _build_codec(c) for c in MESSAGE_TYPES}
_BY_CLS: dict[type, _Codec] = {c.cls: c for c in _BY_TAG.values()}


def _check_range(cls_name: str, name: str, value: object) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise ProtocolError(f"{cls_name}.{name} must be an int, got {type(value).__name__}")
    limit = _LIMITS.get(name, 2**62)
    if not 0 <= value < limit:
        raise ProtocolError(f"{cls_name}.{name}={value} out of range (allowed 0..{limit - 1})")


def encode(msg: Message) -> list[bytes]:
    """Message -> ZMQ multipart frames."""
    codec = _BY_CLS.get(type(msg))
    if codec is None:
        raise ProtocolError(f"not a kvstage message: {type(msg).__name__}")
    values = [getattr(msg, n) for n in codec.int_fields]
    for n, v in zip(codec.int_fields, values, strict=True):
        _check_range(codec.cls.__name__, n, v)
    frames = [MAGIC + codec.cls.TAG, codec.packer.pack(*values)]
    if codec.str_field is not None:
        frames.append(getattr(msg, codec.str_field).encode("utf-8")[:MAX_REASON_BYTES])
    return frames


def decode(frames: list[bytes]) -> Message:
    """ZMQ multipart frames -> message; any defect raises ProtocolError naming it."""
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # defence in depth: a peer must never crash a rank
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from None


def _decode(frames: list[bytes]) -> Message:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("empty frame list")
    frames = [bytes(f) for f in frames]
    tag = frames[0]
    codec = _BY_TAG.get(tag)
    if codec is None:
        shown = tag[:32]
        if not tag.startswith(MAGIC):
            raise ProtocolError(f"bad magic in first frame {shown!r} (expected {MAGIC!r}...)")
        allowed = ", ".join(c.TAG.decode() for c in MESSAGE_TYPES)
        raise ProtocolError(f"unknown message type {shown!r} (allowed: {allowed})")
    name = codec.cls.__name__
    want = 2 + (codec.str_field is not None)
    if len(frames) != want:
        raise ProtocolError(f"{name}: expected {want} frames, got {len(frames)}")
    if len(frames[1]) != codec.packer.size:
        raise ProtocolError(
            f"{name}: payload is {len(frames[1])} bytes, expected {codec.packer.size} (truncated?)"
        )
    values = codec.packer.unpack(frames[1])
    kwargs: dict[str, object] = {}
    for n, v in zip(codec.int_fields, values, strict=True):
        if n in codec.bool_fields:
            kwargs[n] = bool(v)
        else:
            _check_range(name, n, v)
            kwargs[n] = v
    if codec.str_field is not None:
        raw = frames[2]
        if len(raw) > MAX_REASON_BYTES:
            raise ProtocolError(
                f"{name}.{codec.str_field}: {len(raw)} bytes (max {MAX_REASON_BYTES})"
            )
        try:
            kwargs[codec.str_field] = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{name}.{codec.str_field}: not utf-8 ({exc.reason})") from None
    return codec.cls(**kwargs)
