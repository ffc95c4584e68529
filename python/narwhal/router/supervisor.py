"""Managed engines: `lexi-engine` processes the router starts, restarts and stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from narwhal.router import affinity
from narwhal.router.config import EngineSpec

log = logging.getLogger("narwhal.supervisor")

PR_SET_PDEATHSIG = 1


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
    def __init__(self, spec: EngineSpec, model_name: str) -> None:
        assert spec.launch is not None
        self.spec = spec
        self.port = spec.launch.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = model_name
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def command(self) -> list[str]:
        la = self.spec.launch
        assert la is not None
        return [*lexi_command(), "serve", "-m", la.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--alias", self.model_name,
                "--parallel", str(la.parallel), "--queue-wait", "600", *la.args]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = 0.5
        while not self._stopping:
            log.info("starting engine %s on port %d", self.spec.name, self.port)
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), preexec_fn=_prepare_child,
                stdout=asyncio.subprocess.DEVNULL if os.environ.get("NARWHAL_QUIET_ENGINES")
                else None)
            code = await self.proc.wait()
            # The engine's own workers share its process group; none may outlive it and
            # keep the port from the next start.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self._stopping:
                return
            self.restarts += 1
            log.warning("engine %s exited with %s; restarting in %.1fs", self.spec.name, code,
                        backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

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
