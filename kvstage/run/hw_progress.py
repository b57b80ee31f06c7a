"""What `kvstage hw` shows while its ranks run: ranks registered, rooms ended of the
total, elapsed time.

The launcher hands a `RunProgress` (hw/launch/launcher.py) about ten times a second; the rooms
come from the ranks' alive beats to the rendezvous (each says how many rooms of its own
workload ended, done or failed). A room has ended for the run when every decode rank of
its instance ended it, so the figure is, per decode instance, the least of its ranks'
counts, summed over instances: it never runs ahead of the run.

On a terminal it is a live bar; elsewhere (CI logs, pipes) a line when every rank has
registered and one each time another quarter of the rooms ended, so a log shows where a
run stood when it stopped.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstage.hw.launch.launcher import RunProgress


def rooms_ended(rooms: dict[str, tuple[int, int]], decode_tp: int) -> tuple[int, int] | None:
    """(rooms ended, rooms) over the decode instances, from the decode ranks' counts;
    None until every decode rank of some instance has spoken."""
    by_instance: dict[int, list[tuple[int, int]]] = {}
    for name, counts in rooms.items():
        if name.startswith("decode"):
            by_instance.setdefault(int(name[len("decode") :]) // decode_tp, []).append(counts)
    full = [counts for counts in by_instance.values() if len(counts) == decode_tp]
    if not full:
        return None
    return sum(min(c[0] for c in counts) for counts in full), sum(
        max(c[1] for c in counts) for counts in full
    )


class HwProgress:
    """Callable for `launch(on_progress=...)`; use as a context manager around the run."""

    def __init__(self, console: Console, decode_tp: int, total_rooms: int) -> None:
        self.console = console
        self.decode_tp = decode_tp
        self.total = total_rooms
        self.live = console.is_terminal
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task("ranks registering", total=total_rooms)
        self._said_started = False
        self._quarter = 0

    def __enter__(self) -> HwProgress:
        if self.live:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.bar.stop()

    def __call__(self, p: RunProgress) -> None:
        ended = rooms_ended(p.rooms, self.decode_tp) if p.started else None
        done = ended[0] if ended else 0
        if not p.started:
            what = f"ranks registered {p.registered}/{p.expected}"
        else:
            what = f"rooms ended (all {p.expected} ranks up" + (
                f", {p.reported} reported)" if p.reported else ")"
            )
        if self.live:
            self.bar.update(self.task, description=what, completed=done)
            return
        if p.started and not self._said_started:
            self._said_started = True
            self.console.print(
                f"hw: all {p.expected} ranks registered after {p.elapsed_s:.1f}s; "
                f"{self.total} rooms to run",
                highlight=False,
            )
        quarter = 4 * done // self.total if self.total else 0
        if quarter > self._quarter:
            self._quarter = quarter
            self.console.print(
                f"hw: rooms ended {done}/{self.total} after {p.elapsed_s:.1f}s", highlight=False
            )
