"""Managed engines: `lexi-engine` processes the router starts, restarts and stops.

A launch that fails before the engine ever answered `/health` (a missing model, a bad flag)
is fatal: restarting cannot fix it, and a router that restarts it forever while `/ready`
says "/health failed" hides the engine's own message. A crash after a healthy start is
restarted with exponential backoff, which starts over once a run has stayed healthy for
`STABLE_S`. Every exit is reported with its signal name (`service.describe_exit`), in the
log, on `/ready` and as a restart counter.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson

from narwhal import service
from narwhal.router import affinity
from narwhal.router.config import EngineSpec

log = logging.getLogger("narwhal.supervisor")

PR_SET_PDEATHSIG = 1
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a run healthy this long starts the backoff over
TAIL_LINES = 20  # engine stderr lines kept for the report of a failed start


def _prepare_child() -> None:
    """Runs in the child before exec: the kernel kills it if the router dies (no orphans),
    and it may use every CPU the router was started with, not only the router's own."""
    affinity.release_child()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def lexi_command() -> list[str]:
    exe = Path(sys.executable).with_name("lexi-engine")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "narwhal.engine.cli"]


class ManagedEngine:
    def __init__(
        self,
        spec: EngineSpec,
        model_name: str,
        on_fatal: Callable[[str], None] | None = None,
        traces: tuple[str, float] | None = None,
    ) -> None:
        assert spec.launch is not None
        self.spec = spec
        # Where the router sends its traces and at what ratio: the engine sends its own
        # there too (joined to the router's by traceparent), unless its args say otherwise.
        self.traces = traces
        self.port = spec.launch.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = model_name
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.last_exit: str | None = None  # "was killed by SIGSEGV", for /ready
        self.ever_healthy = False
        self.on_exit: Callable[[str], None] | None = None  # once per unexpected exit
        self._on_fatal = on_fatal  # the report of a launch that can never work
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def command(self) -> list[str]:
        la = self.spec.launch
        assert la is not None
        return [
            *lexi_command(),
            "serve",
            "-m",
            la.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--alias",
            self.model_name,
            "--parallel",
            str(la.parallel),
            "--queue-wait",
            "600",
            *self._traced(la.args),
            *la.args,
        ]

    def _traced(self, args: tuple[str, ...]) -> list[str]:
        if self.traces is None or any(a.startswith("--otlp-endpoint") for a in args):
            return []
        endpoint, ratio = self.traces
        return ["--otlp-endpoint", endpoint, "--otel-sample-ratio", str(ratio)]

    def describe(self) -> dict[str, object]:
        return {
            "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = BACKOFF_FIRST_S
        while not self._stopping:
            log.info("starting engine %s on port %d", self.spec.name, self.port)
            self._tail.clear()
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(),
                preexec_fn=_prepare_child,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            started = time.monotonic()
            relay = asyncio.create_task(self._relay_stderr(self.proc))
            healthy_at = await self._wait_healthy(self.proc)
            code = await self.proc.wait()
            await relay
            # The engine's own workers share its process group; none may outlive it and
            # keep the port from the next start.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self._stopping:
                return
            what = service.describe_exit(code)
            sig = service.crash_signal(code)
            self.last_exit = what + (f" after {time.monotonic() - started:.0f}s")
            if healthy_at is None and not self.ever_healthy:
                said = " | ".join(ln for ln in self._tail if ln.strip()) or "(no output)"
                report = (
                    f"managed engine {self.spec.name} could not start: lexi-engine {what}: {said}"
                )
                log.error("%s", report)
                if self._on_fatal is not None:
                    self._on_fatal(report)
                return
            if healthy_at is not None and time.monotonic() - healthy_at >= STABLE_S:
                backoff = BACKOFF_FIRST_S
            self.restarts += 1
            if self.on_exit is not None:
                self.on_exit(what)
            log.error(
                "engine %s %s%s; restarting in %.1fs (restart %d)",
                self.spec.name,
                what,
                service.crash_hint(sig) if sig else "",
                backoff,
                self.restarts,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _relay_stderr(self, proc: asyncio.subprocess.Process) -> None:
        """The engine's log lines (stdout and stderr, Granian's own included) go on to the
        router's stderr, labelled, and the last few are kept: a failed start is reported
        with the engine's own words."""
        assert proc.stdout is not None
        label = f"[engine {self.spec.name}] ".encode()
        out = sys.stderr.buffer
        quiet = bool(os.environ.get("NARWHAL_QUIET_ENGINES"))
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a line over the stream's limit: skip what is buffered
                continue
            if not line:
                return
            self._tail.append(line.decode("utf-8", "replace").rstrip())
            if quiet:
                continue
            with contextlib.suppress(OSError, ValueError):
                out.write(_labelled(line, label, self.spec.name))
                out.flush()

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> float | None:
        """When the engine first answered /health on this run, or None if it exited first."""
        timeout = aiohttp.ClientTimeout(total=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while proc.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(self.url + "/health") as r:
                        if r.status == 200:
                            self.ever_healthy = True
                            return time.monotonic()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 0.2)
        return None

    async def stop(self) -> None:
        self._stopping = True
        p = self.proc
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), 10)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _labelled(line: bytes, label: bytes, name: str) -> bytes:
    """An engine's log line told apart from the router's: a JSON line (`--log-format json`)
    gains an `"engine"` member and stays JSON; any other line gets the label in front."""
    if line.startswith(b"{"):
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            obj["engine"] = name
            return orjson.dumps(obj) + b"\n"
    return label + line


def fatal(report: str) -> None:
    """A managed engine can never start: the router stops with the engine's own words.
    The worker exits at once; Granian's main process then ends with this status, and the
    other managed engines follow (each dies with this process, see supervisor)."""
    print(f"narwhal: error: {report}", file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT)


FATAL_EXIT = 3
