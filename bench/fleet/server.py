"""N simulated GPU engines in one process, each on its own port, speaking the vLLM dialect.

    .venv/bin/python -m bench.fleet.server --engines 8 --port 9100 [--time-scale 2]
        [--prefill-tps 10000] [--step-base-ms 8] [--step-per-seq-ms 0.2]
        [--chunk-tokens 2048] [--kv-blocks 840] [--max-seqs 128]

What vLLM's OpenAI server does, as far as a router can see it: `/v1/chat/completions` and
`/v1/completions`, streamed one chunk per token (`stream_interval` 1) or whole;
`return_token_ids` puts `token_ids` on each choice and `prompt_token_ids` on the first
chunk; usage (with `prompt_tokens_details.cached_tokens`) when `stream_options.include_usage`
asks; a client that disconnects cancels its sequence. `/health`, `/v1/models`, and the
load endpoints peers poll (`/get_load`, `/metrics`). `/sim/stats` and `POST /sim/reset`
are the bench's own (prompt and cached token totals; cache and counters cleared).

`--time-scale k` runs every step k times slower: a 2-core machine then keeps up with the
chunks a fleet of GPUs would send; the replayer divides what it measures by k.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from typing import Any

import orjson
from aiohttp import web

from bench.fleet.gpu import Gpu, GpuModel, Seq, block_hashes

MAX_MODEL_LEN = 131_072
STOP_MARK = "stop@"  # a prompt's last word `stop@N`: the answer ends after N tokens


class SimEngine:
    def __init__(
        self, name: str, model: GpuModel, time_scale: float, jitter: float = 0.0, seed: int = 0
    ) -> None:
        self.name = name
        self.gpu = Gpu(model)
        self.scale = time_scale
        # Each step's time times a log-normal factor of this spread (median 1): kernels,
        # the host and the network do not keep time to the microsecond.
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.wake = asyncio.Event()
        self.ready: dict[Seq, asyncio.Event] = {}
        self.busy_s = 0.0
        self.lag_s = 0.0
        # Each admitted request's `x-request-id`, as the door forwarded it: an ID the fleet
        # saw twice is a request placed twice (two routers, or a retry after it was sent).
        self.request_ids: list[str] = []

    async def run(self) -> None:
        gpu = self.gpu
        while True:
            if gpu.idle:
                self.wake.clear()
                await self.wake.wait()
            dur, producing, prefill = gpu.plan()
            if not producing and not prefill:
                # Everything waits for KV room (or was cancelled): nothing to compute.
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.jitter:
                dur *= self.rng.lognormvariate(0.0, self.jitter)
            t0 = time.monotonic()
            await asyncio.sleep(dur * self.scale)
            # What this process's own load added to the step (its loop late to wake): the
            # simulated GPU ran slower than its model by this much.
            self.lag_s += time.monotonic() - t0 - dur * self.scale
            self.busy_s += dur
            gpu.finish_step(producing)
            for s in producing:
                ev = self.ready.get(s)
                if ev is not None:
                    ev.set()

    def submit(self, seq: Seq) -> asyncio.Event:
        ev = asyncio.Event()
        self.ready[seq] = ev
        self.gpu.submit(seq)
        self.wake.set()
        return ev

    def forget(self, seq: Seq) -> None:
        if not seq.done:
            seq.cancelled = True  # the scheduler drops it at its next step
            self.wake.set()
        self.ready.pop(seq, None)


def _prompt_words(body: dict[str, Any], chat: bool) -> list[str]:
    if chat:
        words: list[str] = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                words += c.split()
        return words
    p = body.get("prompt")
    return p.split() if isinstance(p, str) else []


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}},
        status=status,
    )


def make_app(engine: SimEngine) -> web.Application:
    created = int(time.time())

    async def completions(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON")
        words = _prompt_words(body, chat)
        if not words:
            return _error(400, "empty prompt")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        # The fair protocol's hidden length: the answer stops there (as at an EOS), which a
        # router cannot read from the request's max_tokens.
        if words[-1].startswith(STOP_MARK):
            with contextlib.suppress(ValueError):
                max_tokens = max(1, min(max_tokens, int(words[-1][len(STOP_MARK) :])))
        if len(words) + max_tokens > MAX_MODEL_LEN:
            return _error(400, f"prompt and output exceed {MAX_MODEL_LEN} tokens")
        model = engine.gpu.model
        seq = Seq(len(words), max_tokens, block_hashes(words, model.block_tokens))
        ids = bool(body.get("return_token_ids"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = bool(body.get("stream"))
        if rid := request.headers.get("x-request-id"):
            engine.request_ids.append(rid)
        ev = engine.submit(seq)
        writer = _Writer(chat, ids, created, engine.name)
        try:
            if not stream:
                while not seq.done:
                    await ev.wait()
                    ev.clear()
                return web.json_response(writer.whole(seq, words if ids else None))
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            sent = 0
            while sent < seq.max_tokens:
                await ev.wait()
                ev.clear()
                n = seq.generated - sent
                if n <= 0:
                    continue
                await resp.write(writer.tokens(seq, sent, n, words if ids else None))
                sent += n
            tail = writer.finish(seq, usage) + b"data: [DONE]\n\n"
            await resp.write(tail)
            await resp.write_eof()
            return resp
        finally:
            engine.forget(seq)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "main", "object": "model", "owned_by": "sim"}]}
        )

    async def load(_: web.Request) -> web.Response:
        return web.json_response({"load": engine.gpu.load})

    async def metrics(_: web.Request) -> web.Response:
        g = engine.gpu
        text = (
            f"vllm:num_requests_running {len(g.running)}\n"
            f"vllm:num_requests_waiting {len(g.waiting)}\n"
            f"vllm:prefix_cache_queries_total {g.prompt_tokens}\n"
            f"vllm:prefix_cache_hits_total {g.cached_tokens}\n"
            f"vllm:kv_cache_usage_perc {g.kv_usage}\n"
            f"vllm:num_preemptions_total {g.preemptions}\n"
            f'vllm:cache_config_info{{block_size="{g.model.block_tokens}",'
            f'num_gpu_blocks="{g.model.kv_blocks}"}} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def stats(_: web.Request) -> web.Response:
        g = engine.gpu
        return web.json_response(
            {
                "prompt_tokens": g.prompt_tokens,
                "cached_tokens": g.cached_tokens,
                "served": g.served,
                "busy_s": engine.busy_s,
                "lag_s": engine.lag_s,
                "running": len(g.running),
                "waiting": len(g.waiting),
                "preemptions": g.preemptions,
                "request_ids": engine.request_ids,
            }
        )

    async def reset(request: web.Request) -> web.Response:
        g = engine.gpu
        engine.busy_s = engine.lag_s = 0.0
        engine.request_ids = []
        if request.query.get("counters"):  # the counters only; the cache stays
            g.prompt_tokens = g.cached_tokens = g.served = g.preemptions = 0
            return web.json_response({"reset": "counters"})
        if not g.idle:
            return _error(409, "requests in flight")
        g.reset()
        return web.json_response({"reset": True})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/sim/reset", reset)
    return app


_IDS = list(range(100, 100 + MAX_MODEL_LEN))


def _prompt_ids(n: int) -> list[int]:
    # Any valid IDs do: what matters is their count and the bytes they take on the wire.
    # Made without a per-word hash, which would stall every engine of this one process.
    return _IDS[:n]


class _Writer:
    """vLLM's stream frames, one per token."""

    def __init__(self, chat: bool, ids: bool, created: int, name: str) -> None:
        self.chat = chat
        self.ids = ids
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{name}-{time.monotonic_ns()}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": "main",
        }

    def _frame(self, choice: dict[str, Any], **top: Any) -> bytes:
        return b"data: " + orjson.dumps({**self.head, "choices": [choice], **top}) + b"\n\n"

    def _choice(self, text: str, token: int | None, finish: str | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if self.chat:
            c["delta"] = {"content": text}
        else:
            c["text"] = text
        c["logprobs"] = None
        c["finish_reason"] = finish
        if self.ids and token is not None:
            c["token_ids"] = [token]
        return c

    def tokens(self, seq: Seq, sent: int, n: int, words: list[str] | None) -> bytes:
        out = []
        for i in range(sent, sent + n):
            top: dict[str, Any] = {}
            if i == 0 and words is not None:
                top["prompt_token_ids"] = _prompt_ids(len(words))
            out.append(self._frame(self._choice(f"t{i} ", 1000 + i % 30000), **top))
        return b"".join(out)

    def finish(self, seq: Seq, usage: bool) -> bytes:
        last = self._frame(self._choice("", None, "length"))
        if not usage:
            return last
        u = {
            "prompt_tokens": seq.prompt_tokens,
            "completion_tokens": seq.generated,
            "total_tokens": seq.prompt_tokens + seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
        }
        return last + b"data: " + orjson.dumps({**self.head, "choices": [], "usage": u}) + b"\n\n"

    def whole(self, seq: Seq, words: list[str] | None) -> dict[str, Any]:
        text = "".join(f"t{i} " for i in range(seq.generated))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            **self.head,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": [choice],
            "usage": {
                "prompt_tokens": seq.prompt_tokens,
                "completion_tokens": seq.generated,
                "total_tokens": seq.prompt_tokens + seq.generated,
                "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
            },
        }
        if words is not None:
            out["prompt_token_ids"] = _prompt_ids(len(words))
        return out


