"""Client connections that send nothing, trickle a head, idle, or stop mid-body cannot lock
anyone out of the router."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.support import Server, start_router


@pytest.fixture(scope="module")
def router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(
        tmp_path_factory.mktemp("conns"),
        f"""
listen: {{port: $PORT}}
admission: open
serving: {{header_timeout_s: 1, body_timeout_s: 1}}
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    yield r
    r.stop()


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass  # a response (408/400) may come before the close
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_1100_silent_connections_do_not_lock_others_out(router: Server) -> None:
    silent = []
    try:
        for _ in range(1100):  # Granian's default allowed 1,024 connections at once
            silent.append(socket.create_connection(("127.0.0.1", router.port)))
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200
        r = httpx.post(
            router.url + "/v1/completions", timeout=10, json={"prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 200
    finally:
        for s in silent:
            s.close()


def test_a_connection_that_never_sends_a_byte_is_closed(router: Server) -> None:
    """hyper's head timer starts at the first byte: a connection that sends none held one
    of `max_connections` until its client left (about 1,000 locked everyone out)."""
    silent = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(20)]
    try:
        assert all(_closed_by_server(s, within=10) for s in silent)
    finally:
        for s in silent:
            s.close()
    m = httpx.get(router.url + "/metrics").text
    closed = next(
        float(line.split()[1])
        for line in m.splitlines()
        if line.startswith("narwhal_silent_connections_closed_total")
    )
    assert closed >= 20
    assert httpx.get(router.url + "/health").status_code == 200


def test_a_trickled_head_and_an_idle_keep_alive_are_closed(router: Server) -> None:
    with contextlib.closing(socket.create_connection(("127.0.0.1", router.port))) as s:
        s.sendall(b"GET /health HTT")  # and nothing more (slowloris)
        assert _closed_by_server(s, within=10)
    with contextlib.closing(socket.create_connection(("127.0.0.1", router.port))) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_by_server(s, within=10)  # idle after its request


def test_a_body_that_stops_midway_is_408_in_the_envelope(router: Server) -> None:
    with contextlib.closing(socket.create_connection(("127.0.0.1", router.port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json"
            b'\r\ncontent-length: 100\r\n\r\n{"prompt": '
        )
        s.settimeout(10)
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            data = s.recv(4096)
            if not data:
                break
            got += data
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), got
    assert b'"code":"request_timeout"' in body
    m = httpx.get(router.url + "/metrics").text
    assert "narwhal_retained 0.0" in m  # the seat came back
