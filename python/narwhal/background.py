"""Supervised background tasks: a loop that fails is logged, counted and started again.

Both programs run long-lived loops beside their requests (health probes, leadership, the
wave follower, the fence follower, the silent-connection reaper, profiling). A bare
`asyncio.create_task` that raises dies without a word until the task is collected, and the
router then never fails over, probes or campaigns again. Here every such loop runs under a
supervisor: an unexpected exception is logged with its stack, counted per task
(`*_background_errors_total{task}`, each series exported at 0 from the task's start),
and the loop is started again after a backoff (0.1 s, doubling to 10 s; back to 0.1 s
after a minute without failing). A loop that returns has finished its job (one with
nothing to do, say no etcd) and is not restarted. `failing()` names the loops that failed
lately, for `/ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger("narwhal.background")

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 10.0
HEALED_AFTER_S = 60.0  # a loop that ran this long since its last failure counts as well


class _Count(Protocol):
    def inc(self) -> None: ...


class ErrorCounter(Protocol):
    """A counter labelled by task (prometheus_client's `Counter(..., ["task"])`)."""

    def labels(self, task: str) -> _Count: ...


class Background:
    """Owns a program's background loops, from start to shutdown."""

    def __init__(self, errors: ErrorCounter | None = None) -> None:
        self._errors = errors
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # name -> (when, what) of the last

    def start(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop()` under supervision; `name` labels its errors (one loop a name)."""
        assert name not in self._tasks, f"background task {name} started twice"
        if self._errors is not None:
            self._errors.labels(name)  # the series exists, at 0, before the first failure
        self._tasks[name] = asyncio.create_task(self._supervise(name, loop), name=name)

    async def _supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if time.monotonic() - started > HEALED_AFTER_S:
                    backoff = FIRST_BACKOFF_S
                self._failed[name] = (time.monotonic(), f"{type(e).__name__}: {e}")
                log.exception(
                    "background task %s failed; starting it again in %.1fs", name, backoff
                )
                if self._errors is not None:
                    self._errors.labels(name).inc()
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    def failing(self) -> dict[str, str]:
        """The loops that failed within the last minute: name -> the last error."""
        now = time.monotonic()
        return {
            name: what for name, (at, what) in self._failed.items() if now - at < HEALED_AFTER_S
        }

    def running(self, name: str) -> bool:
        t = self._tasks.get(name)
        return t is not None and not t.done()

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
