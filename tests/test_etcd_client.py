"""narwhal/etcd.py against endpoints that misbehave: every failure is an EtcdError."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from narwhal.etcd import Etcd, EtcdError


async def _silent_endpoint() -> tuple[asyncio.AbstractServer, str]:
    """An endpoint that accepts and never answers (etcd stalled, a black-holed route)."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, family=socket.AF_INET)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_a_stalled_endpoint_is_an_etcd_error_on_every_python() -> None:
    # On 3.10 aiohttp's timeout is asyncio.TimeoutError, not the built-in TimeoutError:
    # a catch of the latter let it through and killed the loop that called.
    async def main() -> None:
        server, url = await _silent_endpoint()
        etcd = Etcd([url], timeout_s=0.3)
        try:
            with pytest.raises(EtcdError, match="TimeoutError"):
                await etcd.get(b"/k")
        finally:
            await etcd.close()
            server.close()

    asyncio.run(main())


async def _answering(body: bytes) -> tuple[asyncio.AbstractServer, str]:
    """An endpoint that answers every call 200 with `body` (a proxy, a different service)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, family=socket.AF_INET)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "body",
    [b"{}", b'{"ID": "not a number"}', b"[]", b'{"kvs": [{"value": "@@@"}]}', b'{"kvs": 7}'],
)
def test_an_answer_that_is_not_etcd_s_is_an_etcd_error(body: bytes) -> None:
    # A KeyError or ValueError here used to escape `except EtcdError` and end the loop that
    # called (leadership, the wave follower, the engine's fence follower).
    async def main() -> None:
        server, url = await _answering(body)
        etcd = Etcd([url], timeout_s=2)
        try:
            for call in (
                etcd.grant(5),
                etcd.get(b"/k"),
                etcd.create(b"/k", b"v", 1),
                etcd.under(b"/k"),
            ):
                with contextlib.suppress(EtcdError):  # and nothing else
                    await call
        finally:
            await etcd.close()
            server.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "body",
    [
        b"{}",  # acknowledged, then the stream ended
        b'{"result": {"events": [{"kv": {"value": "@@@"}}]}}\n',
        b'{"result": {"events": 7}}\n',
        b'{"result": {"canceled": true, "cancel_reason": "compacted"}}\n',
        b"not json\n",
    ],
)
def test_a_watch_stream_that_is_not_etcd_s_is_an_etcd_error(body: bytes) -> None:
    async def main() -> None:
        server, url = await _answering(body)
        etcd = Etcd([url], timeout_s=2)
        try:
            with pytest.raises(EtcdError):
                async for _ in etcd.watch(b"/k", 1):
                    pass
        finally:
            await etcd.close()
            server.close()

    asyncio.run(main())
