"""Which prompt chunks share one prefill forward: the engines' prefill batch, as kvstage
packs it. One home for the rule: the simulator's group forward (sim/forward.py
`GroupForward`) and hardware mode's forward with `hardware.forward_delay`
(hw/rank/prefill.py `PrefillRank._packed`) pack the chunks waiting for them with
`OpenForward`, and the prefill capacity (shared/serving/capacity.py `prefill_work`,
which bottleneck, the plan's screen and the benchmarks share) packs a request mix with
`pack`, the same rule on the queue of a saturated instance.

How SGLang builds a prefill batch ([C] sgl-project/sglang at commit 00550cd,
python/sglang/srt/managers/scheduler.py `get_new_batch_prefill` (its body
`_get_new_batch_prefill_raw` in newer releases) and python/sglang/srt/managers/
schedule_policy.py `SchedulePolicy`, `PrefillAdder`):

- When the scheduler loop may run a prefill batch, it orders its waiting queue by the
  schedule policy (`--schedule-policy`): the default "fcfs" leaves the arrival order
  as it is; the cache-aware policies (lpm, dfs-weight) sort by prefix match, and fall
  back to fcfs without a radix cache or with more than 128 waiting requests.
- It makes a `PrefillAdder` with two compute budgets in tokens: `rem_chunk_tokens` =
  chunked_prefill_size and `rem_input_tokens` = max_prefill_tokens (server_args: 16,384
  by default).
- The request chunked in the previous batch (`self.chunked_req`) goes in first
  (`add_chunked_req`): its next chunk, up to the budget. So a chunked prompt's next
  chunk leads the next batch.
- Then the waiting requests, in queue order (`add_one_req`): a request whose tokens to
  compute (its input less its cached prefix) fit what is left of rem_chunk_tokens goes
  in whole; the first that does not is truncated to the rest of the budget, rounded
  down to whole pages, and becomes the chunked request (`new_chunked_req`), so at most
  one request is chunked and it is the last one added. After each request the adder
  stops once either budget is spent (`budget_state`), or when the KV pool cannot hold
  the next request.
- Each admission is charged its tokens rounded up to whole pages
  (`_update_prefill_budget`, `ceil_paged_tokens`).
- The batch is one forward (`ScheduleBatch.prepare_for_extend`): every request's new
  tokens through the matmuls together, each attending to its own prompt's KV. A PD
  prefill server's loop (python/sglang/srt/disaggregation/prefill.py) takes its batches
  from the same `get_new_batch_prefill`.

What kvstage takes from it. The rank runtime already cuts each prompt into chunks of
`Geometry.chunk_tokens` (chunked_prefill_size rounded down to whole pages) when it admits
the room (shared/runtime.py `_schedule_forwards`), so here only which waiting chunks share
a forward is decided:

- the waiting chunks in the runtime's order (rooms in arrival order, a room's chunks in
  order: fcfs), while their computed tokens (whole pages, less the prefill's cached
  prefix) fit `Geometry.chunk_tokens`; the first that does not fit opens the next
  forward. A full chunk runs alone; short prompts and a prompt's short last chunk pack.
  [A] SGLang would cut that first misfit to fill the budget, so where a long prompt
  follows short ones kvstage packs less than SGLang; with prompts shorter than a chunk
  it packs as SGLang does, but for the cut prompt at each batch's end;
- at most one chunk of a room in a forward (one request, one extend range a batch);
- a chunk with nothing to compute (all of it in the prefill's prefix cache, or a room
  that only opens) joins no forward and closes the one open;
- max_prefill_tokens is not a budget of its own: [A] it is at least
  chunked_prefill_size in the deployments priced here (both 16,384 in LMSYS's); the KV
  pool is the admission's (shared/admission.py: a room waits until its pages fit).

With pipeline stages (`prefill.pp` > 1) each packed forward goes through the stages as
one micro-batch ([C] SGLang's pipeline loop takes each micro-batch from
`get_next_batch_to_run`, so from the same adder: python/sglang/srt/managers/
scheduler_pp_mixin.py `event_loop_pp`). Left as they were: a scenario's `[engine]`
preset batches by its own budget
(sim/engine_host.py `EngineForward`); hardware mode without `forward_delay` fills one
chunk a forward (its real CPU time, as the cpu-loop host model's `HostFills`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["OpenForward", "pack"]


@dataclass(slots=True)
class OpenForward:
    """A forward being filled: the rule's state. `budget`: `Geometry.chunk_tokens`."""

    budget: int
    tokens: int = 0
    rooms: set[int] = field(default_factory=set)

    def takes(self, room: int, tokens: int) -> bool:
        """Whether a chunk of `room` computing `tokens` tokens joins this forward."""
        return tokens > 0 and room not in self.rooms and self.tokens + tokens <= self.budget

    def add(self, room: int, tokens: int) -> None:
        self.tokens += tokens
        self.rooms.add(room)


def pack(chunks: Iterable[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int]]]:
    """The forwards of a queue of chunks, each (room, tokens computed, context before
    them), in order, by the rule above: each forward's [(tokens, context)]. Chunks with
    nothing to compute take no forward (and close the one open)."""
    forwards: list[list[tuple[int, int]]] = []
    open_: OpenForward | None = None
    for room, tokens, context in chunks:
        if tokens <= 0:
            open_ = None
            continue
        if open_ is None or not open_.takes(room, tokens):
            open_ = OpenForward(budget)
            forwards.append([])
        open_.add(room, tokens)
        forwards[-1].append((tokens, context))
    return forwards