def model_from(a: argparse.Namespace) -> GpuModel:
    return GpuModel(
        step_base_s=a.step_base_ms / 1000,
        step_per_seq_s=a.step_per_seq_ms / 1000,
        prefill_tps=a.prefill_tps,
        chunk_tokens=a.chunk_tokens,
        block_tokens=a.block_tokens,
        kv_blocks=a.kv_blocks,
        max_seqs=a.max_seqs,
        prefill_half_context=a.prefill_half_context,
        kv_on_demand=a.kv_on_demand,
    )


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    d = GpuModel()
    ap.add_argument("--step-base-ms", type=float, default=d.step_base_s * 1000)
    ap.add_argument("--step-per-seq-ms", type=float, default=d.step_per_seq_s * 1000)
    ap.add_argument("--prefill-tps", type=float, default=d.prefill_tps)
    ap.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens)
    ap.add_argument("--block-tokens", type=int, default=d.block_tokens)
    ap.add_argument("--kv-blocks", type=int, default=d.kv_blocks)
    ap.add_argument("--max-seqs", type=int, default=d.max_seqs)
    ap.add_argument(
        "--prefill-half-context",
        type=float,
        default=d.prefill_half_context,
        help="the context at which prefill runs at half its rate (0: one rate; the H200 "
        "calibration: ~12000)",
    )
    ap.add_argument(
        "--kv-on-demand",
        action="store_true",
        help="KV blocks taken as output grows, the last admitted preempted when the pool "
        "runs out (vLLM); default: prompt and max_tokens reserved at admission",
    )
    ap.add_argument("--jitter", type=float, default=0.0, help="log-normal spread of step times")
    ap.add_argument(
        "--speeds",
        default="",
        help="each engine's speed, comma-separated, repeated over the fleet (1,1,0.5: every "
        "third engine half as fast); empty: all 1",
    )


