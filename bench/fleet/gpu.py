"""One simulated GPU engine: continuous batching with chunked prefill, a KV pool in blocks
and a prefix cache of chained block hashes with LRU eviction. Pure logic, no I/O: the HTTP
side (bench/fleet/server.py) feeds it sequences and is told what each step produced.

The cost model is the one serving papers use (Sarathi-Serve, DistServe, vLLM's scheduler):
every step takes up to `chunk_tokens` uncached prompt tokens from the sequences still in
prefill (oldest first) plus one token for every sequence that is decoding, and lasts

    step_s = step_base_s + step_per_seq_s x decoding sequences + prefill tokens / prefill_tps

With `prefill_half_context` set, a chunk's tokens are computed at a rate that falls with
the context they attend to, `prefill_tps / (1 + context / prefill_half_context)` at the
chunk's middle: attention grows with the context. The H200 calibration
(calibration-h200.json, Llama-3-8B's shape) fits it with a half-context near 12,000 tokens
(38k tokens/s at none, 28k at 4,096, 23k at 8,192). `speed` scales a whole engine (a slower
or older GPU in a mixed fleet: 0.5 takes twice as long for everything).

KV: by default a sequence reserves blocks for its whole prompt and `max_tokens` when it is
admitted, so nothing is ever preempted. With `kv_on_demand` (vLLM's behaviour) it reserves
its prompt alone and takes a block as its output needs one; when the pool runs out, the
sequence admitted last is preempted (its blocks freed, back to the head of the queue, its
prompt and output so far recomputed when it is admitted again), as vLLM's scheduler does.

The defaults are shaped like one H100 serving an 8B model in bf16 (bench/README.md gives
the sources): a decode step reads the 16 GB of weights (~5 ms at 3.35 TB/s, 8 ms with
launch overheads), each sequence adds its KV reads, prefill runs near 10k tokens/s at
8k-token contexts, the KV pool holds ~430k tokens (80 GB less weights and activations,
128 KiB a token).

One whitespace word is one token, so every router sees the same prefix structure in text.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuModel:
    step_base_s: float = 0.008
    step_per_seq_s: float = 0.0002
    prefill_tps: float = 10_000.0
    chunk_tokens: int = 2048
    block_tokens: int = 512
    kv_blocks: int = 840
    max_seqs: int = 128
    prefill_half_context: float = 0.0  # 0: one prefill rate whatever the context
    speed: float = 1.0
    kv_on_demand: bool = False  # blocks taken as output grows, preemption when out

    def step_s(self, decoding: int, prefill_tokens: int, prefill_s: float | None = None) -> float:
        """A step's time; `prefill_s`, when given, is its prefill's own (context-aware)."""
        prefill = prefill_tokens / self.prefill_tps if prefill_s is None else prefill_s
        return (self.step_base_s + self.step_per_seq_s * decoding + prefill) / self.speed

    def chunk_s(self, context: int, tokens: int) -> float:
        """The time to prefill `tokens` prompt tokens after `context` already computed."""
        if not self.prefill_half_context:
            return tokens / self.prefill_tps
        middle = context + tokens / 2
        return tokens * (1 + middle / self.prefill_half_context) / self.prefill_tps


def block_hashes(words: list[str], block: int) -> list[int]:
    """Chained hashes of the prompt's whole blocks (a partial last block is never cached)."""
    out = []
    h = 0
    for i in range(0, len(words) - block + 1, block):
        h = hash((h, " ".join(words[i : i + block])))
        out.append(h)
    return out


@dataclass(eq=False)
class Seq:
    """One request in the engine."""

    prompt_tokens: int
    max_tokens: int
    hashes: list[int]
    cached_tokens: int = 0
    prefilled: int = 0  # prompt tokens computed so far (cached ones count as computed)
    generated: int = 0
    pinned: int = 0  # KV blocks it holds
    cancelled: bool = False
    recompute: int = 0  # output tokens to compute again after a preemption
    preempted: int = 0  # times it was

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prompt_tokens + self.recompute

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens


