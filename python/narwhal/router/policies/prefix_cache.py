"""The router's picture of each engine's prefix cache: which prompt blocks it placed where.

A prompt's text (`Request.prefix_text()`: tools, then each message's role and content) is cut
into blocks of `block_bytes` and hashed in Rust, each block chained on the one before
(`narwhal._native.PromptBlocks`), so equal leading hashes are an equal leading text in any
dialect and without a tokenizer. Per engine a bounded LRU (`narwhal._native.PrefixMap`)
keeps the blocks placed there; the leading run of a new prompt's blocks an engine holds is
the text it is expected to have cached.

Text blocks become tokens as a share of the prompt: the held run's share of the prompt's text
applied to the prompt's sized tokens. Sizing by bytes per token is off by 10-20 % from one
prompt to the next (words differ); the share is exact, so what is left to prefill keeps the
sizing's relative error and never collapses to nothing when a long history is cached and
its sizing runs low. Engines cache in blocks of their own (vLLM 16 tokens, SGLang 1, the
bench's simulator 512), evict what they must, and count the last token as computed: how
much of the expected share they really serve is learned per engine from the `cached_tokens`
they report against the prompt tokens they count (`realised`, an EWMA, at most 1: an
engine holding more than the picture knows is not a reason to expect more of the next
prompt), and a report of far fewer cached tokens than expected drops the rest of that
prompt's blocks from the picture. The LRU holds `tokens_per_engine` worth of text
blocks (resized as bytes per token is learned): what a KV pool of that many tokens keeps.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
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
    share: float = 0.0  # of the prompt's text, what those blocks hold
    sized: int = 0  # the prompt's tokens as sized for that engine


NOTHING_HELD = Expectation(0, 0)


class PrefixCache:
    def __init__(self, engines: list[Engine], tokens_per_engine: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.tokens_per_engine = tokens_per_engine
        # Per slot of the picture, the engine it is for (None: a slot an engine left).
        self.names: list[str | None] = [e.name for e in engines]
        self.index = {e.name: i for i, e in enumerate(engines)}
        self.map = PrefixMap(len(engines), self._capacity(DEFAULT_BYTES_PER_TOKEN))
        self.realised = [1.0] * len(engines)
        self._bpt = [DEFAULT_BYTES_PER_TOKEN] * len(engines)
        # Per process: a client cannot aim a hash collision at another tenant's prefix.
        self._seed = int.from_bytes(secrets.token_bytes(8), "little")
        # `ha.mode: active`: told when an engine is found to hold less than the picture
        # said (the other routers' pictures drop it too): the engine, the prompt's blocks,
        # how many of them it still holds.
        self.told: Callable[[str, PromptBlocks, int], None] | None = None

    def add(self, name: str) -> None:
        """A new engine, holding nothing yet: the slot of one that left, or a new one."""
        if name in self.index:
            return
        free = next((i for i, n in enumerate(self.names) if n is None), None)
        if free is None:
            free = self.map.add_engine(self._capacity(DEFAULT_BYTES_PER_TOKEN))
            self.names.append(name)
            self.realised.append(1.0)
            self._bpt.append(DEFAULT_BYTES_PER_TOKEN)
        else:
            self.names[free] = name
            self.realised[free] = 1.0
            self._bpt[free] = DEFAULT_BYTES_PER_TOKEN
            self.map.set_capacity(free, self._capacity(DEFAULT_BYTES_PER_TOKEN))
        self.index[name] = free

    def remove(self, name: str) -> None:
        """The engine left: its picture goes (its slot is kept for the next one)."""
        i = self.index.pop(name, None)
        if i is None:
            return
        self.names[i] = None
        self.map.set_capacity(i, 0)  # evicts every block it held

    def _capacity(self, bytes_per_token: float) -> int:
        return max(1, int(self.tokens_per_engine * bytes_per_token / self.block_bytes))

    def blocks(self, text: bytes) -> PromptBlocks:
        return PromptBlocks(text, self.block_bytes, self._seed)

    def expect(
        self,
        blocks: PromptBlocks,
        text_bytes: int,
        sized: list[int],
        bytes_per_token: list[float | None],
    ) -> list[Expectation]:
        """Per engine (in the pool's order), what it is expected to have cached of a prompt
        of `text_bytes` bytes of text, sized `sized` tokens for each engine; the learned
        bytes per token come in that order too (None: not learned yet)."""
        out = []
        for i, n in enumerate(self.map.matched(blocks)):
            if not n:
                out.append(NOTHING_HELD)
                continue
            self._resize(i, bytes_per_token[i])
            share = min(1.0, n * self.block_bytes / max(1, text_bytes))
            tokens = int(sized[i] * share * self.realised[i])
            out.append(Expectation(n, tokens, share, sized[i]))
        return out

    def _resize(self, i: int, learned: float | None) -> None:
        """Engine `i`'s LRU holds `tokens_per_engine` worth of text at its learned bytes per
        token (resized only on a real change)."""
        bpt = learned or DEFAULT_BYTES_PER_TOKEN
        if abs(bpt - self._bpt[i]) > 0.1 * self._bpt[i]:
            self._bpt[i] = bpt
            self.map.set_capacity(i, self._capacity(bpt))

    def placed(self, engine: str, blocks: PromptBlocks) -> None:
        """The prompt went to `engine`: once prefilled, its blocks are there."""
        i = self.index.get(engine)
        if i is not None:
            self.map.record(i, blocks)

    def held(self, engine: str) -> bytes:
        """`engine`'s blocks, newest first, packed (for another router's picture)."""
        i = self.index.get(engine)
        return self.map.held(i) if i is not None else b""

    def seeded(self, seed: int) -> None:
        """Active routers hash prompts with one seed (from their shared secret), so that
        the blocks one places are the blocks the others look up."""
        self._seed = seed

    def cut(self, engine: str, blocks: PromptBlocks, keep: int) -> None:
        """`engine` holds no more of the prompt than its first `keep` blocks (a prefill cut
        short, whose progress is not known)."""
        i = self.index.get(engine)
        if i is not None:
            self.map.forget_after(i, blocks, keep)
            if self.told is not None:
                self.told(engine, blocks, keep)

    def cut_elsewhere(self, engine: str, blocks: PromptBlocks, keep: int) -> None:
        """Another router found `engine` holding only the first `keep` of these blocks."""
        i = self.index.get(engine)
        if i is not None:
            self.map.forget_after(i, blocks, keep)

    def reported(
        self,
        engine: str,
        blocks: PromptBlocks,
        expected: Expectation,
        cached_tokens: int,
        prompt_tokens: int | None,
    ) -> None:
        """The engine said it served `cached_tokens` of the `prompt_tokens` it counted
        (None: it did not say) from its cache."""
        i = self.index.get(engine)
        if i is None:
            return  # it left the fleet while the request ran
        # Against the engine's own count of the prompt, so that the sizing's error is not
        # learned as the cache's.
        held = (prompt_tokens or expected.sized) * expected.share
        if held <= 0:
            return
        ratio = cached_tokens / held
        self.realised[i] = min(1.0, max(0.05, (1 - ALPHA) * self.realised[i] + ALPHA * ratio))
        if cached_tokens < 0.5 * expected.tokens:
            # It no longer holds what the picture says: keep only what it reported.
            keep = int(expected.blocks * min(1.0, ratio))
            self.map.forget_after(i, blocks, keep)
            if self.told is not None:
                self.told(engine, blocks, keep)
