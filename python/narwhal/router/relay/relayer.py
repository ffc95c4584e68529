"""The relayer: one placed request's upstream call, and its answer relayed by mode.

Streamed (`stream`, and `push` once the first bytes are out), assembled for a
non-streaming client (`assemble`), or passed through as the engine sends it
(`passthrough`). It holds the upstream connection pools and no admission or policy
state: what it sees goes to the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from narwhal import asgi
from narwhal.asgi import Send
from narwhal.router.connection import Exchange, UpstreamError
from narwhal.router.endings import End
from narwhal.router.engines import Engine
from narwhal.router.lease import Lease
from narwhal.router.relay.assemble import assemble
from narwhal.router.relay.errors import (
    EngineBusy,
    EngineFailed,
    EngineFenced,
    Refusal,
    deadline_passed,
    error_event,
    past,
)
from narwhal.router.relay.passthrough import passthrough
from narwhal.router.relay.stream import stream
from narwhal.router.tracing import RequestTrace
from narwhal.router.upstream import Upstream

log = logging.getLogger("narwhal.relay")


TRUSTED_SOURCES = frozenset({"config", "dns"})
# Streams relayed from Python, none natively, before the server is said not to qualify.
WARN_AWAITED = 16


def ended(lease: Lease, well: bool) -> End:
    """How a relayed answer ended: completed, or cut by a fault its client was told of (an
    error event in a stream, the engine's own error in an assembled answer)."""
    if well:
        return End.COMPLETED
    req = lease.request
    return End.STREAM_FAULT if req.stream or req.passthrough else End.ENGINE_ERROR


class Relayer:
    """Runs a lease's upstream call and relays the answer; what it sees goes to the lease."""

    def __init__(
        self,
        idle_s: float = 120.0,
        native: bool = True,
        count_path: Callable[[str], None] | None = None,
        fence_secret: str | None = None,
    ) -> None:
        self.idle_s = idle_s  # an engine silent this long in the middle of an answer stalled
        self.native = native  # streams relayed from the read callback where `send` allows
        self._count_path = count_path or (lambda _: None)
        # Granian's `send` goes at once, except when its channel to a client is full: a
        # stream whose head had to wait is relayed from Python, and says nothing of the
        # server. Only a server none of whose streams went natively is warned of.
        self.went_native = False
        self.awaited = 0
        self.warned = False
        self.upstreams: dict[str, Upstream] = {}
        # The header line that lets this router's fencing tokens raise engines' floors.
        self.fence_secret = f"x-narwhal-fence-secret: {fence_secret}\r\n" if fence_secret else ""
        # `mode: active`: whose token it is (each router has its own), beside the token.
        self.fence_router = ""

    def fencing_as(self, router: str) -> None:
        """Tokens go out with the name of the active router they are `router`'s."""
        self.fence_router = f"x-narwhal-fence-router: {router}\r\n"

    def upstream(self, e: Engine) -> Upstream:
        # By name: two engines at one URL with different keys are two pools.
        up = self.upstreams.get(e.name)
        if up is None:
            up = self.upstreams[e.name] = Upstream(e.url, api_key=e.api_key, rules=e.rules)
        return up

    def close(self) -> None:
        for up in self.upstreams.values():
            up.close()

    def cut(self, e: Engine) -> None:
        """Close every connection to `e`: the answers still running there end now (an
        engine drained past its timeout)."""
        up = self.upstreams.get(e.name)
        if up is not None:
            up.close()

    def forget(self, e: Engine) -> None:
        """`e` left the fleet: its connections go (another engine may come at its URL)."""
        up = self.upstreams.pop(e.name, None)
        if up is not None:
            up.close()

    async def run(
        self,
        lease: Lease,
        send: Send,
        before_send: Callable[[], None] | None = None,
        trace: RequestTrace | None = None,
    ) -> End:
        """Relay the lease's answer to `send`; how it ended: completed, stream_fault
        (the stream ended with an error event) or engine_error (the engine's own non-200
        answer, passed through). Raises EngineBusy (a 429, nothing sent), EngineFailed or a
        504 before anything was sent, or what `before_send` raises (run once the connection
        is ready, before any byte goes)."""
        e = lease.on
        body = lease.request.upstream_body(e.spec.token_ids, e.spec.several_models)
        lease.measured.sent_at = time.monotonic()
        headers = ""
        if lease.fence is not None:
            headers = f"x-narwhal-fence: {lease.fence}\r\n{self.fence_router}"
            # The secret lets a token raise an engine's floor: it goes to the engines the
            # operator named (the config file, its DNS name), never to one a registrant
            # chose (etcd, the admin API), which could use it to fence the leader out of
            # every engine. Registered LexiEngines fence with --fence-etcd.
            if e.source in TRUSTED_SOURCES:
                headers += self.fence_secret
        rec = asgi.current.get()
        if rec is not None:  # the ID is printable ASCII without spaces (asgi.begin)
            headers += f"x-request-id: {rec.id}\r\n"
        if trace is not None:  # the engine's spans join the request's trace
            headers += trace.call(lease)
        try:
            resp = await self.upstream(e).request(
                lease.request.route, body, lease.deadline, headers, before_send
            )
        except asyncio.TimeoutError:
            raise deadline_passed() from None
        except OSError as exc:
            lease.fault("connect", f"request failed: {exc}")
            raise EngineFailed(str(exc)) from exc
        done = False
        try:
            if resp.status != 200:
                # The engine's own refusal (a bad grammar, say) reaches the client as it is.
                try:
                    data = await resp.read_all()
                except UpstreamError:
                    data = b""  # the status is the engine's word; a cut body adds nothing
                done = True
                refusal = Refusal(
                    resp.status,
                    data,
                    (resp.content_type or "application/json").encode(),
                    resp.retry_after,
                )
                if resp.status == 429:
                    raise EngineBusy(e.name, refusal)
                if resp.status == 409 and b'"fenced"' in data:
                    raise EngineFenced(e.name, lease.fence)
                await refusal.send(send)
                return End.ENGINE_ERROR
            if lease.request.passthrough:
                done = await passthrough(self, lease, resp, send)
            elif lease.request.stream:
                done = await stream(self, lease, resp, send)
            else:
                done = await assemble(self, lease, resp, send)
            return ended(lease, done)
        finally:
            # Anything but a stream seen to its end (a fault, a timeout, a client that went
            # away) closes the connection: that is how the engine learns to stop.
            resp.release(done)

    async def read(self, lease: Lease, resp: Exchange) -> bytes:
        """Next body bytes (b"" if the engine broke off), for as long as nothing has gone
        to the client: the deadline bounds the wait, and so does the idle gap."""
        loop = asyncio.get_running_loop()
        try:
            return await resp.read(min(lease.deadline, loop.time() + self.idle_s))
        except asyncio.TimeoutError:
            if not past(lease.deadline):
                raise self.stalled(lease) from None
            raise deadline_passed() from None
        except UpstreamError:
            return b""

    def stalled(self, lease: Lease) -> EngineFailed:
        lease.fault("engine_stalled", f"sent nothing for {self.idle_s:g}s mid-answer")
        return EngineFailed(f"the engine sent nothing for {self.idle_s:g}s")

    def timed_out(self, lease: Lease) -> bytes:
        """The error event that ends a stream that ran out of time (its deadline, or the
        engine's idle gap), reported."""
        if past(lease.deadline):
            lease.fault("deadline_exceeded")
            return error_event("the request deadline passed", "deadline_exceeded")
        self.stalled(lease)
        return error_event(f"the engine sent nothing for {self.idle_s:g}s", "engine_stalled")

    def count_path(self, path: str) -> None:
        """A stream is relayed `native` or `awaited` (counted)."""
        if path == "native":
            self.went_native = True
        self._count_path(path)

    def warn_not_native(self) -> None:
        """A stream could not go natively: warned once, where none has (WARN_AWAITED
        streams in)."""
        self.awaited += 1
        if not (self.warned or self.went_native) and self.awaited >= WARN_AWAITED:
            self.warned = True
            log.warning(
                "serving.native_relay is on, but this server's ASGI send must be "
                "awaited: streams are relayed from Python (slower; see "
                "narwhal_relayed_streams_total{path})"
            )
