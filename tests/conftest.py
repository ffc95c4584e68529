"""Process fixtures: real servers on loopback ports, started and always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str, proc: subprocess.Popen[bytes], timeout: float = 60, status: int = 200
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {url}")
        try:
            if httpx.get(url, timeout=1).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


class Server:
    def __init__(self, args: list[str], health: str, port: int, timeout: float = 60) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: a pipe nobody reads fills up (64 KiB of log lines) and then
        # blocks the server on its next write.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            args, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=self.log
        )
        try:
            wait_http(self.url + health, self.proc, timeout)
        except Exception:
            self.stop()
            raise

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def model_path() -> str:
    from narwhal.bundled_model import smollm2_path

    return str(smollm2_path())


def start_engine(model: str, *extra: str) -> Server:
    port = free_port()
    return Server(
        [
            str(BIN / "lexi-engine"),
            "serve",
            "-m",
            model,
            "--port",
            str(port),
            "--ctx-size",
            "2048",
            *extra,
        ],
        "/health",
        port,
        timeout=120,
    )


def start_router(tmp: Path, yaml_text: str) -> Server:
    port = free_port()
    cfg = tmp / f"narwhal-{port}.yaml"
    cfg.write_text(yaml_text.replace("$PORT", str(port)))
    return Server(
        [str(BIN / "narwhal"), "serve", "--config", str(cfg)], "/ready", port, timeout=120
    )


def start_test_engine(module: str, *args: str) -> Server:
    """One of the tests' own engines (`tests.scripted_engine`, `tests.faulty_engine`)."""
    port = free_port()
    return Server([sys.executable, "-m", module, "--port", str(port), *args], "/health", port)


@pytest.fixture(scope="session")
def scripted() -> Iterator[Server]:
    s = start_test_engine("tests.scripted_engine")
    yield s
    s.stop()
