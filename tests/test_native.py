"""The Rust hot paths against the pure-Python references, on recorded-shape and generated
streams, under every way of splitting them into chunks."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal._native import (
    Assembler,
    AssemblyError,
    RelayChunk,
    ResponseDecoder,
    SseDecoder,
    SseError,
    StreamRelay,
    ThinkSplitter,
    UpstreamReader,
)
from tests.reference import RefSseDecoder, RefThinkSplitter, ref_assemble, ref_relay_event
from tests.streams import chat_stream, completion_stream, sse, tool_stream


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


def rust_events(chunks: list[bytes]) -> list[tuple[str | None, str, str | None]]:
    d = SseDecoder(1 << 16)
    return [(e.event, e.data, e.id) for c in chunks for e in d.feed(c)]


def ref_events(chunks: list[bytes]) -> list[tuple[str | None, str, str | None]]:
    d = RefSseDecoder(1 << 16)
    return [e for c in chunks for e in d.feed(c)]


line_end = st.sampled_from([b"\n", b"\r", b"\r\n"])
field_line = st.one_of(
    st.text(min_size=0, max_size=12).map(lambda t: b"data: " + t.encode()),
    st.text(min_size=0, max_size=6).map(lambda t: b"data:" + t.encode()),
    st.sampled_from([b"event: delta", b"id: 42", b": keepalive", b"retry: 10", b"data"]),
)


@st.composite
def raw_streams(draw: st.DrawFn) -> bytes:
    parts = [b"\xef\xbb\xbf"] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 12))):
        parts.append(draw(field_line) + draw(line_end))
        if draw(st.booleans()):
            parts.append(draw(line_end))
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(raw_streams(), st.lists(st.integers(0, 10_000), max_size=6))
def test_sse_decoder_matches_reference_under_any_split(stream: bytes, cuts: list[int]) -> None:
    whole = rust_events([stream])
    assert rust_events(chunked(stream, cuts)) == whole
    assert ref_events(chunked(stream, cuts)) == whole


def test_sse_invalid_utf8_names_the_offset() -> None:
    d = SseDecoder()
    d.feed(b"data: fine\n\n")
    with pytest.raises(SseError, match="offset 18"):
        d.feed(b"data: \xc3\x28\n\n")


def test_sse_event_size_is_bounded() -> None:
    d = SseDecoder(max_event_bytes=1000)
    with pytest.raises(SseError, match="exceeds 1000"):
        for _ in range(100):
            d.feed(b"data: " + b"x" * 100 + b"\n")


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40), st.booleans(), st.booleans(), st.lists(st.integers(0, 100_000), max_size=8)
)
def test_relay_matches_reference(n: int, strip: bool, reasoning: bool, cuts: list[int]) -> None:
    frames = chat_stream(n, token_ids=True, reasoning=reasoning)
    stream = sse(frames)
    relay = StreamRelay(strip_token_ids=strip, require_token_ids=True)
    forwarded, tokens = b"", 0
    for c in chunked(stream, cuts):
        rep = relay.feed(c)
        assert rep.fault_reason is None
        forwarded += rep.forward
        tokens += rep.output_tokens
    expect = b"".join(b"data: " + ref_relay_event(f, strip, True)[0] + b"\n\n" for f in frames)
    ref_tokens = sum(ref_relay_event(f, strip, True)[1] for f in frames)
    assert [
        orjson.loads(x[6:]) if x != b"data: [DONE]" else x for x in forwarded.split(b"\n\n") if x
    ] == [orjson.loads(x[6:]) if x != b"data: [DONE]" else x for x in expect.split(b"\n\n") if x]
    assert tokens == ref_tokens == n
    assert (b"token_ids" in forwarded) is (not strip)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.booleans(), st.lists(st.integers(0, 100_000), max_size=8))
def test_relay_push_answers_bytes_only_for_plain_output(n: int, ids: bool, cuts: list[int]) -> None:
    """`push` forwards what `feed` forwards; a read that starts the output, carries prompt
    IDs or usage, or ends the stream comes back as the full report; `counted` is the
    stream's output tokens either way."""
    stream = sse(chat_stream(n, token_ids=ids))
    pushed, fed = StreamRelay(True, ids), StreamRelay(True, ids)
    summed = 0
    for c in chunked(stream, cuts):
        got, rep = pushed.push(c), fed.feed(c)
        summed += rep.output_tokens or rep.generation_events
        plain = not (
            rep.first_output
            or rep.done
            or rep.fault_reason
            or rep.prompt_ids is not None
            or rep.prompt_tokens is not None
            or rep.cached_tokens is not None
        )
        assert isinstance(got, bytes) is plain
        assert (got if isinstance(got, bytes) else got.forward) == rep.forward
    assert pushed.counted == fed.counted == summed
    if ids:
        assert pushed.counted == n


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def http_chunked(frames: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in frames) + b"0\r\n\r\n"


