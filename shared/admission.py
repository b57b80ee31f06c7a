"""Admission: the requests an engine refuses before it does any work, and why.

Pure: the limits come from outside (the model's context length from its preset or
`[model] context_tokens`; the KV pools' sizes in pages, from the serving model in a
simulation) and the requests are given. Both modes refuse the same requests with the
same reasons; a refused request never reaches a rank, is counted in summary.json
(`requests_rejected`, `rejected` per reason) and the run goes on.

What the engines do (docs/reference.md, "Requests an engine refuses"):
- **context.** SGLang's tokenizer manager (`_validate_one_request`) raises when the
  input is at least the model's context length, or when input + max_new_tokens is;
  vLLM's input processor (`_validate_prompt_len`) refuses a prompt of at least
  max_model_len and its OpenAI layer one whose max_tokens does not fit beside it. Both
  answer HTTP 400, which a benchmark client counts as a failed request. kvstage
  refuses `prompt >= context`, and `prompt + output >= context` when the output is
  known (SGLang's bound; vLLM's total bound is one token looser).
- **KV that can never fit.** SGLang's scheduler (`validate_input_length`, with
  max_req_input_len = min(context_len, max_total_num_tokens) - 6) aborts a request
  whose input is longer than the instance's KV pool (FINISH_ABORT, HTTP 400), on the
  prefill and on the decode instance alike. kvstage refuses a request whose pages
  (the decode's: transferred prompt plus output when generation is modeled; the
  prefill's: the whole prompt) outnumber a rank's KV pool, which otherwise would wait
  for pages forever.

And one rank's admission after that (`RankAdmission`): the requests that reached it
wait in arrival order until their KV pages fit its pool, the first that does not fit
holding the rest; a prefill matches each, as it is admitted, against its instance's
prefix cache. The pool's and the cache's sizes come from outside (the driver: the
serving model's numbers, or hardware mode's pool), so the rank runtime that uses it
(shared/runtime.py) imports neither the serving model nor the workload generator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.shared.pages import PageAllocator, PoolFullError, decode_room_pages, prefill_room_pages
from kvstage.shared.request import Request
from kvstage.shared.serving.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["Limits", "RankAdmission", "admit", "context_limits", "refusal"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What an instance admits: None is no limit."""

    page_size: int
    context_tokens: int | None = None  # the model's context length
    decode_pages: int | None = None  # one decode rank's KV pool
    prefill_pages: int | None = None  # one prefill rank's KV pool
    output_in_pages: bool = False  # the decode's pages also hold the output (generation)


def refusal(req: Request, limits: Limits) -> str | None:
    """Why an engine refuses `req` at admission, in one line, or None."""
    ctx = limits.context_tokens
    if ctx is not None:
        if req.prompt_tokens >= ctx:
            return (
                f"context: the prompt ({req.prompt_tokens} tokens) is not shorter than the "
                f"model's context length ({ctx} tokens)"
            )
        if req.output_tokens and req.prompt_tokens + req.output_tokens >= ctx:
            return (
                f"context: prompt + output ({req.prompt_tokens} + {req.output_tokens} tokens) "
                f"reach the model's context length ({ctx} tokens)"
            )
    page = limits.page_size
    if limits.decode_pages is not None:
        pages = decode_room_pages(req, page)
        if limits.output_in_pages:
            pages += -(-req.output_tokens // page)
        if pages > limits.decode_pages:
            return (
                f"KV pool: the request's KV ({pages} pages of {page} tokens) is larger than "
                f"a decode rank's KV pool ({limits.decode_pages} pages): "
                f"{pages * page} tokens of KV against {limits.decode_pages * page}"
            )
    if limits.prefill_pages is not None:
        pages = prefill_room_pages(req, page)
        if pages > limits.prefill_pages:
            return (
                f"KV pool: the prompt's KV ({pages} pages of {page} tokens) is larger than "
                f"a prefill rank's KV pool ({limits.prefill_pages} pages)"
            )
    return None


def admit(requests: Sequence[Request], limits: Limits) -> tuple[list[Request], dict[int, str]]:
    """The requests an engine takes, in order, and room -> reason for those it refuses."""
    taken: list[Request] = []
    refused: dict[int, str] = {}
    for req in requests:
        why = refusal(req, limits)
        if why is None:
            taken.append(req)
        else:
            refused[req.room] = why
    return taken, refused


def context_limits(scenario: Scenario) -> Limits:
    """What an instance admits when its KV pools hold any one request (hardware mode
    sizes them so, shared/pages.py `kv_pool_pages`): the model's context length only."""
    return Limits(page_size=scenario.decode.page_size, context_tokens=scenario.model.context_tokens)


class RankAdmission:
    """One rank's admission queue, its KV pages and (prefill) its prefix cache."""

    def __init__(
        self,
        role: str,
        page_size: int,
        *,
        kv_pages: int | None = None,
        cache_blocks: int = 0,
        output_in_pages: bool = False,
    ) -> None:
        """`kv_pages`: the rank's KV pool (None: not modeled, every room fits);
        `cache_blocks`: the prefix cache's capacity (a prefill's; 0: caches nothing);
        `output_in_pages`: a decode's pages also hold the output (generation)."""
        self.role = role
        self.page_size = page_size
        self.output_in_pages = output_in_pages
        self.pages = PageAllocator(kv_pages) if kv_pages is not None else None
        self.waiting: deque[Request] = deque()  # arrived, waiting for pages
        self.prefix_cache = PrefixCache(cache_blocks) if role == "prefill" else None

    def pages_needed(self, req: Request) -> int:
        """The KV pages a room holds here from admission on."""
        pages_of = prefill_room_pages if self.role == "prefill" else decode_room_pages
        n = pages_of(req, self.page_size)
        if self.output_in_pages:  # the output tokens' KV grows into pages taken now
            n += -(-req.output_tokens // self.page_size)
        return n

    def take(self) -> tuple[Request, int, int] | None:
        """The first waiting request, its first page and its page count, once its pages
        fit now; None while none waits or the first does not fit (it holds the rest)."""
        if not self.waiting:
            return None
        req = self.waiting[0]
        n = self.pages_needed(req)
        first = 0
        if n and self.pages is not None:
            try:
                first = self.pages.alloc(n)
            except PoolFullError:
                return None
        self.waiting.popleft()
        return req, first, n

    def cached_tokens(self, req: Request) -> int:
        """A prefill: the prompt tokens its prefix cache holds, the request's blocks
        inserted as most recently used (shared/serving/prefix_cache.py)."""
        assert self.prefix_cache is not None
        return self.prefix_cache.admit(req.hash_ids, req.prompt_tokens)

    def free(self, first_page: int, num_pages: int) -> None:
        if self.pages is not None and num_pages:
            self.pages.free(first_page, num_pages)

    @property
    def free_pages(self) -> int:
        """Free KV pages (0 when the pool is not modeled)."""
        return self.pages.free_pages if self.pages is not None else 0

    def holding(self, some) -> str | None:
        """What waits here, in words (`some` writes a few room ids), or None."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        pool = (
            f", {self.pages.free_pages} of {self.pages.num_pages} free"
            if self.pages is not None
            else ""
        )
        return (
            f"rooms {some(r.room for r in self.waiting)} waiting for KV pages (room "
            f"{head.room} first, needing {self.pages_needed(head)}{pool})"
        )
