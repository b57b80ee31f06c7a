"""Local events a driver feeds into the state machines, and the actions they return.

Messages from peers (shared.protocol) are events too. Every `handle(event, now)`
returns a list of actions; the driver carries them out (a SimPy process with a
modeled duration, or a ZMQ send / NIXL write / torch kernel) and reports their
completion back as the matching *Done event.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstage.shared.layout import HeadSlice
from kvstage.shared.protocol import Message
from kvstage.shared.request import Request
from kvstage.shared.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class Peer:
    """A rank as a destination: role is "prefill" or "decode"."""

    role: str
    rank: int


# --- events ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenRoom:
    """A request arrived at this rank. dst_page_base: decode KV pages reserved for it."""

    room: int
    prompt_tokens: int
    prefix_tokens: int = 0
    dst_page_base: int = 0


@dataclass(frozen=True, slots=True)
class ChunkComputed:
    """Prefill: the KV of this chunk exists in the local pool (start = forward start)."""

    room: int
    chunk: int
    start: float = -1.0


@dataclass(frozen=True, slots=True)
class GatherDone:
    room: int
    chunk: int
    decode_rank: int


@dataclass(frozen=True, slots=True)
class WriteDone:
    """A Write or SliceWrite finished; ok=False means the engine reported failure.
    `checksum`: the written block's keyed checksum (transfer.verify_writes), else 0."""

    room: int
    chunk: int
    decode_rank: int
    ok: bool = True
    error: str = ""
    checksum: int = 0


@dataclass(frozen=True, slots=True)
class ScatterDone:
    """A Scatter finished; `rejected` (non-empty): the region failed its write checksum,
    nothing of it was scattered."""

    room: int
    chunk: int
    rejected: str = ""


@dataclass(frozen=True, slots=True)
class SliceChecked:
    """A CheckSlice finished; `rejected` (non-empty): a block failed its write tag."""

    room: int
    chunk: int
    rejected: str = ""


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; lets the machine fire timeouts."""


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The driver's failure detector says a peer rank is gone (its incarnation for good).

    `incarnation`: which incarnation of the peer was lost (-1: whichever is current). A
    loss of an earlier incarnation than one that already rejoined is stale and ignored
    (the simulator's modeled detection of a rank that restarted before it fired)."""

    role: str
    rank: int
    reason: str = ""
    incarnation: int = -1


@dataclass(frozen=True, slots=True)
class PeerRejoined:
    """A lost peer rank was started again and rejoined the run as a new incarnation.

    Rooms from `first_room` on (room ids follow arrival order) are the new
    incarnation's to serve; rooms before it stay the lost incarnation's: those that
    already failed stay failed, and any still waiting for it fail as PeerLost fails
    them. The driver that delivers this chose `first_room` as the first room this
    rank had not yet seen arrive (`RankRuntime.next_room`), so every room that opens
    here from now on is one the new incarnation serves. A rejoin of an incarnation
    not newer than the last one known is stale and ignored.

    Only a prefill rank rejoins (the decode's machine takes this): a decode rank that
    restarted would bring an empty staging ring and KV pool, and its writers' views of
    its watermark would have to go back."""

    role: str
    rank: int
    incarnation: int
    first_room: int


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """Local abort of a room (user, fault injection)."""

    room: int
    reason: str


# --- events a rank runtime takes from its driver (shared/runtime.py) ------------


@dataclass(frozen=True, slots=True)
class Arrive:
    """A request of the workload reaches this rank (the driver keeps the clock)."""

    request: Request


@dataclass(frozen=True, slots=True)
class ForwardStarted:
    """The forward of a chunk began (a room opens when its first chunk starts)."""

    room: int
    chunk: int


@dataclass(frozen=True, slots=True)
class ForwardDone:
    """The forward of a chunk ended at `now`; it began at `start`."""

    room: int
    chunk: int
    start: float


@dataclass(frozen=True, slots=True)
class GenerateDone:
    """Decode: a room's generation ended at `now` (its last output token); it joined
    the instance's batch at `start` (a slot: its first token went to the client then).
    Its KV pages may then be reused."""

    room: int
    start: float


@dataclass(frozen=True, slots=True)
class VerifyDone:
    """Decode: the landed KV of a done room was checked."""

    room: int


Event = (
    Message
    | Arrive
    | ForwardStarted
    | ForwardDone
    | VerifyDone
    | GenerateDone
    | OpenRoom
    | ChunkComputed
    | GatherDone
    | WriteDone
    | ScatterDone
    | SliceChecked
    | Tick
    | AbortRoom
    | PeerLost
    | PeerRejoined
)