class Loop:
    """Drives an `UpstreamReader` as asyncio drives a BufferedProtocol, and logs where
    each read's bytes went."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.reader = UpstreamReader(
            4096, lambda b: self.log.append(("body", b)), lambda m: self.log.append(("fault", m))
        )

    def read(self, data: bytes) -> None:
        buf = self.reader.get_buffer(-1)
        buf[: len(data)] = data
        self.reader.buffer_updated(len(data))

    def send(self, message: dict[str, object]) -> None:
        assert message["type"] == "http.response.body" and message["more_body"] is True
        self.log.append(("send", message["body"]))

    def report(self, rep: RelayChunk | BaseException) -> None:
        self.log.append(("report", rep))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.booleans(), st.lists(st.integers(0, 100_000), max_size=8))
def test_upstream_reader_relays_reads_to_send(n: int, ids: bool, cuts: list[int]) -> None:
    """While relaying, a read of nothing but output goes to `send` as the relay would
    forward it; any other read reaches `on_report` as the relay's full report; the
    response's end reaches `on_body` as b"" once, after the last report."""
    frames = [sse([f]) for f in chat_stream(n, token_ids=ids)]
    body = http_chunked(frames)
    loop, relay, reference = Loop(), StreamRelay(True, ids), StreamRelay(True, ids)
    loop.reader.decoder = ResponseDecoder()
    loop.read(HEAD)
    assert loop.log == [("body", b"")]
    loop.log.clear()
    loop.reader.start_relay(relay, loop.send, loop.report, type(None))
    decoder, expect = ResponseDecoder(), []
    decoder.feed_buffer(bytearray(HEAD), len(HEAD))
    for c in chunked(body, cuts):
        if not c:
            continue
        loop.read(c)
        part = decoder.feed_buffer(bytearray(c), len(c))
        if part:
            rep = reference.push(part)
            if isinstance(rep, bytes):
                if rep:
                    expect.append(("send", rep))
            else:
                expect.append(("report", rep.forward))
    expect.append(("body", b""))
    got = [(k, v.forward if isinstance(v, RelayChunk) else v) for k, v in loop.log]
    assert got == expect
    assert relay.counted == reference.counted == n
    assert b"".join(v for k, v in got if k != "body") == b"".join(
        StreamRelay(True, ids).feed(f).forward for f in frames
    )


def test_upstream_reader_faults_and_failed_sends() -> None:
    loop = Loop()
    loop.read(b"stray bytes")  # no exchange on the connection
    assert loop.log == [("fault", None)]
    loop.log.clear()
    loop.reader.decoder = ResponseDecoder()
    loop.read(HEAD + b"zz\r\n")  # not a chunk size
    assert len(loop.log) == 1 and loop.log[0][0] == "fault"
    assert "chunk" in str(loop.log[0][1])

    loop = Loop()
    loop.reader.decoder = ResponseDecoder()
    loop.read(HEAD)
    gone = ConnectionResetError("client went away")

    def send(message: dict[str, object]) -> None:
        raise gone

    relay = StreamRelay(True, False)
    loop.reader.start_relay(relay, send, loop.report, type(None))
    frames = [sse([f]) for f in chat_stream(2, token_ids=False)]
    loop.read(http_chunked(frames[:2])[:-5])  # the first output: a report, no send
    assert loop.log[-1][0] == "report"
    loop.read(http_chunked(frames[2:3])[:-5])  # plain output: `send` raises
    assert loop.log[-1] == ("report", gone)
    loop.reader.stop_relay()  # from now on every body goes to `on_body`, unrelayed
    plain = http_chunked(frames[3:4])[:-5]
    loop.read(plain)
    assert loop.log[-1] == ("body", frames[3])


