"""A client slower than the engine: every token arrives, in order, and the router holds a
bounded amount of the stream, whatever the client's pace (backpressure reaches the engine).

The client here is a raw socket with a small receive buffer, so the router's channel to it
fills as soon as it stops reading, as it would behind a slow network.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import orjson
import pytest

from tests.support import Server, start_router


def _open(port: int, tokens: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = orjson.dumps({"prompt": f"script:echo:{tokens}", "stream": True})
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


def _read_all(s: socket.socket, first: bytes) -> bytes:
    parts = [first]
    s.settimeout(60)
    while True:
        data = s.recv(1 << 16)
        if not data:
            break
        parts.append(data)
        if b"".join(parts[-2:]).endswith(b"\r\n0\r\n\r\n"):
            break
    raw = b"".join(parts)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return _dechunk(body)


def _dechunk(body: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            return b"".join(out)
        out.append(body[j + 2 : j + 2 + n])
        i = j + 2 + n + 2


def _worker_rss_kib(main_pid: int) -> int:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main_pid:
                    status = (d / "status").read_text()
                    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
            except (OSError, ValueError):
                continue
    raise AssertionError("no worker")


@pytest.fixture(scope="module")
def router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Server:
    r = start_router(
        tmp_path_factory.mktemp("bp"),
        f"""
listen: {{port: $PORT}}
admission: open
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    yield r  # type: ignore[misc]
    r.stop()


def test_a_stalled_client_gets_every_token_in_order(router: Server) -> None:
    n = 30_000  # ~4 MB of frames: far more than the socket buffers between the two
    streams = [_open(router.port, n) for _ in range(4)]
    try:
        firsts = [s.recv(4096) for s in streams]  # the streams started...
        time.sleep(1.5)  # ...and the client stalls while the engine keeps writing
        for s, first in zip(streams, firsts, strict=True):
            text = _read_all(s, first)
            got = [int(x) for x in re.findall(rb'"text":"w(\d+) "', text)]
            assert got == list(range(n)), (
                next((i, g) for i, g in enumerate(got) if g != i) if got != list(range(n)) else None
            )
            assert text.rstrip().endswith(b"data: [DONE]")
    finally:
        for s in streams:
            s.close()


def test_a_client_that_stops_reading_does_not_fill_the_router(router: Server) -> None:
    before = _worker_rss_kib(router.proc.pid)
    s = _open(router.port, 400_000)  # ~60 MB of stream
    try:
        s.recv(4096)
        time.sleep(3)  # the engine could write it all in this time, were it let
        grown_mib = (_worker_rss_kib(router.proc.pid) - before) / 1024
        assert grown_mib < 20, f"router grew {grown_mib:.0f} MiB for one stalled stream"
    finally:
        s.close()


def test_connections_closed_by_disconnects_are_freed(router: Server) -> None:
    """Each upstream connection closed early (here: its client hung up mid-stream) must be
    collected; a reference cycle through the native reader once kept each one alive with
    its 64 KiB read buffer."""

    def hang_up_mid_stream(k: int) -> None:
        for _ in range(k):
            s = _open_paced(router.port)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.close()

    hang_up_mid_stream(50)  # warm: allocator pools, lazily created objects
    time.sleep(0.5)
    before = _worker_rss_kib(router.proc.pid)
    hang_up_mid_stream(400)
    time.sleep(0.5)  # the router notices the last hang-ups
    grown_mib = (_worker_rss_kib(router.proc.pid) - before) / 1024
    assert grown_mib < 8, f"router grew {grown_mib:.1f} MiB over 400 disconnects"


def _open_paced(port: int) -> socket.socket:
    s = socket.socket()
    s.connect(("127.0.0.1", port))
    body = orjson.dumps({"prompt": "script:paced:100:20", "stream": True})
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


def test_the_deadline_covers_the_stream_after_its_first_token(router: Server) -> None:
    """An engine that keeps the stream open (keep-alive comments) but never finishes: the
    client's `x-narwhal-timeout-ms` ends it, and every seat comes back."""
    import httpx

    r = httpx.post(
        router.url + "/v1/completions",
        timeout=30,
        headers={"x-narwhal-timeout-ms": "1500"},
        json={"prompt": "script:hang", "stream": True},
    )
    assert r.status_code == 200
    assert r.text.rstrip().endswith('"code":"deadline_exceeded"}}')
    m = httpx.get(router.url + "/metrics").text
    assert 'narwhal_inflight{engine="s",phase="decode"} 0.0' in m
    assert "narwhal_retained 0.0" in m


def test_a_slow_client_is_not_taken_for_a_stalled_engine(scripted: Server, tmp_path: Path) -> None:
    """While the client does not read, the router does not read the engine either; the
    idle-gap watchdog must not blame the engine for that silence."""
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
serving: {{stream_idle_timeout_s: 0.5}}
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    try:
        s = _open(r.port, 30_000)
        try:
            first = s.recv(4096)
            time.sleep(2)  # four idle gaps with the client not reading
            text = _read_all(s, first)
        finally:
            s.close()
        assert b"engine_stalled" not in text
        got = [int(x) for x in re.findall(rb'"text":"w(\d+) "', text)]
        assert got == list(range(30_000))
    finally:
        r.stop()
