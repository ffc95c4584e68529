"""Which CPUs the router's threads run on (`serving.cpu_affinity`).

The router is one Python event loop plus Granian's I/O thread, and every relayed chunk
passes from the first to the second. On different cores each hand-over wakes the other
core; on one core the I/O thread runs when the loop waits, so chunks go out in batches
and no other core is woken. The router therefore keeps to one CPU unless told otherwise
(bench/README.md has the measurements). Managed engines are not the router: they get back
every CPU the router was given.
"""

from __future__ import annotations

import contextlib
import os

from narwhal.router.config import RouterConfigError

# The CPUs the router was started with, for the engines it launches (the router's own
# worker process and threads inherit the narrower set).
ENGINE_CPUS_ENV = "NARWHAL_ENGINE_CPUS"


def choose(setting: str | tuple[int, ...], allowed: set[int]) -> set[int] | None:
    """The CPUs to keep the router on, or None to leave it to the OS scheduler."""
    if isinstance(setting, str):
        if setting == "none":
            return None
        # auto: the highest-numbered CPU (CPU 0 is where the kernel tends to do its own work).
        return {max(allowed)} if len(allowed) > 1 else None
    wanted = set(setting)
    missing = sorted(wanted - allowed)
    if missing:
        raise RouterConfigError(
            f"serving.cpu_affinity: CPU {missing[0]} is not available to the "
            f"router (it may use {_ranges(allowed)})"
        )
    return wanted


def pin(setting: str | tuple[int, ...]) -> set[int] | None:
    """Keep this process, and everything it starts from now on, to the chosen CPUs. Called
    before the server starts, so its worker and threads inherit the set."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    cpus = choose(setting, allowed)
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise RouterConfigError(
            f"serving.cpu_affinity: cannot keep the router to CPU {_ranges(cpus)}: {e.strerror}"
        ) from e
    os.environ[ENGINE_CPUS_ENV] = ",".join(map(str, sorted(allowed)))
    return cpus


def release_child() -> None:
    """In a process the router starts, before it runs: back to the router's original CPUs."""
    cpus = os.environ.get(ENGINE_CPUS_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        # Best effort: a CPU taken away since the router started must not stop the engine.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def describe(cpus: set[int] | None) -> str:
    return "any CPU" if cpus is None else f"CPU {_ranges(cpus)}"


def _ranges(cpus: set[int]) -> str:
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
