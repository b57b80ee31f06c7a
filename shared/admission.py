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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.shared.pages import decode_room_pages, prefill_room_pages
from kvstage.shared.workload import Request

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["Limits", "admit", "context_limits", "refusal"]


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
                f"a decode rank's KV pool ({limits.decode_pages} pages)"
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