class Gpu:
    """The scheduler and the KV/prefix-cache bookkeeping of one engine."""

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        # Cached blocks no running sequence pins, least recently used first; pinned blocks
        # count their holders (a shared prefix is computed once and held by all).
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, int] = {}
        self.pinned_blocks = 0  # blocks held by running sequences (shared ones once)
        self.private_blocks = 0  # blocks of unshared tail and output, held by one sequence
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.served = 0
        self.preemptions = 0

    # -- what the HTTP side does ------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        self.waiting.append(seq)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def kv_usage(self) -> float:
        """The share of KV blocks sequences hold (vLLM's `kv_cache_usage_perc`: cached
        blocks no sequence holds are free to take)."""
        return (self.pinned_blocks + self.private_blocks) / self.model.kv_blocks

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- one step ---------------------------------------------------------------------
    def plan(self) -> tuple[float, list[Seq], int]:
        """Admit what fits, then the step: (its duration, the sequences that produce a
        token at its end, the prefill tokens it computes)."""
        self._drop_cancelled()
        self._admit()
        if self.model.kv_on_demand:
            for s in list(self.running):
                if s in self.running and not s.in_prefill:
                    self._grow(s)
        budget = self.model.chunk_tokens
        prefill = 0
        prefill_s = 0.0
        producing: list[Seq] = []
        decoding = 0
        for s in self.running:
            if s.in_prefill:
                if budget <= 0:
                    continue
                take = min(budget, s.prompt_tokens + s.recompute - s.prefilled)
                prefill_s += self.model.chunk_s(s.prefilled, take)
                s.prefilled += take
                budget -= take
                prefill += take
                if not s.in_prefill:
                    producing.append(s)  # the step that ends its prefill samples token 1
            else:
                decoding += 1
                producing.append(s)
        return self.model.step_s(decoding, prefill, prefill_s), producing, prefill

    def finish_step(self, producing: list[Seq]) -> list[Seq]:
        """Each producing sequence got a token; those that are done leave (returned)."""
        out = []
        for s in producing:
            if s.cancelled:
                continue
            s.generated += 1
            if s.done:
                out.append(s)
        for s in out:
            self._release(s)
            self.served += 1
        return out

    # -- KV and prefix cache ----------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        b = self.model.block_tokens
        return (tokens + b - 1) // b

    def _used(self) -> int:
        return self.pinned_blocks + self.private_blocks + len(self.free_cached)

    def _admit(self) -> None:
        """FIFO admission, as vLLM's scheduler: the oldest waits for room (blocks for its
        whole prompt and output are reserved at once, so nothing is ever preempted)."""
        cap = self.model.kv_blocks
        while self.waiting and len(self.running) < self.model.max_seqs:
            s = self.waiting[0]
            if s.cancelled:
                self.waiting.popleft()
                continue
            hit = 0
            for h in s.hashes:
                if h in self.pins or h in self.free_cached:
                    hit += 1
                else:
                    break
            ours = {h for h in s.hashes if h in self.free_cached}
            new = sum(1 for h in s.hashes if h not in self.pins and h not in self.free_cached)
            held = s.recompute + (1 if self.model.kv_on_demand else s.max_tokens)
            tail = self._blocks_for(s.prompt_tokens + held) - len(s.hashes)
            evictable = len(self.free_cached) - len(ours)
            if new + tail > cap - self._used() + evictable:
                return
            self.waiting.popleft()
            for h in s.hashes:
                self._pin(h)
            self.private_blocks += tail
            s.pinned = tail
            while self._used() > cap and self.free_cached:
                self.free_cached.popitem(last=False)  # least recently used out
            # An engine never serves the whole prompt from cache: the last token is computed.
            cached = min(hit * self.model.block_tokens, s.prompt_tokens - 1)
            s.prefilled = cached
            if not s.preempted:  # a recomputation is not a new prompt (nor what it reports)
                s.cached_tokens = cached
                self.prompt_tokens += s.prompt_tokens
                self.cached_tokens += s.cached_tokens
            self.running.append(s)

    def _grow(self, s: Seq) -> None:
        """A block for `s`'s next token if it needs one, preempting the sequence admitted
        last (`s` itself when it is the last) while the pool has none free."""
        cap = self.model.kv_blocks
        need = self._blocks_for(s.prompt_tokens + s.generated + 1) - len(s.hashes) - s.pinned
        while need > 0:
            if cap - self.pinned_blocks - self.private_blocks >= need:
                self.private_blocks += need
                s.pinned += need
                while self._used() > cap and self.free_cached:
                    self.free_cached.popitem(last=False)
                return
            victim = next((v for v in reversed(self.running) if v is not s), s)
            self._preempt(victim)
            if victim is s:
                return

    def _preempt(self, s: Seq) -> None:
        self._release(s)
        s.pinned = 0
        s.prefilled = 0
        s.recompute = s.generated
        s.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(s)

    def _pin(self, h: int) -> None:
        n = self.pins.get(h, 0)
        if n == 0:
            if h in self.free_cached:
                del self.free_cached[h]
            self.pinned_blocks += 1
        self.pins[h] = n + 1

    def _release(self, s: Seq) -> None:
        self.running.remove(s)
        self.private_blocks -= s.pinned
        # Only blocks whose every token was computed hold anything: a sequence cancelled in
        # its prefill (its client gone) leaves the blocks it had not reached empty, as
        # vLLM caches a block only once it is full and computed. (Before 2026-12-06 all of
        # an abandoned prompt became cached, and a door that admitted what it then served
        # too late to keep found the next turn in cache anyway.)
        computed = min(s.prefilled, s.prompt_tokens) // self.model.block_tokens
        # Deepest first into the LRU order, so a prefix is evicted from its tail.
        for i in range(len(s.hashes) - 1, -1, -1):
            h = s.hashes[i]
            n = self.pins[h] - 1
            if n:
                self.pins[h] = n
            else:
                del self.pins[h]
                self.pinned_blocks -= 1
                if i < computed:
                    self.free_cached[h] = None

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.running if s.cancelled]:
            self._release(s)

    def reset(self) -> None:
        self.__init__(self.model)  # type: ignore[misc]
