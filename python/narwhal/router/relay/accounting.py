"""A streamed answer's accounting: each socket read's body through `StreamRelay` (Rust), the
lease told of its first output, usage, its end and its faults. Shared by the pulled path
(`stream`) and the pushed one (`push`)."""

from __future__ import annotations

from collections.abc import Callable

from narwhal._native import RelayChunk, StreamRelay
from narwhal.router.lease import Lease
from narwhal.router.relay.errors import error_event


class Stream:
    """One streamed response's accounting, fed one socket read's body at a time."""

    __slots__ = ("complete", "ended", "engine_error", "lease", "prompt_ids", "push", "relay")

    def __init__(self, lease: Lease, relay: StreamRelay, complete: Callable[[], bool]) -> None:
        self.lease = lease
        self.relay = relay
        # The bytes to forward, or a RelayChunk when the read held more than output.
        self.push = relay.push
        self.prompt_ids: int | None = None
        self.complete = complete  # the engine's HTTP response ended well
        self.engine_error = False  # the engine sent an error event of its own
        self.ended = False  # the stream's end was seen (later reads change nothing)

    def broken(self) -> bytes:
        """The engine closed the stream without `[DONE]`: it broke mid-stream (or the router
        cut it: its engine was drained past the timeout)."""
        self.ended = True
        if self.lease.on.cut:
            self.lease.fault("engine_removed")
            return error_event(
                "the engine was removed from the fleet before the answer ended",
                "engine_removed",
            )
        self.lease.fault("engine_disconnected", "stream ended early")
        return error_event("the engine stream ended early", "engine_disconnected")

    def step(self, chunk: bytes) -> tuple[bytes, bytes | None, bool | None]:
        """(bytes to forward, the last bytes to send if the stream ends here, and then
        whether it ended well)."""
        if self.ended:
            return b"", None, None
        if not chunk:
            if self.engine_error and self.complete():
                # The engine said what went wrong and ended its answer cleanly: that was
                # this request's outcome (relayed once), not a fault of the engine.
                self.ended = True
                self.lease.fault("engine_error")
                return b"", b"", False
            return b"", self.broken(), False
        rep = self.push(chunk)
        if isinstance(rep, bytes):
            return rep, None, None
        return self.report(rep)

    def report(self, rep: RelayChunk) -> tuple[bytes, bytes | None, bool | None]:
        """`step` for a read that held more than output tokens."""
        if self.ended:
            return b"", None, None
        lease = self.lease
        self.engine_error |= rep.engine_error
        if rep.first_output:
            lease.first_output()
        # The prompt IDs the relay counted are exact; a usage frame (always last) only
        # fills in when the engine sent none.
        self.prompt_ids = rep.prompt_ids or self.prompt_ids
        lease.measured.prompt_tokens = (
            self.prompt_ids or rep.prompt_tokens or lease.measured.prompt_tokens
        )
        if rep.cached_tokens is not None:
            lease.measured.cached_tokens = rep.cached_tokens
        if rep.fault_reason is not None:
            self.ended = True
            lease.fault(rep.fault_reason)
            return (
                rep.forward,
                error_event(f"engine stream rejected: {rep.fault_message}", rep.fault_reason),
                False,
            )
        if rep.done:
            self.ended = True
            lease.finished(self.relay.counted)
            return rep.forward, b"", True
        return rep.forward, None, None
