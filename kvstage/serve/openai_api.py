"""The OpenAI-compatible HTTP face of `kvstage serve` (aiohttp).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (streamed as
server-sent events when `stream` is true, else one JSON answer), `GET /v1/models`,
and the health probes engines answer (`/health`, `/health_generate`, `/v1/health`,
`/ping`: 200 while the server runs).

A request's prompt length is its tokens by the rule of kvstage/serve/tokenizer.py
(`prompt` text or texts, or token ids counted one each; for chat, the text of every
message's content, without a chat template). Its output length is `max_tokens`
(chat: `max_completion_tokens` or `max_tokens`) with ignore_eos semantics: exactly that
many tokens, whatever `ignore_eos` says; without it, the scenario's
`workload.output_tokens` when positive. One chunk per token, the first carrying the
chat role; the last says `finish_reason: "length"`; usage follows when
`stream_options.include_usage` asks, then `data: [DONE]`. Bad input gets a 400 (404
for another model) with an OpenAI-style error naming the field and what is allowed.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from kvstage.serve.realtime import RealtimeCluster
from kvstage.serve.timeline import Served
from kvstage.serve.tokenizer import OUTPUT_WORD, count_tokens
from kvstage.sim.online import RequestRefused

__all__ = ["BadRequest", "make_app"]

MAX_BODY = 64 << 20  # bytes of a request body (a 128k-token prompt of words is ~1 MB)


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    body = {"error": {"message": message, "type": kind, "code": status}, "object": "error"}
    return web.json_response(body, status=status)


def _text_tokens(value: Any, where: str) -> int:
    """Tokens of a prompt or content: text, a list of texts or parts, or token ids."""
    if isinstance(value, str):
        return count_tokens(value)
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return len(value)  # token ids
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += count_tokens(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += count_tokens(part["text"])
            else:
                raise BadRequest(f"{where}: a part that is not text ({type(part).__name__})")
        return total
    raise BadRequest(f"{where} must be text, a list of texts or token ids")


def _positive_int(body: dict, *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"{key} must be an integer >= 1, got {value!r}")
        return value
    return None


class OpenAIFace:
    """The handlers; `model` is the one name served."""

    def __init__(self, cluster: RealtimeCluster, model: str, default_output: int) -> None:
        self.cluster = cluster
        self.model = model
        self.default_output = default_output

    # --- parsing ---------------------------------------------------------------------
    def parse(self, body: Any, chat: bool) -> tuple[int, int]:
        """(prompt tokens, output tokens) of a request body, or BadRequest."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(f"model {model!r} is not served here (served: {self.model!r})", 404)
        if body.get("n", 1) != 1:
            raise BadRequest(f"n must be 1, got {body.get('n')!r}")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            prompt = 0
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or "content" not in m:
                    raise BadRequest(f"messages[{i}] must be an object with a content")
                prompt += _text_tokens(m["content"] or "", f"messages[{i}].content")
            output = _positive_int(body, "max_completion_tokens", "max_tokens")
        else:
            if "prompt" not in body:
                raise BadRequest("prompt is missing")
            p = body["prompt"]
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]  # a batch of one
            elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
                raise BadRequest(f"a batch of {len(p)} prompts; send one prompt per request")
            prompt = _text_tokens(p, "prompt")
            output = _positive_int(body, "max_tokens")
        if output is None:
            if self.default_output <= 0:
                raise BadRequest(
                    "max_tokens is missing and the scenario sets no workload.output_tokens"
                )
            output = self.default_output
        return max(1, prompt), output

    # --- handlers --------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, _request: web.Request) -> web.Response:
        entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "kvstage"}
        return web.json_response({"object": "list", "data": [entry]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("the body is not JSON", 400)
        try:
            prompt, output = self.parse(body, chat)
            served, queue = self.cluster.submit(request.path, prompt, output)
        except BadRequest as exc:
            return _error(str(exc), exc.status)
        except RequestRefused as exc:
            return _error(str(exc), 400)
        reply = _Reply(self.model, chat, served, body)
        try:
            if body.get("stream"):
                return await self._stream(request, reply, queue)
            for _ in range(output):
                _, sim_time = await queue.get()
                self.cluster.sent(served, sim_time)
            return web.json_response(reply.whole())
        except (ConnectionResetError, ConnectionError):
            self.cluster.abandon(served)
            raise

    async def _stream(self, request: web.Request, reply: _Reply, queue) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        served = reply.served
        for _ in range(served.output_tokens):
            k, sim_time = await queue.get()
            await resp.write(_sse(reply.chunk(k)))
            self.cluster.sent(served, sim_time)
        options = reply.body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            await resp.write(_sse(reply.usage_chunk()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Reply:
    """The OpenAI objects of one request's answer."""

    def __init__(self, model: str, chat: bool, served: Served, body: dict) -> None:
        self.model, self.chat, self.served, self.body = model, chat, served, body
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-kvstage-{served.room}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        s = self.served
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.output_tokens,
            "total_tokens": s.prompt_tokens + s.output_tokens,
        }

    def chunk(self, k: int) -> dict:
        text = OUTPUT_WORD if k == 1 else " " + OUTPUT_WORD
        finish = "length" if k == self.served.output_tokens else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if k == 1 else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}

    def whole(self) -> dict:
        text = " ".join([OUTPUT_WORD] * self.served.output_tokens)
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}


def make_app(face: OpenAIFace) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", face.completions)
    app.router.add_post("/v1/chat/completions", face.chat)
    app.router.add_get("/v1/models", face.models)
    for path in ("/health", "/health_generate", "/v1/health", "/ping"):
        app.router.add_get(path, face.health)
    return app