# --- actions --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    dest: Peer
    msg: Message


@dataclass(frozen=True, slots=True)
class Gather:
    """Prefill: copy the chunk's pages (heads `heads.src...`) into a contiguous block."""

    room: int
    chunk: int
    decode_rank: int
    writer: int
    src_page: int  # first page in the prompt (prefix pages + chunk page_start)
    num_pages: int
    heads: HeadSlice
    nbytes: int
    nonce: int = 0  # the grant's (STAGING_RSP): the key of the block's write tag


@dataclass(frozen=True, slots=True)
class Write:
    """Prefill: one bulk write of the gathered block to decode staging bytes [dst_offset, +nbytes)."""

    room: int
    chunk: int
    decode_rank: int
    writer: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SliceWrite:
    """Prefill: the slice path, `requests` small writes straight into the decode KV pool."""

    room: int
    chunk: int
    decode_rank: int
    writer: int
    src_page: int
    page_start: int  # chunk's first page relative to the room's transferred pages
    num_pages: int
    dst_page_base: int
    heads: HeadSlice
    requests: int
    nbytes: int
    nonce: int = 0  # what its CHUNK_READY echoes: the key of the block's write tag


@dataclass(frozen=True, slots=True)
class Scatter:
    """Decode: copy a chunk's staging region [offset, +nbytes) into the room's KV pages."""

    room: int
    chunk: int
    offset: int
    nbytes: int
    page_start: int
    num_pages: int
    dst_page_base: int
    # (writer, prefill rank, write tag, nonce) of each writer block, from its CHUNK_READY
    checksums: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CheckSlice:
    """Decode (hardware, transfer.verify_writes): check the writer blocks that the slice
    path wrote straight into the room's KV pages [dst_page_base + page_start,
    +num_pages) against their write tags, before the chunk counts as complete."""

    room: int
    chunk: int
    page_start: int
    num_pages: int
    dst_page_base: int
    checksums: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RoomDone:
    room: int


@dataclass(frozen=True, slots=True)
class RoomFailed:
    room: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseRoom:
    """Nothing of this room can touch this rank's memory any more: every write into
    it or read out of it finished, or every writer confirmed, or the grace passed.
    The room's KV pages may be reused."""

    room: int


@dataclass(frozen=True, slots=True)
class Record:
    record: TraceRecord


# --- actions a rank runtime gives its driver ------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Prefill: compute one chunk, in the order given, one at a time. The chunk's KV
    goes to local pages [first_page + page_start, + num_pages); num_pages == 0 is a
    room with nothing to compute (it only opens)."""

    room: int
    chunk: int
    first_page: int  # the room's first local page (prefix included)
    page_start: int  # the chunk's first page within the prompt (prefix included)
    num_pages: int
    tokens: int
    # of `tokens`, those in the prefill instance's cached prefix (shared/serving/prefix_cache.py):
    # their KV is read, not computed; the forward computes tokens - cached_tokens, after
    # a context of page_start * page_size + cached_tokens tokens
    cached_tokens: int = 0

    @property
    def computed(self) -> int:
        """The tokens this chunk computes: none where it only opens its room or all of it
        is in the prefix cache."""
        return self.tokens - self.cached_tokens if self.num_pages else 0

    def context(self, page_size: int) -> int:
        """The tokens before the computed ones, which they attend to."""
        return self.page_start * page_size + self.cached_tokens


@dataclass(frozen=True, slots=True)
class Verify:
    """Decode: check a done room's KV pages [first_page, + num_pages) bit for bit."""

    room: int
    first_page: int
    num_pages: int
    prefix_tokens: int


@dataclass(frozen=True, slots=True)
class Generate:
    """Decode: the room's KV is ready here; generate `output_tokens` tokens with the
    instance's continuous batch (`context_tokens` of KV per token to start with). With
    `local_tokens` (conditional disaggregation, `cluster.max_local_prefill_length`) the
    KV is not here yet: the instance prefills the prompt's last `local_tokens` tokens
    itself, in chunks mixed into its batch's steps, and the first token comes from the
    step that computes the last chunk."""

    room: int
    output_tokens: int
    context_tokens: int
    local_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Die:
    """Fault injection: this rank stops now, as if killed."""

    reason: str


Action = (
    Send
    | Gather
    | Write
    | SliceWrite
    | Scatter
    | RoomDone
    | RoomFailed
    | ReleaseRoom
    | Record
    | Forward
    | Verify
    | Generate
    | Die
)
