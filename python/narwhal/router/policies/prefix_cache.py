"""The router's picture of each engine's prefix cache: which prompt blocks it placed where.

A prompt's text (`Intake.prefix_text()`: tools, then each message's role and content) is cut
into blocks of `block_bytes` and hashed in Rust, each block chained on the one before
(`narwhal._native.PromptBlocks`), so equal leading hashes are an equal leading text in any
dialect and without a tokenizer. Per engine a bounded LRU (`narwhal._native.PrefixMap`)
keeps the blocks placed there; the leading run of a new prompt's blocks an engine holds is
the text it is expected to have cached.

Text blocks become tokens through the engine's learned bytes per token. Engines cache in
blocks of their own (vLLM 16 tokens, SGLang 1, the bench's simulator 512), evict what they
must, and count the last token as computed: how much of the expected text they really
serve is learned per engine from the `cached_tokens` they report (`realised`, an EWMA of
reported / expected), and a report of fewer cached tokens than expected drops the rest of
that prompt's blocks from the picture. The LRU holds `tokens_per_engine` worth of text
blocks (resized as bytes per token is learned): what a KV pool of that many tokens keeps.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from narwhal._native import PrefixMap, PromptBlocks
from narwhal.router.engines import Engine

ALPHA = 0.2  # EWMA weight of one report
DEFAULT_BYTES_PER_TOKEN = 4.0


@dataclass(frozen=True)
class Expectation:
    """What one engine is expected to serve of a prompt from its cache."""

    blocks: int  # leading text blocks it holds
    tokens: int  # those in tokens, as it is expected to count them


_NOTHING = Expectation(0, 0)


class PrefixCache:
    def __init__(self, engines: list[Engine], tokens_per_engine: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.tokens_per_engine = tokens_per_engine
        self.names = [e.name for e in engines]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.map = PrefixMap(len(engines), self._capacity(DEFAULT_BYTES_PER_TOKEN))
        self.realised = [1.0] * len(engines)
        self._bpt = [DEFAULT_BYTES_PER_TOKEN] * len(engines)
        # Per process: a client cannot aim a hash collision at another tenant's prefix.
        self._seed = int.from_bytes(secrets.token_bytes(8), "little")

    def _capacity(self, bytes_per_token: float) -> int:
        return max(1, int(self.tokens_per_engine * bytes_per_token / self.block_bytes))

    def blocks(self, text: bytes) -> PromptBlocks:
        return PromptBlocks(text, self.block_bytes, self._seed)

    def expect(
        self, blocks: PromptBlocks, bytes_per_token: list[float | None]
    ) -> list[Expectation]:
        """Per engine (in the pool's order), what it is expected to have cached; the learned
        bytes per token come in that order too (None: not learned yet)."""
        out = []
        for i, n in enumerate(self.map.matched(blocks)):
            if not n:
                out.append(_NOTHING)
                continue
            bpt = self._bytes_per_token(i, bytes_per_token[i])
            out.append(Expectation(n, int(n * self.block_bytes / bpt * self.realised[i])))
        return out

    def _bytes_per_token(self, i: int, learned: float | None) -> float:
        bpt = learned or DEFAULT_BYTES_PER_TOKEN
        if abs(bpt - self._bpt[i]) > 0.1 * self._bpt[i]:  # resize only on a real change
            self._bpt[i] = bpt
            self.map.set_capacity(i, self._capacity(bpt))
        return bpt

    def placed(self, engine: str, blocks: PromptBlocks) -> None:
        """The prompt went to `engine`: once prefilled, its blocks are there."""
        self.map.record(self.index[engine], blocks)

    def reported(
        self, engine: str, blocks: PromptBlocks, expected: Expectation, cached_tokens: int
    ) -> None:
        """The engine said it served `cached_tokens` of the prompt from its cache."""
        i = self.index[engine]
        if expected.blocks:
            raw = expected.tokens / self.realised[i]
            if raw > 0:
                sample = min(1.5, cached_tokens / raw)
                self.realised[i] = min(
                    1.2, max(0.05, (1 - ALPHA) * self.realised[i] + ALPHA * sample)
                )
        if cached_tokens < 0.5 * expected.tokens:
            # It no longer holds what the picture says: keep only what it reported.
            keep = int(cached_tokens * self._bpt[i] / self.block_bytes)
            self.map.forget_after(i, blocks, keep)
