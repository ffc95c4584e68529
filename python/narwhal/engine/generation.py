"""One generation, run on a worker thread so llama.cpp never blocks the event loop.

The thread turns sampled tokens into `Piece`s (token IDs, text, optional logprobs) and hands
them to the loop in groups of `stream_interval` tokens. Stop strings are matched on text with
the same holdback idea as think delimiters: a tail that may start a stop string waits.
"""

from __future__ import annotations

import asyncio
import codecs
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from narwhal.engine.model import Model


@dataclass
class Sampling:
    temp: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: Any = None
    logprobs: int | None = None  # None: off; N: the sampled token's logprob plus top N
    stream_interval: int = 1


@dataclass
class Piece:
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Finish:
    reason: str  # stop | length
    completion_tokens: int
    stop_string: str | None = None
    error: str | None = None


def _held(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Generation:
    """Feeds `Piece`s then one `Finish` into `queue` (an asyncio.Queue on `loop`)."""

    def __init__(self, model: Model, prompt: list[int], sampling: Sampling) -> None:
        self.model = model
        self.prompt = prompt
        self.sampling = sampling
        self.cancelled = threading.Event()
        self.queue: asyncio.Queue[Piece | Finish] = asyncio.Queue()
        self.first_token_at: float | None = None
        self.started_at = time.monotonic()

    def cancel(self) -> None:
        self.cancelled.set()

    def _logprobs(self, token: int, piece: str) -> dict[str, Any]:
        m = self.model
        logits = np.ctypeslib.as_array(m.llama._ctx.get_logits(),  # type: ignore[no-untyped-call]
                                     shape=(m.n_vocab,))
        shifted = logits - logits.max()
        logz = np.log(np.exp(shifted).sum())
        lp = shifted - logz
        entry: dict[str, Any] = {"token": piece, "logprob": float(lp[token]),
                                 "bytes": list(piece.encode())}
        n = self.sampling.logprobs or 0
        if n:
            top = np.argpartition(-lp, n)[:n]
            top = top[np.argsort(-lp[top])]
            entry["top_logprobs"] = [
                {"token": (t := m.token_bytes(int(i)).decode("utf-8", "replace")),
                 "logprob": float(lp[i]), "bytes": list(t.encode())}
                for i in top
            ]
        return entry

    def run(self, loop: asyncio.AbstractEventLoop) -> None:
        """Thread body. Never raises: errors become a `Finish` with `error`."""
        put = self.queue.put_nowait
        try:
            finish = self._run(loop, put)
        except Exception as e:  # llama.cpp failures must reach the client as an error
            finish = Finish("stop", 0, error=f"generation failed: {e}")
        loop.call_soon_threadsafe(put, finish)

    def _run(self, loop: asyncio.AbstractEventLoop, put: Any) -> Finish:
        m, s = self.model, self.sampling
        m.llama.set_seed(s.seed if s.seed is not None else random.getrandbits(31))
        budget = min(s.max_tokens, m.n_ctx - len(self.prompt))
        if budget <= 0:
            return Finish("length", 0)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        ids: list[int] = []
        text = ""
        lps: list[dict[str, Any]] = []
        produced = 0
        reason = "length"
        stop_hit: str | None = None
        gen = m.llama.generate(
            self.prompt, temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repeat_penalty=1.0, grammar=s.grammar,
        )
        try:
            for token in gen:
                if self.cancelled.is_set():
                    reason = "cancelled"
                    break
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                if m.is_eog(token):
                    reason = "stop"
                    break
                produced += 1
                ids.append(token)
                piece = decoder.decode(m.token_bytes(token))
                if s.logprobs is not None:
                    lps.append(self._logprobs(token, piece))
                text += piece
                if s.stop:
                    hit = min(((text.find(x), x) for x in s.stop if x in text), default=None)
                    if hit is not None:
                        text, stop_hit, reason = text[: hit[0]], hit[1], "stop"
                        break
                last = produced >= budget
                if len(ids) >= s.stream_interval or last:
                    hold = _held(text, s.stop) if s.stop else 0
                    if text[: len(text) - hold] or last:
                        emit, text = text[: len(text) - hold], text[len(text) - hold :]
                        loop.call_soon_threadsafe(put, Piece(ids, emit, lps or None))
                        ids, lps = [], []
                if last:
                    break
        finally:
            gen.close()
        text += decoder.decode(b"", final=True) if stop_hit is None else ""
        if ids or text:
            loop.call_soon_threadsafe(put, Piece(ids, text, lps or None))
        return Finish(reason, produced, stop_string=stop_hit)
