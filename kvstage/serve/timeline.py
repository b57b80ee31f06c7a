"""One served request's timeline, and its figures as benchmark clients define them.

Times are simulated seconds (`kvstage serve` runs the simulated clock in real time, so
they are also seconds since the server started). The figures follow the clients
(SGLang's bench_serving, vLLM's `bench serve`, AIPerf, genai-bench):

- TTFT: arrival to the first output token;
- E2E: arrival to the last output token;
- TPOT: (E2E - TTFT) / (N - 1) over the N output tokens (none when N = 1);
- ITL: every gap between consecutive tokens (N - 1 of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Served", "client_figures"]


def client_figures(arrival_s: float, token_s: list[float]) -> dict[str, object]:
    """ttft_s, tpot_s (None for one token), e2e_s and itl_s of a request that arrived at
    `arrival_s` and got its tokens at `token_s` (ascending, at least one)."""
    ttft = token_s[0] - arrival_s
    e2e = token_s[-1] - arrival_s
    n = len(token_s)
    return {
        "ttft_s": ttft,
        "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else None,
        "e2e_s": e2e,
        "itl_s": [b - a for a, b in zip(token_s, token_s[1:], strict=False)],
    }


@dataclass
class Served:
    """A request as the server saw it: its room, what it asked for, when it arrived and
    when each token was produced (simulated seconds), and how late each token's chunk
    left the server against its simulated time (wall seconds: the server's own lag)."""

    room: int
    endpoint: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    token_s: list[float] = field(default_factory=list)
    sent_late_s: list[float] = field(default_factory=list)
    abandoned: bool = False  # the client went away before the last token

    @property
    def done(self) -> bool:
        return len(self.token_s) == self.output_tokens

    def row(self) -> dict[str, object]:
        """Its line of `served.jsonl`."""
        return {
            "room": self.room,
            "endpoint": self.endpoint,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "arrival_s": self.arrival_s,
            "token_s": self.token_s,
            **client_figures(self.arrival_s, self.token_s),
            "sent_late_s": self.sent_late_s,
            "abandoned": self.abandoned,
        }
