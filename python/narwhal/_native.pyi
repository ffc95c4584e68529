"""Narwhal's Rust hot paths (rust/core), exposed through PyO3 (rust/python).

Every method takes a whole network chunk or text delta: the boundary is crossed once per
chunk, never once per event or token.
"""

from collections.abc import Awaitable, Callable
from typing import Literal, final

from typing_extensions import Self

__all__ = [
    "Assembler",
    "AssemblyError",
    "HttpError",
    "PrefixMap",
    "PromptBlocks",
    "RelayChunk",
    "ResponseDecoder",
    "SseDecoder",
    "SseError",
    "SseEvent",
    "StreamRelay",
    "ThinkSplitter",
    "UpstreamReader",
    "__version__",
]

__version__: str

class SseError(ValueError):
    """The event stream is malformed (invalid UTF-8 at a byte offset, or an event too large)."""

class AssemblyError(ValueError):
    """The engine stream cannot be assembled into one response."""

    field: str
    """JSON path of the offending field, e.g. ``choices[0].delta.audio``."""

@final
class SseEvent:
    """One dispatched server-sent event."""

    @property
    def event(self) -> str | None: ...
    @property
    def data(self) -> str: ...
    @property
    def id(self) -> str | None: ...
    @property
    def retry(self) -> int | None: ...
    @property
    def is_done(self) -> bool:
        """Whether this is the ``[DONE]`` sentinel."""

