"""Assembly: a non-streaming client's answer, built from the engine's stream."""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal import asgi
from narwhal._native import Assembler, AssemblyError
from narwhal.asgi import Send
from narwhal.errors import ApiError
from narwhal.router.connection import Exchange
from narwhal.router.lease import Lease
from narwhal.router.relay.errors import EngineFailed, engine_refusal

if TYPE_CHECKING:
    from narwhal.router.relay.reading import Reading


async def assemble(rl: Reading, lease: Lease, resp: Exchange, send: Send) -> bool:
    """A non-streaming answer: the engine's stream assembled into one response (Rust);
    False where the engine's own error came in its stream (relayed as its answer)."""
    e = lease.on
    asm = Assembler(
        lease.request.kind,
        keep_token_ids=lease.request.wants_token_ids,
        require_token_ids=e.spec.token_ids,
    )
    lease.measured.tally = _Counted(asm)
    chunk = b""
    try:
        while not asm.done:
            chunk = await rl.read(lease, resp)
            if not chunk:
                if e.cut:
                    lease.fault("engine_removed")
                    raise EngineFailed("the engine was removed before the answer ended")
                lease.fault("engine_disconnected", "stream ended early")
                raise EngineFailed("the engine stream ended before [DONE]")
            if asm.feed(chunk):
                lease.first_output()
        body = asm.finish(lease.request.estimated_prompt_tokens())
        # Only the engine's own count: the estimate must not be learned from itself.
        lease.measured.prompt_tokens = asm.reported_prompt_tokens
        lease.measured.cached_tokens = asm.reported_cached_tokens
    except AssemblyError as exc:
        refusal = engine_refusal(chunk) if exc.field == "error" else None
        if refusal is not None:  # the engine's own error, in its stream: its answer
            lease.fault("engine_error")
            await asgi.send_bytes(send, *refusal)
            lease.measured.answered = False
            return False
        lease.fault("assembly")
        raise ApiError(
            502,
            f"the engine's output cannot be assembled: {exc}",
            type="server_error",
            param=getattr(exc, "field", None),
            code="bad_engine_output",
        ) from None
    lease.first_byte()
    await asgi.send_bytes(send, 200, body)
    lease.measured.answered = True
    lease.finished(asm.measured_output_tokens)
    return True


class _Counted:
    """The assembler's count of output tokens so far, as a `Tally`."""

    __slots__ = ("asm",)

    def __init__(self, asm: Assembler) -> None:
        self.asm = asm

    @property
    def counted(self) -> int:
        return self.asm.measured_output_tokens
