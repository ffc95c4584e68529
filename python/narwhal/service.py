"""How both programs run as a service: bind checks, Granian's process tree, signals, exits.

Both `narwhal` and `lexi-engine` are a Granian main process with one worker process. This
module is the part they share:

- the address is resolved (a host name works) and the port is checked before Granian starts:
  Granian binds with SO_REUSEPORT, so a second server on a taken port would otherwise start
  and share it, and requests would alternate between the two;
- the first SIGINT/SIGTERM drains in-flight requests for a bounded grace period and says
  so; a second one stops at once;
- a worker that dies is reported with its signal name, and the main process exits with
  128 + the signal number (the shell's convention), so whoever started it can tell a crash
  from a refusal;
- the worker dies with the main process (`guard_worker`), whatever killed the main one;
- the validated config reaches the worker as a JSON file only this user may read
  (`hand_off` / `taken_over`): it may hold API keys, and the environment of a process is
  readable by every process of the same user (and shows in `ps e`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("narwhal.service")

PR_SET_PDEATHSIG = 1
MAIN_PID_ENV = "NARWHAL_MAIN_PID"


class StartError(Exception):
    """The program cannot start as asked: one line for the user, exit 2."""


@dataclass(frozen=True)
class ServerLimits:
    grace_s: float  # drain time after the first stop signal
    # A request head, or the next one on a kept-alive connection, must come within this:
    # a client that trickles a head (slowloris) or idles between requests is closed.
    header_timeout_s: float
    # Connections served at once (Granian's permits). Each idle one holds a permit until
    # the header timeout; one that never sends a byte holds it until the client closes
    # it (hyper starts that timer at the first byte), so the number is set high.
    max_connections: int


@dataclass(frozen=True)
class Address:
    host: str  # what the user wrote
    ip: str  # what Granian binds
    port: int


def resolve(host: str, port: int) -> Address:
    """The address to bind for `host`: an IP as given, a name through the resolver."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.args[1] if isinstance(e, socket.gaierror) and len(e.args) > 1 else str(e)
        raise StartError(f"cannot listen on {host!r}: {reason}") from None
    # IPv4 first: "localhost" resolves to both, and clients try 127.0.0.1 first.
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return Address(host, str(infos[0][4][0]), port)


def check_free(addr: Address) -> None:
    """Refuse a port another process listens on, SO_REUSEPORT or not."""
    family = socket.AF_INET6 if ":" in addr.ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR only lets a port in TIME_WAIT be reused; a listener still blocks it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr.ip, addr.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartError(
                    f"port {addr.port} on {addr.host} is already in use by another process"
                ) from None
            raise StartError(f"cannot listen on {addr.host}:{addr.port}: {e.strerror}") from None


def describe_exit(code: int) -> str:
    """'exited with 2' or 'was killed by SIGSEGV' for a process's exit status (negative
    for a signal, as subprocess reports it; 128 + N is a shell's or our main's report)."""
    sig = -code if code < 0 else code - 128 if 128 < code < 160 else 0
    if sig:
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited with {code}"


def crash_signal(code: int) -> int:
    """The signal number a crash exit status stands for, or 0."""
    return -code if code < 0 else code - 128 if 128 < code < 160 else 0


CONFIG_PREFIX = "narwhal-config-"


def hand_off(env: str, config_json: bytes) -> None:
    """Leave the validated config for the worker process: a 0600 file whose path is in
    `env`, removed when this (main) process exits. A main process killed outright (SIGKILL,
    the OOM killer) cannot remove its file: the file names its process, and whoever hands
    off next removes those of processes that are gone."""
    _sweep(tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix=f"{CONFIG_PREFIX}{os.getpid()}-", suffix=".json")
    try:
        os.write(fd, config_json)
    finally:
        os.close(fd)
    atexit.register(_unlink, path)
    os.environ[env] = path


def _sweep(folder: str) -> None:
    """Remove config files this user's dead main processes left behind."""
    uid = os.getuid()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            pid = _owner_pid(entry.name)
            if pid is None or _alive(pid):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    os.unlink(entry.path)


def _owner_pid(name: str) -> int | None:
    if not (name.startswith(CONFIG_PREFIX) and name.endswith(".json")):
        return None
    pid, sep, _ = name[len(CONFIG_PREFIX) :].partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive, and not ours to judge
    return True


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def taken_over(env: str) -> bytes:
    """The config `hand_off` left (in the worker)."""
    with open(os.environ[env], "rb") as f:
        return f.read()


def on_stop_signal(callback: Callable[[], object]) -> None:
    """In a worker: the main process says a stop began (`serve(notify_stop=True)` sends
    SIGUSR1 before Granian drains): the router resigns its leadership, an engine withdraws
    its registration, before in-flight requests drain."""
    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, callback)


