"""Broken request framing, over a raw socket, against both programs: a 400 in the OpenAI
envelope (and the connection closed), never the server layer's bare 500."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.support import Server, start_engine, start_router

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
CASES = {
    "chunk size not hex": (
        HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        False,
    ),
    "chunk size overflows": (
        HEAD + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nabc\r\n0\r\n\r\n",
        False,
    ),
    "chunked body cut short": (HEAD + b'Transfer-Encoding: chunked\r\n\r\n10\r\n{"a"', True),
    "shorter than its Content-Length": (HEAD + b'Content-Length: 100\r\n\r\n{"a": 1}', True),
}


def _exchange(url: str, raw: bytes, half_close: bool) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        if half_close:  # the client has nothing more to send
            s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def _assert_enveloped_400(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "bad_request_body"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(
        tmp_path_factory.mktemp("framing"),
        """
listen: {port: $PORT}
admission: open
engines: [{name: a, url: "http://127.0.0.1:9", dialect: openai}]
""",
        False,
    )
    yield r
    r.stop()


@pytest.mark.parametrize("case", CASES)
def test_router_answers_broken_framing_with_a_400(router: Server, case: str) -> None:
    _assert_enveloped_400(_exchange(router.url, *CASES[case]))


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Server]:
    e = start_engine(model_path)
    yield e
    e.stop()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_engine_answers_broken_framing_with_a_400(engine: Server, case: str) -> None:
    _assert_enveloped_400(_exchange(engine.url, *CASES[case]))


def test_a_client_that_left_mid_body_leaves_the_router_serving(router: Server) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    for _ in range(20):
        s = socket.create_connection((host, int(port)))
        s.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # a reset, mid-body
    ok = _exchange(
        router.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False
    )
    assert ok.startswith(b"HTTP/1.1 200 ")
