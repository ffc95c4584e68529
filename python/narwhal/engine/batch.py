"""The decode loop: every busy slot's work in one llama.cpp batch per step, on one thread.

Each step takes the next token of every streaming slot, then fills the rest of the batch with
prompt chunks of slots in prefill, oldest first, at most `prefill_chunk` prompt tokens a step:
a long prompt never stalls the others' decoding for longer than one chunk. Every slot is one
llama.cpp sequence with its own share of the KV memory (`--ctx-size` split evenly over the
slots, as llama-server does). A finished slot keeps its KV, so a later prompt sharing a prefix
with it skips that much prefill (`cached_tokens`).

The event loop never waits on this thread: requests come in through `submit`, results go
back with one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from narwhal.engine.generation import Finish, Piece, Request, TextStream
from narwhal.engine.model import Model

log = logging.getLogger("lexi_engine")

# Sampling one token is ~0.1 ms of C: called through a PyDLL it keeps the GIL, so the decode
# thread does not queue behind the event loop for the GIL again after every slot it samples.
_lib = llama_cpp.llama_cpp._lib
_sample = ctypes.PyDLL(_lib._name, handle=_lib._handle).llama_sampler_sample
_sample.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
_sample.restype = ctypes.c_int32


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix. Runs on the event loop for every free slot at every
    request, so it bisects with slice comparisons (C speed) instead of a Python loop."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sampler_chain(model: Model, req: Request) -> Any:
    """llama.cpp's sampler chain for one request (grammar, then the usual truncations)."""
    s = req.sampling
    lc = llama_cpp
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    vocab = model.vocab
    if s.grammar is not None:
        lc.llama_sampler_chain_add(
            chain, lc.llama_sampler_init_grammar(vocab, s.grammar.encode(), b"root")
        )
    elif s.lazy_grammar is not None:
        gbnf, triggers = s.lazy_grammar
        words = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
        lc.llama_sampler_chain_add(
            chain,
            lc.llama_sampler_init_grammar_lazy_patterns(
                vocab, gbnf.encode(), b"root", words, len(triggers), None, 0
            ),
        )
    n_vocab = model.n_vocab
    if s.logit_bias:
        biases = (lc.llama_logit_bias * len(s.logit_bias))(
            *(lc.llama_logit_bias(token, bias) for token, bias in s.logit_bias)
        )
        lc.llama_sampler_chain_add(
            chain, lc.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), biases)
        )
    if s.penalized:
        # Over the whole output, as OpenAI's penalties are (the window is the token budget).
        window = max(1, min(s.max_tokens, model.n_ctx))
        lc.llama_sampler_chain_add(
            chain,
            lc.llama_sampler_init_penalties(
                n_vocab, window, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            ),
        )
    if s.temp <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    if s.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temp))
    seed = s.seed if s.seed is not None else random.getrandbits(32)
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
    return chain


class _Active:
    """Decode-thread state of one slot's request."""

    __slots__ = ("chain", "last", "n_past", "order", "req", "slot", "stream", "todo")

    def __init__(
        self, req: Request, slot: int, order: int, chain: Any, stream: TextStream, n_past: int
    ) -> None:
        self.req = req
        self.slot = slot
        self.order = order
        self.chain = chain
        self.stream = stream
        self.n_past = n_past  # tokens of this sequence in KV
        self.todo = req.prompt[n_past:]  # prompt tokens not yet in KV
        self.last = -1  # the sampled token to feed next (decode phase)


