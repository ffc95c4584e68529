"""The native relay: a stream's reads relayed from the connection's read callback.

Only for a server whose `send` finishes its work when called (Granian's does): a read that
holds only output goes from the socket through the relay to `send` in Rust
(`UpstreamReader`); Python sees first output, usage, the end, faults and a send that must
wait (`Outbox`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING

from narwhal._native import RelayChunk
from narwhal.asgi import Send
from narwhal.router.connection import Exchange
from narwhal.router.relay.errors import past

if TYPE_CHECKING:
    from narwhal.router.relay.accounting import Stream
    from narwhal.router.relay.reading import Reading


def done_at_call(sent: Awaitable[None]) -> tuple[type | None, Awaitable[None] | None]:
    """(the type of `sent` if it did all its work in the call, what is left to await).

    Granian's ASGI `send` sends at once and returns an awaitable with nothing left to do;
    only then may later sends be made from Rust without awaiting them (the native relay),
    comparing each one's type with this one's. Told by what the awaitable does, not by its
    name: it finishes without yielding. A coroutine or future (other servers) always waits.
    """
    if inspect.iscoroutine(sent) or isinstance(sent, asyncio.Future):
        return None, sent
    it = sent.__await__()
    try:
        first = next(it)
    except StopIteration:
        return type(sent), None
    return None, _Resumed(it, first)


class _Resumed:
    """The rest of an awaitable whose first step was taken by `_done_at_call`."""

    __slots__ = ("first", "it")

    def __init__(self, it: Generator[object, object, object], first: object) -> None:
        self.it = it
        self.first = first

    def __await__(self) -> Generator[object, object, None]:
        value = self.first
        while True:
            try:
                got = yield value
            except BaseException as exc:  # a cancellation, say: the awaitable decides
                try:
                    value = self.it.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = self.it.send(got)
                except StopIteration:
                    return


class Outbox:
    """A pushed stream's sends to Granian, kept in order.

    Granian's `send` puts a body on a small channel to the client's connection; when the
    channel is full it returns an awaitable that sends later instead of sending now, and a
    send after it can overtake it (tokens reordered, `[DONE]` before the last frame). A
    send that did not go at once is awaited before anything after it goes out, and the
    engine's socket is not read meanwhile (`held`), so a slow client slows the engine
    instead of filling the router's memory.
    """

    __slots__ = ("failed", "held", "queue", "send", "sent_type", "task")

    def __init__(
        self,
        send: Send,
        sent_type: type,
        held: Callable[[bool], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self.send = send
        self.sent_type = sent_type
        self.held = held
        self.failed = failed
        self.queue: deque[tuple[bytes, bool]] | None = None  # set while a send waits
        self.task: asyncio.Task[None] | None = None

    @property
    def holding(self) -> bool:
        """A send is waiting for the client (the engine's socket is not being read)."""
        return self.queue is not None

    def put(self, body: bytes, more: bool) -> None:
        if self.queue is not None:
            self.queue.append((body, more))
            return
        sent = self.send({"type": "http.response.body", "body": body, "more_body": more})
        if type(sent) is not self.sent_type:
            self.waiting(sent)

    def waiting(self, sent: Awaitable[None]) -> None:
        """`sent` has not gone out yet: everything after it waits for it."""
        self.queue = deque()
        self.held(True)
        self.task = asyncio.ensure_future(self._drain(sent))

    async def _drain(self, sent: Awaitable[None]) -> None:
        try:
            await sent
            while self.queue:
                body, more = self.queue.popleft()
                await self.send({"type": "http.response.body", "body": body, "more_body": more})
        except Exception as exc:  # the client went away
            self.failed(exc)
            return
        finally:
            self.queue = None
        self.held(False)

    async def flushed(self) -> None:
        while self.task is not None and not self.task.done():
            await asyncio.shield(self.task)


async def push(rl: Reading, st: Stream, resp: Exchange, send: Send, sent_type: type) -> bool:
    """Relay the rest of the stream from the connection's read callback.

    Only for a server whose `send` finishes its work when called (Granian's does): a
    read that holds only output goes from the socket through the relay to `send` in
    Rust (`UpstreamReader`); this coroutine only waits for the end, and `_Pushed`'s
    callbacks see the rest (first output, usage, the end, faults, a send that waits).
    """
    p = _Pushed(rl, st, resp, send, sent_type)
    loop = asyncio.get_running_loop()
    p.timer = loop.call_at(min(loop.time() + rl.idle_s, st.lease.deadline), p.watch, resp.reads)
    resp.push(p.on_body, p.relay)
    try:
        outcome = await p.ended
        await p.out.flushed()  # the stream's last bytes may still wait for the client
        return outcome
    finally:
        p.timer.cancel()
        resp.push(None)
        resp.hold(False)


class _Pushed:
    """One pushed stream: the callbacks its connection and the native relay call."""

    __slots__ = ("ended", "loop", "out", "relay", "resp", "rl", "st", "timer")

    def __init__(
        self, rl: Reading, st: Stream, resp: Exchange, send: Send, sent_type: type
    ) -> None:
        self.rl, self.st, self.resp = rl, st, resp
        self.loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[bool] = self.loop.create_future()
        self.relay = (st.relay, send, self.on_report, sent_type)
        self.out = Outbox(send, sent_type, self.held, self.end)
        self.timer: asyncio.TimerHandle | None = None

    def end(self, outcome: bool | BaseException) -> None:
        if self.ended.done():
            return
        if isinstance(outcome, BaseException):  # the client went away, say
            self.ended.set_exception(outcome)  # the coroutine decides
        else:
            # The last bytes are handed to the server: a hang-up that cancels the request's
            # task before it wakes must not undo the outcome.
            self.st.lease.measured.answered = outcome
            self.ended.set_result(outcome)
        self.resp.push(None)  # nothing more goes to the client

    def on_body(self, chunk: bytes) -> None:
        st = self.st
        self.deliver(lambda: st.step(chunk))

    def held(self, waiting: bool) -> None:
        self.resp.hold(waiting)
        if waiting:
            self.resp.relay_natively(None)  # a native send would overtake the waiting one
        elif not self.ended.done():
            self.resp.relay_natively(self.relay)

    def deliver(self, step: Callable[[], tuple[bytes, bytes | None, bool | None]]) -> None:
        if self.ended.done():
            return
        try:
            forward, final, outcome = step()
            if final is not None:  # the last bytes go out with the stream's end: one send
                self.out.put(forward + final, more=False)
            elif forward:
                self.out.put(forward, more=True)
        except Exception as exc:
            self.end(exc)
            return
        if outcome is not None:
            self.end(outcome)

    def on_report(self, rep: RelayChunk | BaseException | Awaitable[None]) -> None:
        if isinstance(rep, RelayChunk):
            st = self.st
            self.deliver(lambda: st.report(rep))
        elif isinstance(rep, BaseException):  # raised by `send`
            self.end(rep)
        else:  # a send Granian could not do at once (its channel to the client is full)
            self.out.waiting(rep)

    def watch(self, seen: int) -> None:
        """Every idle gap (or at the deadline): a stream with no read since the last
        look, or past its deadline, ends with an error event."""
        if self.ended.done():
            return
        st, reads = self.st, self.resp.reads
        # While a send waits for the client, the engine is not read: no reads then is
        # the client's pace, not a stalled engine.
        if past(st.lease.deadline) or (reads == seen and not self.out.holding):
            self.out.put(self.rl.timed_out(st.lease), more=False)
            self.end(False)
            return
        at = min(self.loop.time() + self.rl.idle_s, st.lease.deadline)
        self.timer = self.loop.call_at(at, self.watch, reads)
