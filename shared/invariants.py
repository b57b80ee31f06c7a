"""The five invariants of docs/design.md, checked from trace records.

`InvariantChecker.observe(record)` runs live inside a driver (records arrive as
the machines emit them, roughly in time order, each at its span's end), and the
same class checks a finished run's trace. Violations carry the room, chunk, rank,
time and the records seen just before, so a report says where to look.

1. Safety: two chunks' data never occupy overlapping staging bytes of one decode
   rank at overlapping times (a chunk's data lives from its first write's start
   until its scatter ended, or its region was freed).
2. Exactly once: a chunk is scattered at most once, and every chunk of a room
   that finished is scattered (staging) or landed (slice).
3. No leak: at the end every decode ring is empty.
4. Liveness: every room that opened finished (done or failed with a reason); a rank
   that died is excused its open rooms (`finish(ignore_ranks=...)`, or `retire` when
   it starts again as a new incarnation).
5. Monotone watermark at every decode rank and in every prefill view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvstage.shared.trace import TraceRecord

CONTEXT_RECORDS = 12


class InvariantViolation(AssertionError):
    """Raised by `InvariantChecker.raise_if_violated`."""


@dataclass
class Violation:
    invariant: str  # "safety" | "exactly_once" | "no_leak" | "liveness" | "monotone_watermark"
    message: str
    time: float
    role: str = ""
    rank: int = -1
    room: int = -1
    chunk: int = -1
    context: list[TraceRecord] = field(default_factory=list)

    def format(self) -> str:
        head = (
            f"[{self.invariant}] t={self.time:.6f}s {self.role} rank {self.rank} "
            f"room {self.room} chunk {self.chunk}: {self.message}"
        )
        lines = [head]
        if self.context:
            lines.append("  records just before:")
            for r in self.context:
                lines.append(
                    f"    {r.end:.6f} {r.role}[{r.rank}] {r.phase} room={r.room} chunk={r.chunk} "
                    f"writer={r.writer} peer={r.peer} off={r.offset} bytes={r.bytes} {r.detail}"
                )
        return "\n".join(lines)


@dataclass
class _Data:
    lo: int
    hi: int
    born: float
    died: float | None = None


class InvariantChecker:
    def __init__(self, expect_path: str = "staging", clock_tolerance_s: float = 0.0) -> None:
        self.expect_path = expect_path
        # How far apart two ranks' clocks may be (hardware mode across hosts: the
        # uncertainty of the measured offsets). A prefill's write and a decode's scatter
        # or free compare times of two clocks; they are ordered only beyond this.
        self.clock_tolerance_s = clock_tolerance_s
        self.violations: list[Violation] = []
        self._recent: deque[TraceRecord] = deque(maxlen=CONTEXT_RECORDS)
        # per decode rank: (room, chunk) -> data ranges currently in staging
        self._live: dict[int, dict[tuple[int, int], list[_Data]]] = {}
        self._closed: dict[int, deque[tuple[tuple[int, int], _Data]]] = {}
        self._max_write = 0.0
        self._scattered: dict[tuple[int, int, int], int] = {}
        self._landed: dict[tuple[int, int], set[int]] = {}  # (decode, room) -> chunks complete
        self._open: dict[tuple[str, int, int], int] = {}  # (role, rank, room) -> chunk count
        self._wm: dict[tuple[str, int, int], tuple[int, int]] = {}
        self._ring_used: dict[int, int] = {}
        # per (decode rank, room, chunk): last write end, scatter span, free time
        self._write_end: dict[tuple[int, int, int], float] = {}
        self._scatter_span: dict[tuple[int, int, int], tuple[float, float]] = {}
        self._freed_at: dict[tuple[int, int, int], float] = {}
        self.records_seen = 0
        self._handlers = {
            "write": self._on_write,
            "scatter": self._on_scatter,
            "free": self._on_free,
            "chunk_ready": self._on_chunk_ready,
            "room_open": self._on_room_open,
            "room_done": self._on_room_end,
            "room_failed": self._on_room_end,
            "late_write": self._on_late_write,
        }

    # --- feeding ------------------------------------------------------------------------
    def observe(self, r: TraceRecord) -> None:
        self.records_seen += 1
        phase = r.phase
        # Most records (req, rsp, compute, gather, ...) need no handler: one dict lookup.
        handler = self._handlers.get(phase)
        if handler is not None:
            handler(r)
        if r.wm_round >= 0 and phase in ("watermark", "free", "wm_wait"):
            key = (r.role, r.rank, r.peer if r.role == "prefill" else -1)
            wm = (r.wm_round, r.wm_tail)
            prev = self._wm.get(key)
            if prev is not None and wm < prev and phase != "wm_wait":
                self._violate("monotone_watermark", f"watermark moved back from {prev} to {wm}", r)
            self._wm[key] = max(wm, prev) if prev else wm
        if r.role == "decode" and r.ring_used >= 0:
            self._ring_used[r.rank] = r.ring_used
        self._recent.append(r)

    def _on_late_write(self, r: TraceRecord) -> None:
        self._violate(
            "safety",
            f"a write of room {r.room} chunk {r.chunk} to decode rank {r.peer} completed after the abort "
            f"grace; the decode may have handed its region out again ({r.detail})",
            r,
        )

    def _on_chunk_ready(self, r: TraceRecord) -> None:
        if r.role == "decode" and self.expect_path == "slice":
            self._landed.setdefault((r.rank, r.room), set()).add(r.chunk)

    def _on_room_open(self, r: TraceRecord) -> None:
        self._open[(r.role, r.rank, r.room)] = r.chunk

    def _on_write(self, r: TraceRecord) -> None:
        d, key = r.peer, (r.room, r.chunk)
        lo, hi = r.offset, r.offset + r.bytes
        self._max_write = max(self._max_write, r.end - r.start)
        live = self._live.setdefault(d, {})
        for other, spans in live.items():
            if other == key:
                continue
            for s in spans:
                if s.lo < hi and lo < s.hi:
                    self._violate(
                        "safety",
                        f"write [{lo},{hi}) on decode rank {d} overlaps live data of room {other[0]} "
                        f"chunk {other[1]} [{s.lo},{s.hi}) not yet scattered",
                        r,
                    )
        closed = self._closed.setdefault(d, deque())
        while closed and closed[0][1].died < r.end - 2 * self._max_write - 1e-9:
            closed.popleft()
        for other, s in closed:
            if (
                other != key
                and s.died > r.start + self.clock_tolerance_s
                and s.lo < hi
                and lo < s.hi
            ):
                self._violate(
                    "safety",
                    f"write [{lo},{hi}) on decode rank {d} started at {r.start:.6f}s while data of "
                    f"room {other[0]} chunk {other[1]} [{s.lo},{s.hi}) lived until {s.died:.6f}s",
                    r,
                )
        live.setdefault(key, []).append(_Data(lo, hi, r.start))
        ck = (d, r.room, r.chunk)
        self._write_end[ck] = max(r.end, self._write_end.get(ck, r.end))
        span = self._scatter_span.get(ck)
        if span is not None and r.end > span[0]:
            self._violate(
                "exactly_once",
                f"writer {r.writer}'s block landed at {r.end:.6f}s, after the chunk's "
                f"scatter started at {span[0]:.6f}s: the scatter read incomplete data",
                r,
            )

    def _on_scatter(self, r: TraceRecord) -> None:
        key = (r.rank, r.room, r.chunk)
        n = self._scattered.get(key, 0) + 1
        self._scattered[key] = n
        if n > 1:
            self._violate("exactly_once", f"chunk scattered {n} times", r)
        self._landed.setdefault((r.rank, r.room), set()).add(r.chunk)
        self._close(r.rank, (r.room, r.chunk), r.end)
        self._scatter_span[key] = (r.start, r.end)
        written = self._write_end.get(key)
        if written is not None and written > r.start + self.clock_tolerance_s:
            self._violate(
                "exactly_once",
                f"scatter started at {r.start:.6f}s before the last block landed at {written:.6f}s",
                r,
            )
        freed = self._freed_at.get(key)
        if freed is not None and freed < r.end and freed >= r.start:
            self._violate(
                "safety",
                f"region freed at {freed:.6f}s while its scatter ran until {r.end:.6f}s",
                r,
            )

    def _on_free(self, r: TraceRecord) -> None:
        key = (r.rank, r.room, r.chunk)
        self._freed_at[key] = r.end
        span = self._scatter_span.get(key)
        if span is not None and span[0] <= r.end < span[1]:
            self._violate(
                "safety",
                f"region freed at {r.end:.6f}s while its scatter ran until {span[1]:.6f}s",
                r,
            )
        self._close(r.rank, (r.room, r.chunk), r.end)

    def _close(self, d: int, key: tuple[int, int], when: float) -> None:
        spans = self._live.get(d, {}).pop(key, None)
        if not spans:
            return
        closed = self._closed.setdefault(d, deque())
        for s in spans:
            s.died = when
            closed.append((key, s))

    def _on_room_end(self, r: TraceRecord) -> None:
        chunks = self._open.pop((r.role, r.rank, r.room), None)
        if r.role != "decode":
            return
        landed = self._landed.pop((r.rank, r.room), set())
        if r.phase == "room_done" and chunks is not None and len(landed) != chunks:
            missing = sorted(set(range(chunks)) - landed)[:8]
            self._violate("exactly_once", f"room done but chunks {missing} never scattered", r)
        # data of a failed room's chunks that were never scattered is dropped with its free
        for key in [
            k for k in self._live.get(r.rank, {}) if k[0] == r.room and r.phase == "room_done"
        ]:
            self._close(r.rank, key, r.end)

    def retire(self, role: str, rank: int) -> None:
        """A rank's incarnation died and the rank starts again as a new one: the rooms
        the dead incarnation left open are not its successor's to end (their peers fail
        them), so liveness no longer expects them of this rank. The successor's own
        rooms are tracked from its first record, as any rank's."""
        for key in [k for k in self._open if k[0] == role and k[1] == rank]:
            del self._open[key]

    # --- end of run ---------------------------------------------------------------------
    def finish(
        self,
        end_time: float,
        ring_used: dict[int, int] | None = None,
        ignore_ranks: set[tuple[str, int]] | frozenset = frozenset(),
    ) -> list[Violation]:
        """Close the run: rooms never ended, rings not empty. `ignore_ranks` are ranks
        that died (fault injection): their unfinished rooms and rings are not theirs to end."""
        for (role, rank, room), _ in sorted(self._open.items()):
            if (role, rank) in ignore_ranks:
                continue
            self.violations.append(
                Violation(
                    "liveness",
                    "room never finished (neither done nor failed)",
                    end_time,
                    role,
                    rank,
                    room,
                )
            )
        self._open.clear()
        used = dict(self._ring_used)
        used.update(ring_used or {})
        for d, u in sorted(used.items()):
            if u and ("decode", d) not in ignore_ranks:
                self.violations.append(
                    Violation(
                        "no_leak", f"staging ring holds {u} bytes at the end", end_time, "decode", d
                    )
                )
        return self.violations

    def _violate(self, invariant: str, message: str, r: TraceRecord) -> None:
        self.violations.append(
            Violation(
                invariant, message, r.end, r.role, r.rank, r.room, r.chunk, list(self._recent)
            )
        )

    def report(self, limit: int = 20) -> str:
        lines = [v.format() for v in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"... and {len(self.violations) - limit} more")
        return "\n".join(lines)

    def raise_if_violated(self) -> None:
        if self.violations:
            raise InvariantViolation(
                f"{len(self.violations)} invariant violation(s):\n{self.report()}"
            )


def check_records(
    records,
    expect_path: str = "staging",
    clock_tolerance_s: float = 0.0,
    missing: set[tuple[str, int]] | frozenset = frozenset(),
) -> list[Violation]:
    """Check a complete trace (sorted by end time) and return every violation.
    `clock_tolerance_s`: how far apart the ranks' clocks may be (0: one clock).
    `missing`: (role, rank) of ranks whose records are lost (hardware mode: a rank that
    died sends no report). Everything the others recorded is checked, except what
    needs the lost records to be judged: writes into a lost decode rank's ring (its
    scatters and frees, which end their data, are gone), and the lost ranks' own open
    rooms and rings at the end."""
    checker = InvariantChecker(expect_path, clock_tolerance_s)
    lost_decodes = {rank for role, rank in missing if role == "decode"}
    end = 0.0
    for r in sorted(records, key=lambda x: (x.end, x.start)):
        if r.phase in ("write", "late_write") and r.role == "prefill" and r.peer in lost_decodes:
            continue
        checker.observe(r)
        end = max(end, r.end)
    return checker.finish(end, ignore_ranks=missing)
