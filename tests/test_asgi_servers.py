"""The router under an ASGI server whose `send` is a coroutine (uvicorn): the relay keeps
pulling the stream read by read instead of pushing it from the socket callback, which
only Granian's synchronous `send` allows. Same answers either way."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import httpx
import pytest

from narwhal import service
from narwhal.router.app import CONFIG_ENV
from narwhal.router.config import load
from tests.support import (
    ROUTER_CONFIG,
    Server,
    chat,
    free_port,
    leave_before_first_byte,
    relayed_streams,
    sse_frames,
    wait_idle,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uvicorn_router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    cfg = tmp_path_factory.mktemp("u") / "narwhal.yaml"
    cfg.write_text(ROUTER_CONFIG.replace("URL", scripted.url).replace("$PORT", str(port)))
    service.hand_off(CONFIG_ENV, load(str(cfg)).to_json())
    try:
        s = Server(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "narwhal.router.app:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            "/ready",
            port,
        )
    finally:
        del os.environ[CONFIG_ENV]
    yield s
    s.stop()


def test_paced_stream_is_relayed_whole(uvicorn_router: Server) -> None:
    r = httpx.post(
        uvicorn_router.url + "/v1/chat/completions",
        json=chat("script:paced:5:10", stream=True),
        timeout=30,
    )
    frames = sse_frames(r.text)
    text = "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1] if f["choices"])
    assert text == "w0 w1 w2 w3 w4 "
    assert frames[-1] == "[DONE]"
    assert "token_ids" not in r.text
    assert relayed_streams(uvicorn_router)["awaited"] >= 1


def test_death_mid_stream_and_assembly(uvicorn_router: Server) -> None:
    r = httpx.post(
        uvicorn_router.url + "/v1/chat/completions",
        json=chat("script:die", stream=True),
        timeout=30,
    )
    assert sse_frames(r.text)[-1]["error"]["code"] == "engine_disconnected"
    wait_ready(uvicorn_router)  # the failed engine is back once its health probe passes
    r = httpx.post(
        uvicorn_router.url + "/v1/chat/completions", json=chat("script:paced:3:5"), timeout=30
    )
    assert r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "


def test_client_gone_before_first_byte_cancels_at_once(uvicorn_router: Server) -> None:
    """uvicorn's `receive` is a coroutine: the disconnect watch wraps it in a task."""
    leave_before_first_byte(uvicorn_router.url, "script:slow_first:8000")
    wait_idle(uvicorn_router, within=3)
