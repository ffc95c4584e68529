"""The flow and the placer on their own, in process: the router's real stages wired as
`narwhal serve` wires them, no router socket (engines, where one is called, are real HTTP
servers in the test's loop). Each way a request ends is one row of `router/endings.py`,
counted once: `narwhal_finished_total` adds up to `narwhal_offered_total`, and a refusal
lands in its counter under its own label."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from narwhal import asgi
from narwhal.errors import ApiError
from narwhal.router.app import Router
from narwhal.router.config import parse
from narwhal.router.ha.leadership import Role
from tests.support import measured

BUDGET_S = 1.0


def router() -> Router:
    r = Router(
        parse(
            {
                "model": "main",
                "engines": [{"name": "a", "url": "http://127.0.0.1:9"}],
                "admission": "predictive",
                "predictive": {"ttft_budget_s": BUDGET_S},
            }
        )
    )
    for e in r.pool.engines:
        e.healthy = True
    assert r.predictor is not None
    for p in r.predictor.profiles.values():
        measured(p, 1000.0, 4.0)  # 1,000 tokens a second, 4 bytes a token
        p.measured_at = time.monotonic()
    return r


def call(r: Router, body: bytes) -> ApiError:
    """One chat completion through the flow; the error it ended with."""
    scope: dict[str, Any] = {"type": "http", "method": "POST", "headers": []}
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if sent:  # the body went: the client then waits (and stays)
            await asyncio.sleep(3600)
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is sent by a request that ends here: {message}")

    with pytest.raises(ApiError) as e:
        asyncio.run(r.flow("/v1/chat/completions", scope, receive, send))
    return e.value


def chat(words: int) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "word " * words}]})


def sample(r: Router, name: str, **labels: str) -> float:
    value = r.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


def finished(r: Router) -> dict[str, float]:
    out = {}
    for metric in r.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "narwhal_finished_total" and s.value:
                out[s.labels["outcome"]] = s.value
    return out


def test_each_way_a_request_ends_before_an_engine_is_counted_once_under_its_row() -> None:
    r = router()
    e = call(r, b"{not json")
    assert (e.status, finished(r)) == (400, {"invalid": 1.0})
    assert sample(r, "narwhal_invalid_requests_total") == 1

    e = call(r, chat(2000))  # 10 kB: 2,500 tokens, 2.5 s alone at 1,000 a second
    assert (e.status, e.code) == (429, "prompt_exceeds_ttft_budget")
    assert finished(r) == {"invalid": 1.0, "refused": 1.0}
    refused = ("narwhal_refused_total", {"reason": "prompt_exceeds_ttft_budget", "model": "main"})
    assert sample(r, refused[0], **refused[1]) == 1

    r.admission.retained = r.admission.retention_limit  # the router holds all it may
    e = call(r, chat(10))
    assert (e.status, e.code) == (429, "retention_full")
    assert sample(r, "narwhal_rejected_total", reason="retention", model="main") == 1
    r.admission.retained = 0

    r.leadership.role, r.leadership.reason = Role.STANDBY, "standby: another router leads"
    e = call(r, chat(10))
    assert (e.status, e.code) == (503, "standby")
    assert sample(r, "narwhal_rejected_total", reason="standby", model="main") == 1

    # Every request offered ended exactly once, whatever ended it.
    assert sum(finished(r).values()) == sample(r, "narwhal_offered_total") == 4
    assert finished(r) == {"invalid": 1.0, "refused": 1.0, "rejected": 2.0}
    assert r.admission.retained == 0  # retention given back on every way out


async def engine(status: int) -> tuple[web.AppRunner, str, list[int]]:
    """An engine in the OpenAI dialect, in process (real HTTP): it answers every completion
    `status` (429 with its own body and Retry-After), or a two-token stream."""
    seen: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(status)
        if status != 200:
            return web.json_response(
                {"error": {"message": "engine busy", "type": "x", "param": None, "code": None}},
                status=status,
                headers={"retry-after": "3"},
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b"):
            frame = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            frame["choices"] = [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]
            await resp.write(b"data: " + orjson.dumps(frame) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    runner, url = await serve(completions)
    return runner, url, seen


async def serve(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    """An engine's chat completions route, served in process (real HTTP): its runner, URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize("second", [200, 429])
def test_placement_takes_another_engine_when_one_answers_429(second: int) -> None:
    """The placer, in process with the router's real relay: an engine's 429 sends the
    request to another; where every engine answers 429, the last one's answer is the
    client's, as the engine sent it, and the request ends `rejected{engine_busy}`."""

    async def go() -> tuple[list[Any], Router, list[int], list[int]]:
        (busy, busy_url, busy_seen), (other, other_url, other_seen) = (
            await engine(429),
            await engine(second),
        )
        r = Router(
            parse(
                {
                    "model": "main",
                    "admission": "open",
                    "engines": [
                        {"name": "a", "url": busy_url, "dialect": "openai"},
                        {"name": "b", "url": other_url, "dialect": "openai"},
                    ],
                }
            )
        )
        for e in r.pool.engines:
            e.healthy = True
        sent: list[Any] = []
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        got = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if got.is_set():
                await asyncio.sleep(3600)
            got.set()
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope: dict[str, Any] = {"type": "http", "method": "POST", "headers": []}
        try:
            await r.flow("/v1/chat/completions", scope, receive, send)
        finally:
            r.relayer.close()
            await busy.cleanup()
            await other.cleanup()
        return sent, r, busy_seen, other_seen

    sent, r, busy_seen, other_seen = asyncio.run(go())
    assert busy_seen == [429] and other_seen == [second]  # each asked once, a first
    status = sent[0]["status"]
    text = b"".join(m.get("body", b"") for m in sent)
    if second == 200:
        assert status == 200 and b'"a"' in text and b"[DONE]" in text
        assert finished(r) == {"completed": 1.0}
    else:
        assert status == 429 and b"engine busy" in text
        assert (b"retry-after", b"3") in sent[0]["headers"]
        assert finished(r) == {"rejected": 1.0}
        assert sample(r, "narwhal_rejected_total", reason="engine_busy", model="main") == 1