async def serve(
    n: int,
    port: int,
    model: GpuModel,
    scale: float,
    host: str = "127.0.0.1",
    jitter: float = 0.0,
    speeds: tuple[float, ...] = (),
) -> None:
    runners = []
    tasks = []
    for i in range(n):
        own = dataclasses.replace(model, speed=speeds[i % len(speeds)]) if speeds else model
        engine = SimEngine(f"e{i}", own, scale, jitter, seed=i)
        tasks.append(asyncio.create_task(engine.run()))
        # A client that leaves cancels its handler (aiohttp no longer does by default since
        # 3.9): its sequence is dropped even while it waits for KV room, as vLLM aborts a
        # request whose client disconnected, and a fair protocol's clients do leave.
        runner = web.AppRunner(make_app(engine), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, port + i, backlog=1024).start()
        runners.append(runner)
    print(f"{n} simulated engines on {host}:{port}..{port + n - 1}", flush=True)
    try:
        await asyncio.gather(*tasks)
    finally:
        for r in runners:
            with contextlib.suppress(Exception):
                await r.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--time-scale", type=float, default=1.0)
    add_model_flags(ap)
    a = ap.parse_args()
    # Peers probe with HTTP/2 prior knowledge first; aiohttp logs each refusal with a stack.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    speeds = tuple(float(x) for x in a.speeds.split(",") if x)
    asyncio.run(
        serve(a.engines, a.port, model_from(a), a.time_scale, jitter=a.jitter, speeds=speeds)
    )


if __name__ == "__main__":
    main()