def test_a_send_that_waits_stops_the_native_relay() -> None:
    """Granian's `send` returns something else than its empty awaitable when its channel to
    the client is full: that send has not happened yet, so nothing may go natively after
    it (it would overtake); the awaitable goes to `on_report` and reads go to `on_body`."""
    loop = Loop()
    loop.reader.decoder = ResponseDecoder()
    loop.read(HEAD)
    later = object()  # stands for the awaitable of a send still to happen
    sends: list[object] = []

    def send(message: dict[str, object]) -> object:
        sends.append(message["body"])
        return later if len(sends) == 2 else None

    loop.reader.start_relay(StreamRelay(True, False), send, loop.report, type(None))
    frames = [sse([f]) for f in chat_stream(4, token_ids=False)]
    loop.read(http_chunked(frames[:2])[:-5])  # first output: a report
    loop.read(http_chunked(frames[2:3])[:-5])  # sent at once
    loop.read(http_chunked(frames[3:4])[:-5])  # the send that waits
    assert loop.log[-1] == ("report", later) and len(sends) == 2
    loop.read(http_chunked(frames[4:5])[:-5])
    assert loop.log[-1] == ("body", frames[4]) and len(sends) == 2  # not natively


def test_relay_leaves_frames_without_ids_byte_identical() -> None:
    frames = chat_stream(5, token_ids=False)
    stream = sse(frames)
    rep = StreamRelay(strip_token_ids=True, require_token_ids=False).feed(stream)
    assert rep.forward == stream


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"delta": {"content": "x"}}, "missing_token_ids"),
        ({"delta": {"content": "x"}, "token_ids": [True]}, "boolean_token_id"),
        ({"delta": {"content": "x"}, "token_ids": [-3]}, "negative_token_id"),
        ({"delta": {"content": "x"}, "token_ids": [1.5]}, "non_integer_token_id"),
        ({"delta": {"tool_calls": [{"index": 0}]}, "token_ids": "1"}, "token_ids_not_a_list"),
        ({"delta": {"refusal": "no"}}, "missing_token_ids"),
    ],
)
def test_relay_token_id_faults(bad: dict[str, object], reason: str) -> None:
    frame = orjson.dumps({"choices": [{"index": 0, **bad}]}).decode()
    with pytest.raises(ValueError):
        ref_relay_event(frame, True, True)
    rep = StreamRelay(strip_token_ids=True, require_token_ids=True).feed(sse([frame]))
    assert rep.fault_reason == reason
    assert rep.forward == b""


@pytest.mark.parametrize(
    "make",
    [
        lambda: (chat_stream(30, token_ids=True, reasoning=True), "chat"),
        lambda: (tool_stream(), "chat"),
        lambda: (completion_stream(20, logprobs=True), "completion"),
    ],
)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 100_000), max_size=8))
def test_assembler_matches_reference(make: object, cuts: list[int]) -> None:
    frames, kind = make()  # type: ignore[operator]
    asm = Assembler(kind)
    for c in chunked(sse(frames), cuts):
        asm.feed(c)
    got = orjson.loads(asm.finish(0))
    want = ref_assemble(frames, kind)
    for ch in got["choices"]:
        ch.pop("stop_reason", None)
    assert got == want


def test_assembler_refuses_unknown_fields_by_name() -> None:
    asm = Assembler("chat")
    with pytest.raises(AssemblyError) as e:
        asm.feed(sse(['{"choices":[{"index":0,"delta":{"annotations":[{"x":1}]}}]}']))
    assert e.value.field == "choices[0].delta.annotations"


think_text = st.lists(
    st.sampled_from(
        ["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "é", "answer"]
    ),
    max_size=14,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(think_text, st.booleans(), st.lists(st.integers(0, 200), max_size=5))
def test_think_splitter_matches_reference(text: str, start_in: bool, cuts: list[int]) -> None:
    ref = RefThinkSplitter(start_in_reasoning=start_in)
    ref.text = text
    want = ref.split_all()
    t = ThinkSplitter(start_in_reasoning=start_in)
    pieces = [p.decode() for p in chunked(text.encode(), cuts) if _valid(p)]
    if "".join(pieces) != text:
        pieces = [text]
    r = c = ""
    for p in pieces:
        a, b = t.feed(p)
        r, c = r + a, c + b
    a, b = t.finish()
    assert (r + a, c + b) == want


def _valid(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False
