"""A scripted engine speaking real HTTP/SSE in an OpenAI/vLLM/LexiEngine shape.

The router tests drive it through the request itself: the last message (or the prompt)
`script:NAME[:ARG]` picks a behaviour. `GET /stats` tells what the engine saw.

    python -m tests.scripted_engine --port 9001 [--dialect lexi|openai]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import orjson
from aiohttp import web

PREFILL_LOCK = asyncio.Lock()
STATS: dict[str, Any] = {
    "ms_per_token": 0.0,
    "requests": 0,
    "disconnects": 0,
    "last": None,
    "healthy": True,
    "active": 0,
    "connections": 0,
    "busy": False,
    "fences": [],
    "fence_secrets": [],  # beside each fence, the secret that came with it (or None)
    "authorizations": [],  # each completion's Authorization header, in arrival order
}
# Client ports that sent completion requests: how many connections the router opened.
PEERS: set[Any] = set()
# `script:held` answers one token and then waits for `POST /release`: a test that needs a
# seat taken holds it for as long as it takes, whatever the machine's speed.
RELEASED: list[asyncio.Event] = []


def _released() -> asyncio.Event:
    if not RELEASED:
        RELEASED.append(asyncio.Event())
    return RELEASED[0]


def _script(body: dict[str, Any]) -> tuple[str, str]:
    if "messages" in body:
        text = body["messages"][-1].get("content") or ""
    else:
        text = body.get("prompt") or ""
    if isinstance(text, str) and text.startswith("script:"):
        name, _, arg = text[7:].partition(":")
        return name, arg
    return "echo", ""


def _prompt_tokens(body: dict[str, Any]) -> int:
    text = body["messages"][-1]["content"] if "messages" in body else body.get("prompt", "")
    return max(1, len(text) // 4)


def _frame(
    body: dict[str, Any],
    chat: bool,
    piece: dict[str, Any] | None,
    ids: list[Any] | None,
    finish: str | None = None,
    **top: Any,
) -> bytes:
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": piece or {},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {
            "index": 0,
            "text": (piece or {}).get("content", ""),
            "logprobs": None,
            "finish_reason": finish,
        }
    if ids is not None and body.get("return_token_ids"):
        choice["token_ids"] = ids
    frame = {
        "id": "x-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": "scripted",
        "choices": [choice],
        **top,
    }
    return b"data: " + orjson.dumps(frame) + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    STATS["requests"] += 1
    STATS["last"] = body
    STATS["last_request_id"] = request.headers.get("x-request-id")
    STATS["last_traceparent"] = request.headers.get("traceparent")
    if len(STATS["authorizations"]) < 1000:
        STATS["authorizations"].append(request.headers.get("authorization"))
    fence = request.headers.get("x-narwhal-fence")
    if fence is not None and len(STATS["fences"]) < 100_000:
        STATS["fences"].append(fence)  # in arrival order: who placed, as the engine saw it
        STATS["fence_secrets"].append(request.headers.get("x-narwhal-fence-secret"))
    PEERS.add(request.transport.get_extra_info("peername") if request.transport else None)
    STATS["connections"] = len(PEERS)
    chat = request.path.endswith("chat/completions")
    name, arg = _script(body)
    if STATS["busy"]:
        name, arg = "status", "429"
    if name == "status":
        return web.json_response(
            {"error": {"message": "engine says no", "type": "x", "param": "grammar", "code": None}},
            status=int(arg),
            headers={"retry-after": "1"} if arg == "429" else None,
        )
    if name == "slow_first":
        await asyncio.sleep(int(arg) / 1000)
    if name == "prefill_serial":
        # Compute-bound prefill: one prompt at a time, as on a busy accelerator.
        async with PREFILL_LOCK:
            await asyncio.sleep(_prompt_tokens(body) * float(arg.split(":")[0]) / 1000)
    if name == "prefill":
        # A prompt of N tokens (4 bytes each) takes N * ARG ms before the first token, after
        # the engine's fixed cost of a request (--prefill-fixed-ms).
        per_token = int(arg.split(":")[0])
        await asyncio.sleep((STATS["fixed_ms"] + _prompt_tokens(body) * per_token) / 1000)
    elif name != "prefill_serial" and STATS["ms_per_token"]:
        await asyncio.sleep(_prompt_tokens(body) * STATS["ms_per_token"] / 1000)
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    STATS["active"] += 1
    try:
        await _script_body(resp, body, chat, name, arg)
    except (ConnectionResetError, asyncio.CancelledError):
        STATS["disconnects"] += 1
        raise
    finally:
        STATS["active"] -= 1
    return resp


async def _script_body(
    resp: web.StreamResponse, body: dict[str, Any], chat: bool, name: str, arg: str
) -> None:
    w = resp.write
    prompt = list(range(_prompt_tokens(body)))
    first_top = {"prompt_token_ids": prompt} if body.get("return_token_ids") and chat else {}
    await w(
        _frame(body, chat, {"role": "assistant", "content": ""} if chat else None, [], **first_top)
    )
    n = int(arg) if name == "echo" and arg else 4
    pace = 0.0
    if name == "paced":  # paced:N:MS, N tokens MS apart, as a decoding engine emits them
        count, _, ms = arg.partition(":")
        n, pace = int(count), float(ms or 0) / 1000
    if name == "missing_ids":
        await w(_frame(body, chat, {"content": "a"}, None))
    elif name == "bool_ids":
        await w(_frame(body, chat, {"content": "a"}, [True]))
    elif name == "die":
        await w(_frame(body, chat, {"content": "partial"}, [7]))
        await asyncio.sleep(0.05)
        resp.force_close()
        assert resp._payload_writer is not None
        resp._payload_writer.transport.close()  # type: ignore[union-attr]
        return
    elif name == "held":
        await w(_frame(body, chat, {"content": "held "}, [7]))
        await _released().wait()
    elif name == "hang":
        await w(_frame(body, chat, {"content": "wait"}, [7]))
        for _ in range(600):
            await asyncio.sleep(0.05)
            await w(b": keepalive\n\n")
        return
    elif name == "audio":
        await w(_frame(body, chat, {"content": "x", "audio": {"data": "AAAA"}}, [5]))
    elif name == "tools":
        for idx, fn in ((0, "f"), (1, "g")):
            await w(
                _frame(
                    body,
                    chat,
                    {
                        "tool_calls": [
                            {
                                "index": idx,
                                "id": f"call_{idx}",
                                "type": "function",
                                "function": {"name": fn, "arguments": '{"a"'},
                            }
                        ]
                    },
                    [10 + idx],
                )
            )
            await w(
                _frame(
                    body,
                    chat,
                    {"tool_calls": [{"index": idx, "function": {"arguments": ": 1}"}}]},
                    [20 + idx],
                )
            )
        await w(_frame(body, chat, None, [], finish="tool_calls"))
        await w(b"data: [DONE]\n\n")
        return
    elif name == "error_event":  # as LexiEngine ends a stream it cannot finish: no [DONE]
        await w(_frame(body, chat, {"content": "a"}, [7]))
        await w(
            b'data: {"error": {"message": "no tool call came", "type": '
            b'"invalid_response_error", "param": "tool_choice", '
            b'"code": "tool_call_invalid"}}\n\n'
        )
        return
    elif name == "error_event_bare":  # vLLM's shape: a numeric code, no param
        await w(_frame(body, chat, {"content": "a"}, [7]))
        await w(
            b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
        )
        return
    elif name == "reasoning":
        await w(_frame(body, chat, {"reasoning_content": "hmm"}, [3]))
        await w(_frame(body, chat, {"content": "ok"}, [4]))
    else:
        for i in range(n):
            await w(_frame(body, chat, {"content": f"w{i} "}, [100 + i]))
            if name == "slow":
                await asyncio.sleep(0.02)
            elif pace:
                await asyncio.sleep(pace)
    await w(_frame(body, chat, None, [], finish="stop"))
    if name == "usage_late":
        await asyncio.sleep(0.05)  # the usage frame arrives in a read of its own
    if (body.get("stream_options") or {}).get("include_usage") and name != "no_usage":
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        frame = {
            "id": "x-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "scripted",
            "choices": [],
            "usage": usage,
        }
        await w(b"data: " + orjson.dumps(frame) + b"\n\n")
    await w(b"data: [DONE]\n\n")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": STATS["healthy"]}, status=200 if STATS["healthy"] else 503)


async def set_health(request: web.Request) -> web.Response:
    STATS["healthy"] = (await request.json())["healthy"]
    return web.json_response({})


async def release(request: web.Request) -> web.Response:
    _released().set()
    return web.json_response({})


async def models(request: web.Request) -> web.Response:
    """What it serves, as vLLM lists its base model and loaded adapters."""
    listed = [{"id": m, "object": "model", "owned_by": "scripted"} for m in STATS["models"]]
    return web.json_response({"object": "list", "data": listed})


async def set_models(request: web.Request) -> web.Response:
    """Load or unload models (`["base", "base-lora"]`): what /v1/models lists from now on."""
    STATS["models"] = list(await request.json())
    return web.json_response({})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(STATS)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=0.0,
        help="prefill cost of every request (4 prompt bytes make a token)",
    )
    p.add_argument(
        "--prefill-fixed-ms",
        type=float,
        default=0.0,
        help="with script:prefill, what every prompt costs beside its tokens (a GPU's first "
        "step, the scheduler)",
    )
    p.add_argument(
        "--busy",
        action="store_true",
        help="answer every completion 429 inference_busy (with Retry-After)",
    )
    p.add_argument("--models", default="scripted", help="what /v1/models lists, comma-separated")
    args = p.parse_args()
    STATS["models"] = args.models.split(",")
    STATS["ms_per_token"] = args.prefill_ms_per_token
    STATS["busy"] = args.busy
    STATS["fixed_ms"] = args.prefill_fixed_ms
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/models", set_models)
    app.router.add_post("/health", set_health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/release", release)
    # A deep accept queue: benches open hundreds of connections at once.
    web.run_app(app, host=args.host, port=args.port, print=None, backlog=2048)


if __name__ == "__main__":
    main()
