"""Realistic streams cut into network-sized chunks, shared by the benches."""

from __future__ import annotations

from tests.streams import chat_stream, completion_stream, sse, tool_stream


def chunks(data: bytes, size: int = 1400) -> list[bytes]:
    # ~one TCP segment per read, the size an upstream socket read usually hands over
    return [data[i : i + size] for i in range(0, len(data), size)]


CHAT_2000 = chat_stream(2000, token_ids=True)
REASONING = chat_stream(2000, token_ids=True, reasoning=True)
TOOLS = tool_stream() * 1
COMPLETION_LP = completion_stream(2000, logprobs=True)

WORKLOADS = {
    "chat-2000-token-ids": (CHAT_2000, "chat", chunks(sse(CHAT_2000))),
    "reasoning-2000": (REASONING, "chat", chunks(sse(REASONING))),
    "tool-calls": (TOOLS, "chat", chunks(sse(TOOLS))),
    "completion-logprobs-2000": (COMPLETION_LP, "completion", chunks(sse(COMPLETION_LP))),
}