@final
class SseDecoder:
    """Incremental WHATWG event-stream decoder (LF/CR/CRLF, BOM, splits anywhere)."""

    def __new__(cls, max_event_bytes: int = ...) -> Self: ...
    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Decode one chunk; raises :class:`SseError`. A failed decoder stays failed."""
    @property
    def has_pending(self) -> bool:
        """Whether an unfinished line or event is buffered."""

@final
class RelayChunk:
    """What one relayed chunk held."""

    @property
    def forward(self) -> bytes:
        """Whole SSE events to write to the client."""
    @property
    def events(self) -> int: ...
    @property
    def generation_events(self) -> int: ...
    @property
    def output_tokens(self) -> int:
        """Validated output token IDs in this chunk."""
    @property
    def first_output(self) -> bool:
        """This chunk carried the stream's first generated output."""
    @property
    def finished(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def engine_error(self) -> bool: ...
    @property
    def prompt_ids(self) -> int | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine served from its prefix cache, when it said."""
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def fault_reason(self) -> str | None:
        """Stable label when the stream failed (``missing_token_ids``, ``sse_invalid_utf8``...)."""
    @property
    def fault_message(self) -> str | None: ...

@final
class StreamRelay:
    """Decode an engine stream, validate token IDs, strip them if asked, re-frame events."""

    def __new__(
        cls,
        strip_token_ids: bool,
        require_token_ids: bool,
        drop_usage: bool = False,
        max_event_bytes: int = ...,
    ) -> Self:
        """`drop_usage`: read usage-only frames but do not forward them (the router asked
        the engine for usage its client did not ask for)."""
    def feed(self, chunk: bytes) -> RelayChunk: ...
    def push(self, chunk: bytes) -> bytes | RelayChunk:
        """`feed`, answering only the bytes to forward when the chunk held nothing but
        output (no first output, prompt IDs, usage, fault or end)."""
    @property
    def counted(self) -> int:
        """Output tokens so far (token IDs, else one per generation event)."""
    @property
    def has_pending(self) -> bool: ...

@final
class Assembler:
    """Assemble one non-streaming response from an engine's SSE stream."""

    def __new__(
        cls,
        kind: Literal["chat", "completion"],
        keep_token_ids: bool = False,
        require_token_ids: bool = False,
        max_event_bytes: int = ...,
    ) -> Self: ...
    def feed(self, chunk: bytes) -> bool:
        """Feed one chunk; True when it carried the first output. Raises :class:`AssemblyError`."""
    @property
    def done(self) -> bool: ...
    @property
    def measured_output_tokens(self) -> int: ...
    @property
    def reported_prompt_tokens(self) -> int | None:
        """The engine's own prompt count (prompt token IDs, else usage), if it sent one."""
    @property
    def reported_cached_tokens(self) -> int | None:
        """Prompt tokens the engine said it served from its prefix cache."""
    def finish(self, prompt_tokens: int | None = None) -> bytes:
        """The response JSON; ``prompt_tokens`` sizes usage when the engine sent none."""

@final
class ThinkSplitter:
    """Split streamed text into ``(reasoning, content)``, holding back partial delimiters."""

    def __new__(
        cls,
        pairs: list[tuple[str, str]] | None = None,
        start_in_reasoning: bool = False,
        answer_headers: list[str] | None = None,
    ) -> Self: ...
    def feed(self, text: str) -> tuple[str, str]: ...
    def finish(self) -> tuple[str, str]: ...
    @property
    def opened(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def in_reasoning(self) -> bool: ...

@final
class PromptBlocks:
    """A prompt's text cut into blocks of ``block_bytes``, each hashed on the one before."""

    def __new__(cls, text: bytes, block_bytes: int, seed: int) -> Self: ...
    @staticmethod
    def unpacked(raw: bytes) -> PromptBlocks:
        """Hashes another router packed (`packed`): the same prompt, without its text."""

    def packed(self) -> bytes:
        """The hashes, packed for another router."""

    def __len__(self) -> int: ...

@final
class PrefixMap:
    """Per engine (by index), the prompt blocks placed there, least recently used out first."""

    def __new__(cls, engines: int, capacity_blocks: int) -> Self: ...
    def matched(self, blocks: PromptBlocks) -> list[int]: ...
    def record(self, engine: int, blocks: PromptBlocks) -> None: ...
    def forget_after(self, engine: int, blocks: PromptBlocks, keep: int) -> None: ...
    def set_capacity(self, engine: int, capacity_blocks: int) -> None: ...
    def add_engine(self, capacity_blocks: int) -> int: ...
    def held(self, engine: int) -> bytes:
        """The blocks held for `engine`, newest first, packed."""

    def blocks(self, engine: int) -> int: ...
    @property
    def heap_bytes(self) -> int: ...

class HttpError(ValueError):
    """The engine's HTTP/1.1 response is malformed."""

@final
class ResponseDecoder:
    """Incremental HTTP/1.1 response decoder for one upstream exchange.

    Whole socket reads go in (from the receive buffer); the de-framed body bytes
    (chunked, length- or close-delimited) come out. ``1xx`` interim responses are skipped.
    """

    def __new__(cls) -> Self: ...
    def feed_buffer(self, buf: bytearray, n: int) -> bytes:
        """Decode one socket read, ``buf[:n]`` of a buffer the socket filled in place;
        returns the body bytes in it. Raises `HttpError`."""
    def eof(self) -> None:
        """The connection closed: completes a close-delimited body, else `HttpError`."""
    @property
    def head_done(self) -> bool: ...
    @property
    def status(self) -> int:
        """The final response's status (0 until its head is read)."""
    @property
    def retry_after(self) -> str | None: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def complete(self) -> bool:
        """Head, body and trailers have all been read."""
    @property
    def keep_alive(self) -> bool:
        """The connection may carry another request once the response is complete."""

@final
class UpstreamReader:
    """One upstream connection's receive side, bound as its asyncio protocol's
    ``get_buffer`` and ``buffer_updated``.

    Each read is de-framed by ``decoder``; its body goes to ``on_body`` — except while a
    stream is relayed (`start_relay`): a read holding only output then goes through the
    relay to ``send`` in Rust, and only a `RelayChunk` with more than output (or the
    exception ``send`` raised) goes to ``on_report``; when such a read also completed the
    response, ``on_body(b"")`` follows. A send whose result is not of ``sent_type`` did not
    go at once: the relay stops and ``on_report`` gets that awaitable, to see it through
    before anything else is sent. ``on_fault`` gets a malformed response's message,
    or None for bytes on a connection with no ``decoder``.
    """

    decoder: ResponseDecoder | None
    @property
    def reads(self) -> int: ...  # reads so far: a watchdog's measure of a quiet engine
    def __new__(
        cls,
        size: int,
        on_body: Callable[[bytes], object],
        on_fault: Callable[[str | None], object],
    ) -> Self: ...
    def get_buffer(self, sizehint: int) -> bytearray: ...
    def buffer_updated(self, nbytes: int) -> None: ...
    def start_relay(
        self,
        relay: StreamRelay,
        send: Callable[[dict[str, object]], object],
        on_report: Callable[[RelayChunk | BaseException | Awaitable[None]], object],
        sent_type: type,
    ) -> None: ...
    def stop_relay(self) -> None: ...