def test_a_refusals_access_line_says_how_near_it_came() -> None:
    r = router()
    (e,) = r.pool.engines
    e.prefill, e.prefill_tokens = 1, 900  # 0.9 s of prefill ahead on the one engine
    prof = r.predictor.profiles["a"] if r.predictor is not None else None
    assert prof is not None
    prof.drift, prof.drift_samples = 0.15, 5  # its projections miss by about 16 % either way
    rec = asgi.Record("near")
    token = asgi.current.set(rec)
    try:
        err = call(r, chat(18))  # 90 bytes: 23 tokens, 0.02 s alone
    finally:
        asgi.current.reset(token)
    assert (err.status, err.code) == (429, "ttft_budget_exceeded")
    f = rec.fields
    assert f["outcome"] == "refused" and f["reason"] == "ttft_budget_exceeded"
    # Under the budget as projected, over it as widened by the margin: refused for the margin.
    assert f["projected_ms"] < 1000 * BUDGET_S < f["guarded_ms"]
    assert 0 < f["own_ms"] < f["projected_ms"]
    # Where it came nearest, and what it would have prefilled there.
    assert f["nearest_engine"] == "a" and f["tokens_sized"] == 23

    rec = asgi.Record("alone")
    token = asgi.current.set(rec)
    try:
        err = call(r, chat(2000))
    finally:
        asgi.current.reset(token)
    assert err.code == "prompt_exceeds_ttft_budget"
    assert rec.fields["alone_ms"] > 1000 * BUDGET_S


class _SentAtCall:
    """What Granian's `send` returns: an awaitable that did its work when called (so the
    router relays the stream natively, from the engine socket's read callback)."""

    def __await__(self) -> Any:
        return iter(())


@pytest.mark.parametrize("ending", ["completed", "stream_fault"])
def test_a_client_that_hangs_up_once_the_answer_is_whole_does_not_change_its_outcome(
    ending: str,
) -> None:
    """The client reads the stream's last bytes and closes at once: its disconnect reaches
    the router before the request's task wakes to the stream's end. The request ended as
    its answer did (completed, or a fault the client was told of), not `client_gone`."""

    async def go() -> tuple[list[Any], Router]:
        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            frame = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            frame["choices"] = [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]
            await resp.write(b"data: " + orjson.dumps(frame) + b"\n\n")
            await relayed.wait()  # the rest comes once the stream is relayed natively
            if ending == "completed":
                await resp.write(b"data: [DONE]\n\n")
            else:
                await over.wait()  # nothing more: the router's deadline ends it
            return resp

        relayed, over = asyncio.Event(), asyncio.Event()

        runner, url = await serve(completions)
        r = Router(
            parse(
                {
                    "model": "main",
                    "admission": "open",
                    "engines": [{"name": "a", "url": url, "dialect": "openai"}],
                }
            )
        )
        for e in r.pool.engines:
            e.healthy = True
        sent: list[Any] = []
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        read, gone = asyncio.Event(), asyncio.Event()

        async def receive() -> dict[str, Any]:
            if read.is_set():
                await gone.wait()
                return {"type": "http.disconnect"}
            read.set()
            return {"type": "http.request", "body": body, "more_body": False}

        def send(message: dict[str, Any]) -> _SentAtCall:
            sent.append(message)
            if message["type"] == "http.response.body":
                relayed.set()
                if not message.get("more_body"):
                    gone.set()  # the client has it all, and hangs up
            return _SentAtCall()

        # A deadline only where the router's deadline is what ends the stream: a completed
        # one must not race it on a busy machine.
        deadline = [(b"x-narwhal-timeout-ms", b"300")] if ending == "stream_fault" else []
        scope: dict[str, Any] = {"type": "http", "method": "POST", "headers": deadline}
        try:
            await r.flow("/v1/chat/completions", scope, receive, send)
        finally:
            over.set()
            r.relayer.close()
            await runner.cleanup()
        return sent, r

    sent, r = asyncio.run(go())
    text = b"".join(m.get("body", b"") for m in sent)
    assert sent[0]["status"] == 200 and b'"a"' in text
    if ending == "completed":
        assert text.endswith(b"data: [DONE]\n\n")
    else:
        assert b"deadline_exceeded" in text
    assert sample(r, "narwhal_relayed_streams_total", path="native") == 1
    assert finished(r) == {ending: 1.0}