def on_reload_signal(callback: Callable[[], object]) -> None:
    """In a worker: the main process got SIGHUP (`serve(notify_reload=True)` passes it on
    as SIGUSR2 rather than let Granian restart the worker, which would drop every stream)."""
    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, callback)


def guard_worker() -> None:
    """In a Granian worker, first thing: die with the main process, and print the Python
    stack of a fatal signal (a crash inside a C library otherwise leaves no trace)."""
    faulthandler.enable()
    # SIGUSR1 (a stop notice, see serve) must never kill a worker that has not yet
    # installed its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # a reload notice, likewise
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    main = os.environ.get(MAIN_PID_ENV)
    if main is not None and os.getppid() != int(main):
        os._exit(1)  # the main process died before the line above took effect


def serve(
    prog: str,
    target: str,
    addr: Address,
    limits: ServerLimits,
    notify_stop: bool = False,
    notify_reload: bool = False,
    **granian: Any,
) -> int:
    """Run `target` (an ASGI app factory) under Granian until it stops; the exit status.
    `notify_stop`: the first stop signal is passed on to the worker as SIGUSR1 before
    Granian drains it (the router resigns its leadership there; see router/app.py);
    `notify_reload`: SIGHUP is passed on as SIGUSR2 (the router reads its config again)."""
    from granian import Granian
    from granian.http import HTTP1Settings

    grace_s = limits.grace_s
    _raise_fd_limit(limits.max_connections + 1024)
    Server = _granian(Granian, prog, grace_s, notify_stop, notify_reload)
    os.environ[MAIN_PID_ENV] = str(os.getpid())
    server = Server(
        target,
        factory=True,
        address=addr.ip,
        port=addr.port,
        workers=1,
        log_access=False,
        workers_kill_timeout=grace_s,
        backpressure=limits.max_connections,
        http1_settings=HTTP1Settings(
            header_read_timeout=max(1, round(limits.header_timeout_s * 1000))
        ),
        **granian,
    )
    code = 0
    try:
        server.serve()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return _status(prog, server, code)


def _granian(base: type, prog: str, grace_s: float, notify_stop: bool, notify_reload: bool) -> type:
    """Granian, with our signals: a second stop kills, a stop and SIGHUP are passed on to
    the worker (SIGUSR1, SIGUSR2) as `serve` was asked, and how workers ended is kept."""

    class Server(base):  # type: ignore[misc]
        interrupted = 0
        exits: list[int] = []  # statuses of the workers that ended by themselves

        def _stop_workers(self) -> None:
            # Granian forgets its workers as it stops them: keep how the dead ones ended.
            self.exits = [
                w.inner.exitcode for w in self.wrks if not w.is_alive() and w.inner.exitcode
            ]
            super()._stop_workers()

        def signal_handler_reload(self, *args: Any, **kwargs: Any) -> None:
            if not notify_reload:
                return  # no restart of the worker on SIGHUP: it would cut every stream
            for w in self.wrks:
                with contextlib.suppress(Exception):
                    os.kill(w.inner.pid, signal.SIGUSR2)

        def signal_handler_interrupt(self, *args: Any, **kwargs: Any) -> None:
            self.interrupted += 1
            if self.interrupted == 1:
                if notify_stop:
                    for w in self.wrks:
                        with contextlib.suppress(Exception):
                            os.kill(w.inner.pid, signal.SIGUSR1)
                super().signal_handler_interrupt(*args, **kwargs)
                _say(
                    f"{prog}: stopping: draining in-flight requests for up to {grace_s:g} s "
                    "(signal again to stop now)"
                )
                return
            for w in self.wrks:
                with contextlib.suppress(Exception):
                    w.kill()
            _say(f"{prog}: stopping now")

    return Server


def _status(prog: str, server: Any, code: int) -> int:
    """The exit status: 0 for a stop asked for, a crashed worker's signal named."""
    if server.interrupted:  # asked to stop: however the worker ended, that was the stop
        return 0
    for status in server.exits:
        sig = crash_signal(status)
        if sig:
            _say(f"{prog}: error: the worker process {describe_exit(status)}{crash_hint(sig)}")
            return 128 + sig
        return int(status)
    return code


def _raise_fd_limit(want: int) -> None:
    """Room for `want` open files: each client connection is one."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _say(line: str) -> None:
    """One line to stderr, which may be a pipe whose reader is gone (a managed engine whose
    router died): a stop must not fail on its own announcement."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def crash_hint(sig: int) -> str:
    if sig in (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE):
        return (
            "; a crash inside native code (llama.cpp). If it happens on the first "
            "request and the CPU has Intel AMX (amx_int8 in /proc/cpuinfo), start the "
            "engine with --no-repack; otherwise run with fewer --threads or report it "
            "with the stack printed above"
        )
    if sig == signal.SIGKILL:
        return "; killed from outside (the kernel's out-of-memory killer, or kill -9)"
    return ""