class DecodeLoop:
    def __init__(self, model: Model, n_slots: int, prefill_chunk: int, threads: int | None) -> None:
        self.model = model
        self.n_slots = n_slots
        self.prefill_chunk = prefill_chunk
        self.capacity = prefill_chunk + n_slots
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = model.n_ctx * n_slots
        p.n_batch = p.n_ubatch = self.capacity
        p.n_seq_max = n_slots
        p.kv_unified = False  # each slot attends over its own share only (measured: no slower)
        p.no_perf = True
        # All cores by default, for one token as for a batch, as llama-server does.
        p.n_threads = p.n_threads_batch = threads or os.cpu_count() or 1
        ctx = llama_cpp.llama_init_from_model(model.llama._model.model, p)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the batched context")
        self.ctx = ctx
        self.mem = llama_cpp.llama_get_memory(ctx)
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(ctx))
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        # What each sequence's KV holds, token for token: the prefix index for reuse; and
        # the adapter it was computed with (KV from another adapter is not this one's).
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]
        self.cached_adapter: list[str | None] = [None] * n_slots
        self._applied: str | None = None  # the adapter set on the context now
        self._turn = 0  # whose step it is, where requests of several adapters decode
        self.on_step: Callable[[int], None] | None = None  # batch size per step (metrics)
        self._cv = threading.Condition()
        self._incoming: list[tuple[int, Request]] = []
        self._active: dict[int, _Active] = {}
        self._order = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lexi-decode", daemon=True)
        self._thread.start()

    # -- event-loop side ----------------------------------------------------------------
    def submit(self, slot: int, req: Request) -> None:
        with self._cv:
            self._incoming.append((slot, req))
            self._cv.notify()

    def prefix_with(self, slot: int, prompt: list[int], adapter: str | None = None) -> int:
        """Prompt tokens a free slot already holds in KV for `adapter` (read only while the
        slot is free)."""
        if self.cached_adapter[slot] != adapter:
            return 0
        return shared_prefix(self.cached[slot], prompt)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)

    # -- decode thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._active or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
            out: list[tuple[Request, Piece | Finish]] = []
            # Nothing may end this thread: a request it dropped would hold its slot forever.
            for slot, req in incoming:
                try:
                    self._admit(slot, req, out)
                except Exception as e:
                    log.exception("admitting a request failed")
                    self._fail(slot, req, f"generation failed: {e}", out)
            try:
                self._step(out)
            except Exception as e:  # llama.cpp failure: every request in flight gets it
                log.exception("decode step failed")
                for a in list(self._active.values()):
                    self._fail(a.slot, a.req, f"decoding failed: {e}", out)
            self._deliver(out)
        for a in list(self._active.values()):
            out = []
            self._end(a, Finish("cancelled", a.stream.produced), out, keep_kv=False)
            self._deliver(out)

    def _fail(
        self, slot: int, req: Request, error: str, out: list[tuple[Request, Piece | Finish]]
    ) -> None:
        a = self._active.get(slot)
        if a is not None and a.req is req:
            self._end(a, Finish("stop", a.stream.produced, error=error), out, keep_kv=False)
            return
        llama_cpp.llama_memory_seq_rm(self.mem, slot, -1, -1)
        self.cached[slot] = []
        out.append((req, Finish("stop", 0, error=error)))

    def _admit(self, slot: int, req: Request, out: list[tuple[Request, Piece | Finish]]) -> None:
        if slot in self._active:  # the event loop hands a slot on only once it is let go
            raise RuntimeError(f"slot {slot} is still decoding")
        if not req.cache_prompt or self.cached_adapter[slot] != req.adapter:
            # llama-server's switch (this prompt is evaluated in full), or KV computed with
            # another adapter.
            llama_cpp.llama_memory_seq_rm(self.mem, slot, -1, -1)
            self.cached[slot] = []
            self.cached_adapter[slot] = req.adapter
        prompt = req.prompt
        n = min(shared_prefix(self.cached[slot], prompt), len(prompt) - 1)
        if n < len(self.cached[slot]) and not llama_cpp.llama_memory_seq_rm(self.mem, slot, n, -1):
            llama_cpp.llama_memory_seq_rm(self.mem, slot, -1, -1)
            n = 0
        del self.cached[slot][n:]
        budget = min(req.sampling.max_tokens, self.n_ctx_seq - len(prompt))
        try:
            chain = _sampler_chain(self.model, req)
        except Exception as e:
            out.append((req, Finish("stop", 0, error=f"sampler setup failed: {e}")))
            return
        self._order += 1
        a = _Active(req, slot, self._order, chain, TextStream(req.sampling, budget), n)
        req.cached_tokens = n
        self._active[slot] = a
        if budget <= 0:
            self._end(a, self._finish(a, "length"), out, keep_kv=True)

    def _step(self, out: list[tuple[Request, Piece | Finish]]) -> None:
        for a in [a for a in self._active.values() if a.req.cancelled.is_set()]:
            self._end(a, Finish("cancelled", a.stream.produced), out, keep_kv=False)
        if not self._active:
            return
        step = self._adapter_turn()
        b = self.batch
        n = 0
        outputs: list[tuple[_Active, int]] = []

        def add(a: _Active, token: int, logits: bool) -> None:
            nonlocal n
            b.token[n] = token
            b.pos[n] = a.n_past
            b.n_seq_id[n] = 1
            b.seq_id[n][0] = a.slot
            b.logits[n] = logits
            if logits:
                outputs.append((a, n))
            a.n_past += 1
            self.cached[a.slot].append(token)
            n += 1

        # Prefill room goes to the oldest requests first...
        room = self.prefill_chunk
        chunks: dict[int, list[int]] = {}
        for a in sorted(self._active.values(), key=lambda x: x.order):
            if a.slot in step and a.todo and room > 0:
                chunks[a.slot], a.todo = a.todo[:room], a.todo[room:]
                room -= len(chunks[a.slot])
        # ...but the batch lists its sequences in slot order: llama.cpp decodes a batch whose
        # sequence IDs come out of order (slots are handed out as requests arrive) ~25%
        # slower (measured, bench/README.md).
        for slot in sorted(step):
            a = self._active[slot]
            take = chunks.get(slot)
            if take is not None:
                for i, t in enumerate(take):
                    add(a, t, not a.todo and i == len(take) - 1)
            elif not a.todo:
                add(a, a.last, True)
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if self.on_step is not None:
            self.on_step(n)
        for a, i in outputs:
            self._sample(a, i, out)

    def _adapter_turn(self) -> set[int]:
        """The slots this step decodes: all of them where they share one adapter (or none);
        else those of one adapter a step, in turn. llama.cpp applies adapters to a whole
        context, never per sequence in a batch, so requests of two adapters cannot share a
        step; each gets its turn rather than being refused (docs/DECISIONS.md)."""
        groups = sorted({a.req.adapter or "" for a in self._active.values()})
        if len(groups) == 1:
            chosen = groups[0]
            step = set(self._active)
        else:
            self._turn = (self._turn + 1) % len(groups)
            chosen = groups[self._turn]
            step = {s for s, a in self._active.items() if (a.req.adapter or "") == chosen}
        adapter = chosen or None
        if adapter != self._applied:
            self._apply(adapter)
        return step

    def _apply(self, adapter: str | None) -> None:
        if adapter is None:
            rc = llama_cpp.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            ptrs = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self.model.adapters[adapter])
            scales = (ctypes.c_float * 1)(1.0)
            rc = llama_cpp.llama_set_adapters_lora(self.ctx, ptrs, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not apply adapter {adapter!r} ({rc})")
        self._applied = adapter

    def _sample(self, a: _Active, i: int, out: list[tuple[Request, Piece | Finish]]) -> None:
        m, req = self.model, a.req
        token = _sample(a.chain, self.ctx, i)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if m.is_eog(token):
            piece = a.stream.flush()
            if piece is not None:
                out.append((req, piece))
            self._end(a, self._finish(a, "stop"), out, keep_kv=True)
            return
        top = req.sampling.logprobs
        lp = self._logprobs(i, token, top) if top is not None else None
        piece, reason = a.stream.push(token, m.token_bytes(token), lp)
        if piece is not None:
            out.append((req, piece))
        if reason is not None:
            self._end(a, self._finish(a, reason), out, keep_kv=True)
        else:
            a.last = token

    def _finish(self, a: _Active, reason: str) -> Finish:
        return Finish(
            reason,
            a.stream.produced,
            stop_string=a.stream.stop_hit,
            cached_tokens=a.req.cached_tokens,
        )

    def _end(
        self, a: _Active, finish: Finish, out: list[tuple[Request, Piece | Finish]], keep_kv: bool
    ) -> None:
        if self._active.get(a.slot) is a:
            del self._active[a.slot]
        llama_cpp.llama_sampler_free(a.chain)
        if not keep_kv:
            llama_cpp.llama_memory_seq_rm(self.mem, a.slot, -1, -1)
            self.cached[a.slot] = []
        out.append((a.req, finish))

    def _logprobs(self, i: int, token: int, n: int) -> dict[str, Any]:
        m = self.model
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
        logits = np.ctypeslib.as_array(ptr, shape=(m.n_vocab,))
        shifted = logits - logits.max()
        lp = shifted - np.log(np.exp(shifted).sum())
        entry: dict[str, Any] = {"logprob": float(lp[token])}
        if n:
            top = np.argpartition(-lp, n)[:n]
            top = top[np.argsort(-lp[top])]
            entry["top_logprobs"] = [
                {
                    "token": (t := m.token_bytes(int(j)).decode("utf-8", "replace")),
                    "logprob": float(lp[j]),
                    "bytes": list(t.encode()),
                }
                for j in top
            ]
        return entry

    def _deliver(self, out: list[tuple[Request, Piece | Finish]]) -> None:
        if not out:
            return
        by_loop: dict[Any, list[tuple[Request, Piece | Finish]]] = {}
        for req, item in out:
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_hand_over, items)


def _hand_over(items: list[tuple[Request, Piece | Finish]]) -> None:
    """On the event loop: queue each item; a `Finish` also marks its request done."""
    for req, item in items:
        req.queue.put_nowait(item)
        if isinstance(item, Finish) and not req.done.done():
            req.done.set_result(None)
