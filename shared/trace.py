"""The trace record both modes write (docs/design.md, "The trace").

The state machines emit records themselves (as `Record` actions), timed with the
`now` their driver passes in, so a simulated and a measured run produce the same
rows by construction. Writers (Parquet / JSONL) live in the application; this
module only defines the row and its column types.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Phases, in the order a chunk meets them.
PHASES: tuple[str, ...] = (
    "room_open",  # room known at this rank; `chunk` holds the room's chunk count
    "req",  # STAGING_REQ sent (prefill) / received and answered (decode)
    "rsp",  # STAGING_RSP received (prefill)
    "compute",  # prefill forward of a chunk finished (start = forward start when known)
    "wm_wait",  # chunk computed and placed, waiting for the watermark
    "gather",  # prefill KV pool -> contiguous block
    "write",  # one bulk write of a writer block into the decode staging region
    "slice_write",  # the slice path: many small writes straight into the decode KV pool
    "chunk_ready",  # decode: all writers of a chunk arrived
    "scatter",  # decode staging region -> KV pool
    "free",  # decode freed a chunk's staging region
    "watermark",  # decode watermark moved (and was broadcast)
    "room_done",
    "room_failed",
    "dropped",  # a message ignored (late, unknown room, malformed, implausible)
    "resend",  # prefill: a CHUNK_READY or WRITER_DONE sent again (not acknowledged in time)
    "late_write",  # prefill: a write completed after its room's abort grace (a safety violation)
    "arrive",  # decode: a request arrived before its room opened (its KV pages did not fit
    # yet, or, with an [engine] preset, the serving stack's own path came first)
    "generate",  # decode: the room in the continuous batch (start: joined, its first token
    # out; end: its last token); `requests` holds the tokens generated
    "decode_step",  # decode (simulated generation): one step of an instance's batch, at its
    # first rank; `requests` holds the batch size
    "first_token",  # prefill (decode.first_token = "prefill"): the room's first token
    # streamed to the client at its last forward's end; a measured client's, role "client"
)


@dataclass(slots=True)
class TraceRecord:
    """One row: a span (start..end) or an instant (start == end) at one rank."""

    role: str  # "prefill" | "decode"
    rank: int
    phase: str
    start: float  # seconds from the run start (simulated or wall clock)
    end: float
    room: int = -1
    chunk: int = -1
    writer: int = -1  # writer index on the decode rank
    peer: int = -1  # the other side: decode rank for prefill rows, prefill rank for decode rows
    offset: int = -1  # staging ring byte offset (write / scatter / free), -1 when none
    bytes: int = 0
    requests: int = 0  # transfer requests issued by this row
    ring_used: int = (
        -1
    )  # decode: staging bytes reserved (handed out, not yet freed) after the event
    wm_round: int = -1  # watermark after the event (decode: its own; prefill: its view of `peer`)
    wm_tail: int = -1
    detail: str = ""  # reason of a failure, or a note


TRACE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TraceRecord))
# Column types for columnar writers: "str", "int" or "float". `mode` is added by
# the writer, since it is a property of the run, not of a row.
TRACE_TYPES: dict[str, str] = {
    f.name: {"str": "str", "int": "int", "float": "float"}[f.type] for f in fields(TraceRecord)
}
