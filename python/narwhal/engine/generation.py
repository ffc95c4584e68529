"""What one generation is made of: its sampling, its request, and its text as it grows.

`Request` is handed from the event loop to the decode loop (`engine.batch`); `TextStream`
turns that request's sampled tokens into `Piece`s (token IDs, text, optional logprobs) in
groups of `stream_interval` tokens. Stop strings are matched on text with the same holdback
idea as think delimiters: a tail that may start a stop string waits.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sampling:
    temp: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None  # GBNF text, compile-checked at intake
    lazy_grammar: tuple[str, list[str]] | None = None  # (GBNF, trigger regexes): tool calls
    logprobs: int | None = None  # None: off; N: the sampled token's logprob plus top N
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token ID, bias)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0  # multiplicative, llama.cpp's; 1 is off

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repeat_penalty != 1.0)

    stream_interval: int = 1


@dataclass
class Piece:
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Finish:
    reason: str  # stop | length | cancelled
    completion_tokens: int
    stop_string: str | None = None
    error: str | None = None
    cached_tokens: int = 0


class Request:
    """One generation request, created on the event loop and run by the decode loop.

    The decode loop feeds `Piece`s and then exactly one `Finish` into `queue`; `done` resolves
    once the request has left the decode loop (its slot can then be handed on).
    """

    def __init__(
        self,
        prompt: list[int],
        sampling: Sampling,
        cache_prompt: bool = True,
        adapter: str | None = None,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.cache_prompt = cache_prompt  # reuse a slot's KV for a shared prefix
        self.adapter = adapter  # the LoRA adapter it is generated with (None: the base)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Piece | Finish] = asyncio.Queue()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.cancelled = threading.Event()
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # prompt tokens found in the slot's KV (prefix reuse)

    def cancel(self) -> None:
        self.cancelled.set()


def held(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`
    (a stop string, a tool-call marker): that much text must wait for the next piece."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """A request's output as it grows, token by token (runs on the decode thread)."""

    def __init__(self, sampling: Sampling, budget: int) -> None:
        self.sampling = sampling
        self.budget = budget
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.ids: list[int] = []
        self.text = ""
        self.lps: list[dict[str, Any]] = []
        self.produced = 0
        self.stop_hit: str | None = None

    def push(
        self, token: int, raw: bytes, lp: dict[str, Any] | None
    ) -> tuple[Piece | None, str | None]:
        """Add one sampled (non-end) token: a piece to emit, if any, and the finish reason
        when this token ends the generation."""
        s = self.sampling
        self.produced += 1
        self.ids.append(token)
        piece = self.decoder.decode(raw)
        if lp is not None:
            self.lps.append({"token": piece, "bytes": list(piece.encode()), **lp})
        self.text += piece
        if s.stop:
            hit = min(((self.text.find(x), x) for x in s.stop if x in self.text), default=None)
            if hit is not None:
                self.text, self.stop_hit = self.text[: hit[0]], hit[1]
                return self.flush(), "stop"
        if self.produced >= self.budget:
            return self.flush(), "length"
        if len(self.ids) >= s.stream_interval:
            cut = len(self.text) - (held(self.text, s.stop) if s.stop else 0)
            if cut > 0:
                out = Piece(self.ids, self.text[:cut], self.lps or None)
                self.text, self.ids, self.lps = self.text[cut:], [], []
                return out, None
        return None, None

    def flush(self) -> Piece | None:
        """What is left when the generation ends (held-back text, undecoded bytes)."""
        if self.stop_hit is None:
            # A character cut in half by the token limit is dropped, not sent as U+FFFD.
            self.decoder.errors = "ignore"
            self.text += self.decoder.decode(b"", final=True)
        if not (self.ids or self.text):
            return None
        out = Piece(self.ids, self.text, self.lps or None)
        self.ids, self.text, self.lps = [], "", []
        return out
