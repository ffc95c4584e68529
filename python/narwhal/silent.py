"""Closing client connections that never send a byte.

Granian's HTTP/1 server (hyper) starts its head timer at a connection's first byte, so a
client that connects and sends nothing holds one of `max_connections` forever: ~1,000 of
them locked everyone out. The worker owns those sockets, so it can look at them itself:
every so often, a TCP connection accepted on one of this process's listening ports that has
received no byte for `after_s` is shut down (hyper then drops it and its seat). A connection
that sent anything is left to hyper's own timers (trickled heads, idle keep-alives).

Linux only (TCP_INFO's `tcpi_bytes_received`, since 4.1); elsewhere it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable

log = logging.getLogger("narwhal.silent")

# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields, then u32s; tcpi_last_data_recv is the
# 12th u32 (ms since data last arrived; since the connection was set up when none has),
# tcpi_bytes_received the 4th u64 after the 24 u32s.
_LAST_DATA_RECV = 8 + 11 * 4
_BYTES_RECEIVED = 8 + 24 * 4 + 3 * 8
_TCP_INFO_LEN = _BYTES_RECEIVED + 8


def _sockets() -> list[socket.socket]:
    """A dup of every TCP socket this process holds (the caller closes them)."""
    out: list[socket.socket] = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except OSError:
            continue  # closed meanwhile
        try:
            s = socket.socket(fileno=dup)  # the family and type the socket really has
        except OSError:
            os.close(dup)
            continue
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            s.close()
            continue
        out.append(s)
    return out


def sweep(after_s: float) -> int:
    """Shut down the silent connections older than `after_s`; how many."""
    socks = _sockets()
    try:
        listening: set[int] = set()
        accepted: list[tuple[int, socket.socket]] = []
        for s in socks:
            try:
                port = s.getsockname()[1]
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    listening.add(port)
                else:
                    accepted.append((port, s))
            except OSError:
                continue
        closed = 0
        limit_ms = after_s * 1000
        for port, s in accepted:
            if port not in listening:
                continue  # an outgoing connection (to an engine), not a client's
            try:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            except OSError:
                continue
            if len(info) < _TCP_INFO_LEN:
                return 0  # a kernel without tcpi_bytes_received: leave everything alone
            (received,) = struct.unpack_from("Q", info, _BYTES_RECEIVED)
            (idle_ms,) = struct.unpack_from("I", info, _LAST_DATA_RECV)
            if received == 0 and idle_ms >= limit_ms:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    closed += 1
        return closed
    finally:
        for s in socks:
            s.close()


async def close_silent_forever(after_s: float, count: Callable[[int], None]) -> None:
    """Sweep every half of `after_s` (off the event loop: a sweep reads /proc)."""
    if not sys.platform.startswith("linux"):
        return
    while True:
        await asyncio.sleep(max(after_s / 2, 0.25))
        try:
            closed = await asyncio.to_thread(sweep, after_s)
        except Exception:  # never let a surprise stop the sweeps silently
            log.exception("sweeping silent connections failed")
            continue
        if closed:
            log.debug("closed %d connections that sent nothing for %gs", closed, after_s)
            count(closed)
