"""An engine that breaks HTTP on purpose, over a raw socket (aiohttp would refuse to).

The request's prompt, or its last message, `fault:NAME` picks what comes back; anything else
gets a well-formed one-token stream. `GET /health` is always 200.

    python -m tests.faulty_engine --port 9002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import orjson

OK_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)

# Response heads no engine should send; each must be a 502 for its request, nothing more.
BAD_HEADS: dict[str, bytes] = {
    "huge_head": b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * 100_000 + b"\r\n\r\n",
    "http2_status": b"HTTP/2 200\r\ncontent-length: 0\r\n\r\n",
    "two_digit_status": b"HTTP/1.1 20 OK\r\ncontent-length: 0\r\n\r\n",
    "header_without_colon": b"HTTP/1.1 200 OK\r\nthis is no header\r\n\r\n",
    "conflicting_length": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello"
    ),
    "negative_length": b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n",
    "non_utf8_header": b"HTTP/1.1 200 OK\r\nx-bad: \xff\xfe\r\ncontent-length: 0\r\n\r\n",
    "switching_protocols": (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    ),
}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def frame(text: str, chat: bool, finish: str | None = None) -> bytes:
    choice = (
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "finish_reason": finish}
    )
    return (
        b"data: "
        + orjson.dumps(
            {"id": "f-1", "object": "x", "created": 1, "model": "f", "choices": [choice]}
        )
        + b"\n\n"
    )


def fault_of(body: dict[str, object]) -> str:
    msgs = body.get("messages")
    text = msgs[-1].get("content") if isinstance(msgs, list) and msgs else body.get("prompt")
    if isinstance(text, str) and text.startswith("fault:"):
        return text[6:]
    return "ok"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        while True:
            head, raw = await read_request(reader)
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                continue
            body = orjson.loads(raw)
            chat = b"/chat/completions" in head.split(b"\r\n")[0]
            name = fault_of(body)
            if name in BAD_HEADS:
                writer.write(BAD_HEADS[name])
                await writer.drain()
                break
            if name == "ssh_banner":  # an engine URL pointing at an SSH server's port
                writer.write(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
                await writer.drain()
                writer.write(b"Invalid SSH identification string.\r\n")
                break
            if name == "trailing_bytes":  # a whole answer, then bytes nobody asked for
                writer.write(
                    OK_HEAD
                    + chunk(frame("hi", chat))
                    + chunk(frame("", chat, "stop"))
                    + chunk(b"data: [DONE]\n\n")
                    + b"0\r\n\r\nHTTP/1.1 200 OK\r\n"
                )
                await writer.drain()
                break
            if name == "stall_after_first":  # one token, then silence with the socket open
                writer.write(OK_HEAD + chunk(frame("hi", chat)))
                await writer.drain()
                await asyncio.sleep(3600)
            writer.write(
                OK_HEAD
                + chunk(frame("hi", chat))
                + chunk(frame("", chat, "stop"))
                + chunk(b"data: [DONE]\n\n")
                + b"0\r\n\r\n"
            )
            await writer.drain()
    writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    asyncio.run(serve(p.parse_args().port))


if __name__ == "__main__":
    main()
