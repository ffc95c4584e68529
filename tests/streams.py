"""Realistic OpenAI-shaped engine streams (the shapes vLLM and LexiEngine send)."""

from __future__ import annotations

import orjson

WORDS = [
    "The",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " the",
    " lazy",
    " dog",
    ".",
    " Ça",
    " va",
    " 🙂",
    "\n",
]


def sse(frames: list[str]) -> bytes:
    return b"".join(b"data: " + f.encode() + b"\n\n" for f in frames)


def _chunk(choice: dict[str, object], **top: object) -> str:
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "main",
            **top,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}],
        }
    ).decode()


def chat_stream(n: int, token_ids: bool = True, reasoning: bool = False) -> list[str]:
    ids = {"token_ids": []} if token_ids else {}
    first = _chunk(
        {"delta": {"role": "assistant", "content": ""}, **ids},
        **({"prompt_token_ids": list(range(40))} if token_ids else {}),
    )
    frames = [first]
    for i in range(n):
        field = "reasoning_content" if reasoning and i < n // 2 else "content"
        extra = {"token_ids": [1000 + i]} if token_ids else {}
        frames.append(_chunk({"delta": {field: WORDS[i % len(WORDS)]}, **extra}))
    frames.append(_chunk({"delta": {}, "finish_reason": "stop", **ids}))
    frames.append(
        orjson.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1700000000,
                "model": "main",
                "choices": [],
                "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n},
            }
        ).decode()
    )
    frames.append("[DONE]")
    return frames


def tool_stream() -> list[str]:
    frames = [_chunk({"delta": {"role": "assistant", "content": "Checking."}})]
    # Arguments arrive a few characters per token, as engines stream them; a file-editing
    # call's arguments run to hundreds of tokens.
    edit = orjson.dumps({"path": "src/lib.rs", "content": "fn main() {}\n" * 40}).decode()
    for idx, name, args in ((0, "get_weather", '{"city": "Paris"}'), (1, "edit_file", edit)):
        frames.append(
            _chunk(
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": idx,
                                "id": f"call_{idx}",
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                }
            )
        )
        for k in range(0, len(args), 4):
            frames.append(
                _chunk(
                    {
                        "delta": {
                            "tool_calls": [
                                {"index": idx, "function": {"arguments": args[k : k + 4]}}
                            ]
                        }
                    }
                )
            )
    frames.append(_chunk({"delta": {}, "finish_reason": "tool_calls"}))
    frames.append("[DONE]")
    return frames


def completion_stream(n: int, logprobs: bool = False, token_ids: bool = False) -> list[str]:
    frames = []
    off = 0
    for i in range(n):
        w = WORDS[i % len(WORDS)]
        choice: dict[str, object] = {"index": 0, "text": w, "finish_reason": None, "logprobs": None}
        if logprobs:
            choice["logprobs"] = {
                "tokens": [w],
                "token_logprobs": [-0.5],
                "top_logprobs": [{w: -0.5}],
                "text_offset": [off],
            }
        if token_ids:
            choice["token_ids"] = [2000 + i]
        off += len(w)
        frames.append(
            orjson.dumps(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 1700000000,
                    "model": "main",
                    "choices": [choice],
                }
            ).decode()
        )
    frames.append(
        orjson.dumps(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1700000000,
                "model": "main",
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
            }
        ).decode()
    )
    frames.append("[DONE]")
    return frames
