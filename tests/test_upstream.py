"""The router's upstream HTTP/1.1 client against a raw socket server that answers each
request with the bytes a test scripts: keep-alive reuse, the stale-connection retry,
malformed framing, close-delimited bodies and a terminating chunk that arrives late."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from narwhal.router.connection import UpstreamError
from narwhal.router.upstream import Upstream

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked(*parts: bytes) -> bytes:
    return CHUNKED_HEAD + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


# An answer gets (connection number, request number on it, writer) and writes the
# response; returning False closes the connection.
Answer = Callable[[int, int, asyncio.StreamWriter], Awaitable[bool]]


class RawServer:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                n += 1
                keep = await self.answer(conn, n, writer)
                await writer.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@contextlib.asynccontextmanager
async def serving(answer: Answer) -> AsyncIterator[tuple[RawServer, Upstream]]:
    raw = RawServer(answer)
    server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream(f"http://127.0.0.1:{port}/prefix/")
    try:
        yield raw, up
    finally:
        up.close()
        server.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


async def fetch(up: Upstream, body: bytes = b"{}") -> tuple[int, bytes]:
    ex = await up.request("/v1/chat/completions", body)
    data = await ex.read_all()
    ex.release(True)
    return ex.status, data


def test_sequential_requests_reuse_one_connection() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(chunked(b"data: a\n\n", b"data: [DONE]\n\n"))
        return True

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            for _ in range(5):
                assert await fetch(up, b'{"x":1}') == (200, b"data: a\n\ndata: [DONE]\n\n")
            assert raw.connections == 1
            assert raw.requests[0].startswith(b"POST /prefix/v1/chat/completions HTTP/1.1\r\n")
            assert raw.requests[0].endswith(b'\r\n\r\n{"x":1}')

    run(scenario)


def test_a_connection_the_engine_dropped_while_idle_is_retried_on_a_fresh_one() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        if n == 2:  # the engine's keep-alive timer fired just as the request came in
            return False
        w.write(chunked(b"data: ok\n\n"))
        return True

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            assert await fetch(up) == (200, b"data: ok\n\n")
            assert await fetch(up) == (200, b"data: ok\n\n")
            assert raw.connections == 2

    run(scenario)


def test_a_fresh_connection_that_breaks_is_an_error_not_a_retry() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        return False

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            with pytest.raises(UpstreamError):
                await fetch(up)
            assert raw.connections == 1

    run(scenario)


def test_malformed_chunking_and_a_cut_body_are_errors() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        if conn == 1:
            w.write(CHUNKED_HEAD + b"zz\r\nnot hex\r\n")
        else:
            w.write(CHUNKED_HEAD + b"20\r\nonly part")
        return False

    async def scenario() -> None:
        async with serving(answer) as (_raw, up):
            for _ in range(2):
                ex = await up.request("/x", b"{}")
                with pytest.raises(UpstreamError):
                    await ex.read_all()
                ex.release(False)
            assert up.connections == 0

    run(scenario)


def test_length_and_close_delimited_bodies() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        if conn == 1:
            w.write(
                b"HTTP/1.1 429 Too Many\r\ncontent-type: application/json\r\n"
                b'content-length: 7\r\nconnection: close\r\n\r\n{"e":1}'
            )
            return False
        w.write(b"HTTP/1.0 200 OK\r\n\r\nuntil close")
        return False

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            ex = await up.request("/x", b"{}")
            assert (ex.status, ex.content_type) == (429, "application/json")
            assert await ex.read_all() == b'{"e":1}'
            ex.release(True)
            assert await fetch(up) == (200, b"until close")
            assert raw.connections == 2

    run(scenario)


def test_a_late_terminating_chunk_is_drained_and_the_connection_reused() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED_HEAD + b"e\r\ndata: [DONE]\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")
        return True

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            for _ in range(2):
                ex = await up.request("/x", b"{}")
                assert await ex.read() == b"data: [DONE]\n\n"
                ex.release(True)  # the relay saw [DONE]; the response's end is on its way
                await asyncio.sleep(0.2)
            assert raw.connections == 1
            assert up.connections == 1

    run(scenario)


def test_an_abandoned_exchange_closes_its_connection() -> None:
    gone = asyncio.Event()

    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
        for _ in range(250):  # an engine still generating
            await asyncio.sleep(0.02)
            try:
                w.write(b"1\r\nx\r\n")
                await w.drain()
            except ConnectionError:
                gone.set()
                break
        return False

    async def scenario() -> None:
        async with serving(answer) as (_raw, up):
            ex = await up.request("/x", b"{}")
            assert (await ex.read()).startswith(b"hello")
            ex.release(False)  # the client went away
            await asyncio.wait_for(gone.wait(), 5)
            assert up.connections == 0

    run(scenario)


def test_the_deadline_bounds_the_wait_for_the_head() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(1)
        return False

    async def scenario() -> None:
        async with serving(answer) as (_raw, up):
            loop = asyncio.get_running_loop()
            with pytest.raises(asyncio.TimeoutError):
                await up.request("/x", b"{}", deadline=loop.time() + 0.1)
            assert up.connections == 0

    run(scenario)


def test_a_slow_reader_pauses_the_socket_and_gets_every_byte() -> None:
    piece = bytes(range(256)) * 256  # 64 KiB

    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(chunked(*([piece] * 48)))  # 3 MiB: past the buffering high-water mark
        return True

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            for _ in range(2):
                ex = await up.request("/x", b"{}")
                await asyncio.sleep(0.3)  # the client is slow: the socket must be paused
                assert await ex.read_all() == piece * 48
                ex.release(True)
            assert raw.connections == 1  # and read again once pooled

    run(scenario)


def test_the_retry_goes_to_a_fresh_connection_not_another_idle_one() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        if n == 2:  # every idle connection was dropped by the engine meanwhile
            return False
        w.write(chunked(b"data: ok\n\n"))
        return True

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            first = await asyncio.gather(up.request("/x", b"{}"), up.request("/x", b"{}"))
            for ex in first:  # two connections go idle together
                assert await ex.read_all() == b"data: ok\n\n"
                ex.release(True)
            assert await fetch(up) == (200, b"data: ok\n\n")
            assert raw.connections == 3

    run(scenario)


def test_nothing_is_sent_when_the_check_made_once_connected_fails() -> None:
    async def answer(conn: int, n: int, w: asyncio.StreamWriter) -> bool:
        w.write(chunked(b"data: ok\n\n"))
        return True

    class Deposed(Exception):
        pass

    leading = [True]

    def still_leading() -> None:
        if not leading[0]:
            raise Deposed

    async def scenario() -> None:
        async with serving(answer) as (raw, up):
            ex = await up.request("/v1/completions", b"{}", before_send=still_leading)
            await ex.read_all()
            ex.release(True)
            leading[0] = False  # lost while the next request was connecting
            with pytest.raises(Deposed):
                await up.request("/v1/completions", b"{}", before_send=still_leading)
            await asyncio.sleep(0.05)
            assert len(raw.requests) == 1  # the second request's bytes never left
            leading[0] = True  # the connection it did not use serves the next one
            assert (await up.request("/v1/completions", b"{}")).status == 200
            assert raw.connections == 1

    run(scenario)
