"""LexiEngine's N slots decoded in one batch, end to end on the real SmolLM2 model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support import Server, start_engine

pytestmark = pytest.mark.slow

WORDS = ("apple", "river", "stone", "cloud")


def exact(word: str, n: int) -> str:
    return 'root ::= "' + (word + " ") * n + '"'


def room(word: str, n: int) -> int:
    """max_tokens that fits the forced text under any tokenization (at worst a byte a
    token): which pieces the model picks under a grammar depends on the kernels it runs."""
    return len((word + " ") * n) + 8


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Server]:
    s = start_engine(
        model_path,
        "--parallel",
        "4",
        "--prefill-chunk",
        "32",
        "--temp",
        "0",
        "--queue-wait",
        "0",
        "--ctx-size",
        "8192",
    )
    yield s
    s.stop()


def stream_text(url: str, body: dict[str, Any], log: list[tuple[float, str]]) -> str:
    """Streams a completion; records (arrival time, text) per chunk. Returns the text."""
    text = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                t = orjson.loads(line[6:])["choices"][0]["text"]
                if t:
                    log.append((time.monotonic(), t))
                    text.append(t)
    return "".join(text)


def run_together(fns: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def go(i: int) -> None:
        results[i] = fns[i]()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def test_concurrent_streams_are_correct_independent_and_interleaved(engine: Server) -> None:
    logs: list[list[tuple[float, str]]] = [[] for _ in WORDS]
    texts = run_together(
        [
            (
                lambda i=i, w=w: stream_text(
                    engine.url,
                    {"prompt": f"Say {w}", "max_tokens": room(w, 40), "grammar": exact(w, 40)},
                    logs[i],
                )
            )
            for i, w in enumerate(WORDS)
        ]
    )
    assert texts == [(w + " ") * 40 for w in WORDS]
    # Decoded together: every stream had output before any stream ended.
    first_ends = min(log[-1][0] for log in logs)
    assert all(log[0][0] < first_ends for log in logs)
    m = httpx.get(engine.url + "/metrics").text
    assert "lexi_batch_tokens_bucket" in m


def test_same_text_alone_and_batched_at_temperature_zero(engine: Server) -> None:
    body = {"prompt": "Once upon a time, in a small village,", "max_tokens": 24}
    alone = httpx.post(engine.url + "/v1/completions", json=body, timeout=120).json()

    def beside(prompt: str) -> Any:
        return lambda: httpx.post(
            engine.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24}, timeout=120
        ).json()

    batched = run_together(
        [
            beside(body["prompt"]),
            beside("The capital of France is"),
            beside("def fibonacci(n):"),
            beside("Dear friend,"),
        ]
    )
    assert batched[0]["choices"][0]["text"] == alone["choices"][0]["text"]
    assert batched[0]["usage"]["completion_tokens"] == 24


def test_prefix_reuse_shows_in_cached_tokens(engine: Server) -> None:
    shared = "The history of the river valley is long. " * 12

    def ask(prompt: str) -> dict[str, Any]:
        r = httpx.post(
            engine.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "return_token_ids": True},
            timeout=120,
        )
        return r.json()  # type: ignore[no-any-return]

    a = ask(shared + "First question?")
    b = ask(shared + "Second, different question?")
    ids_a = a["choices"][0]["prompt_token_ids"]
    ids_b = b["choices"][0]["prompt_token_ids"]
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert common > 50
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == common
    again = ask(shared + "Second, different question?")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids_b) - 1
    fresh = httpx.post(
        engine.url + "/v1/completions",
        timeout=120,
        json={
            "prompt": shared + "Second, different question?",
            "max_tokens": 1,
            "cache_prompt": False,
        },
    ).json()  # llama-server's switch: evaluate it all
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["text"] == again["choices"][0]["text"]
    chat = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": shared}], "max_tokens": 1},
        timeout=120,
    ).json()
    assert "cached_tokens" in chat["usage"]["prompt_tokens_details"]


def test_long_prompt_beside_a_stream_keeps_it_flowing(engine: Server) -> None:
    log: list[tuple[float, str]] = []
    window: dict[str, float] = {}

    def streamer() -> str:
        return stream_text(
            engine.url,
            {"prompt": "Count", "max_tokens": room("tick", 300), "grammar": exact("tick", 300)},
            log,
        )

    def long_prompt() -> int:
        while len(log) < 5:  # the stream is decoding
            time.sleep(0.01)
        window["sent"] = time.monotonic()
        r = httpx.post(
            engine.url + "/v1/completions",
            json={"prompt": "All work and no play makes a dull day. " * 60, "max_tokens": 1},
            timeout=120,
        )
        window["answered"] = time.monotonic()
        return int(r.json()["usage"]["prompt_tokens"])

    text, prompt_tokens = run_together([streamer, long_prompt])
    assert text == "tick " * 300
    assert prompt_tokens > 500
    during = [t for t, _ in log if window["sent"] < t < window["answered"]]
    # Prefill in 32-token chunks: the stream got a token in (almost) every step of it.
    assert len(during) >= prompt_tokens // 32 // 2


def test_cancellation_frees_the_slot_at_once(model_path: str) -> None:
    s = start_engine(model_path, "--parallel", "2", "--queue-wait", "0", "--temp", "0")
    try:
        body = {"prompt": "Go", "max_tokens": 1500, "stream": True, "grammar": exact("go", 1400)}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as one:
            c1 = one.iter_bytes()  # held: dropping the iterator would close the stream
            assert next(c1)
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as two:
                c2 = two.iter_bytes()
                assert next(c2)
                third = httpx.post(
                    s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
                )
                assert third.status_code == 429
            # `two` is closed: its slot comes back within a decode step.
            for _ in range(100):
                third = httpx.post(
                    s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
                )
                if third.status_code == 200:
                    break
                time.sleep(0.02)
            assert third.status_code == 200
        m = httpx.get(s.url + "/metrics").text
        busy = [ln for ln in m.splitlines() if ln.startswith("lexi_slots_busy ")]
        for _ in range(100):
            if busy == ["lexi_slots_busy 0.0"]:
                break
            time.sleep(0.02)
            m = httpx.get(s.url + "/metrics").text
            busy = [ln for ln in m.splitlines() if ln.startswith("lexi_slots_busy ")]
        assert busy == ["lexi_slots_busy 0.0"]
    finally:
        s.stop()


def test_each_step_lists_sequences_in_slot_order(model_path: str) -> None:
    """Slots are handed out as requests arrive, but llama.cpp decodes a batch whose sequence
    IDs come out of order about a quarter slower: every step must list them in order."""
    import asyncio

    import llama_cpp

    from narwhal.engine.batch import DecodeLoop
    from narwhal.engine.config import EngineConfig
    from narwhal.engine.generation import Finish, Request, Sampling
    from narwhal.engine.model import Model

    m = Model(EngineConfig(model=model_path, parallel=4, ctx_size=2048, threads=1))
    loop = DecodeLoop(m, 4, 8, 1)  # a small prefill chunk: prefill and decode share steps
    inner = llama_cpp.llama_decode
    steps: list[list[int]] = []

    def recording(ctx: Any, batch: Any) -> int:
        steps.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return int(inner(ctx, batch))

    async def run() -> None:
        reqs = [
            Request(m.tokenize(f"Tell me about {w}s and more {w}s."), Sampling(0, 1, 0, 0, 6))
            for w in WORDS
        ]
        for slot, r in zip((2, 0, 3, 1), reqs, strict=True):  # arrival order != slot order
            loop.submit(slot, r)
            await asyncio.sleep(0.01)
        for r in reqs:
            while not isinstance(await r.queue.get(), Finish):
                pass

    llama_cpp.llama_decode = recording
    try:
        asyncio.run(run())
    finally:
        llama_cpp.llama_decode = inner
        loop.stop()
    assert any(len(set(s)) > 1 for s in steps)  # sequences did share steps
    assert all(s == sorted(s) for s in steps), steps
