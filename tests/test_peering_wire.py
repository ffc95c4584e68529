"""What active routers send each other (router/peering/wire.py): every message a router
writes reads back as it was, and anything else is refused whole with WireError, never
another exception."""

from __future__ import annotations

import contextlib

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal._native import PrefixMap, PromptBlocks
from narwhal.router.peering.wire import (
    Admitted,
    Batch,
    Ended,
    Evicted,
    First,
    Picture,
    Placed,
    Progress,
    Released,
    Snapshot,
    Waited,
    Waiting,
    WireError,
    decode,
    encode_batch,
    encode_snapshot,
    seed_of,
)

ids = st.integers(1, 2**63 - 1)
counts = st.integers(0, 2**40)
names = st.text(min_size=1, max_size=40)
seconds = st.floats(0, 1e6, allow_nan=False)
packed = st.binary(max_size=80).map(lambda b: b[: len(b) - len(b) % 8])

placed = st.builds(
    Placed,
    ids,
    names,
    counts,
    st.none() | seconds,
    st.none() | packed,
    st.none() | st.text(max_size=50),
    st.none() | seconds,
    st.none() | counts,
    st.integers(0, 2),
    st.none() | counts,
    st.none() | names,
)
deltas = st.lists(
    st.one_of(
        placed,
        st.builds(First, ids),
        st.builds(
            Progress,
            st.lists(st.integers(1, 2**40), max_size=6).map(lambda x: x[: len(x) - len(x) % 2]),
        ),
        st.builds(Ended, ids, counts, seconds, st.booleans()),
        st.builds(Admitted, ids, names, counts),
        st.builds(Evicted, names, packed, counts),
        st.builds(Released, ids, st.none() | counts),
        st.builds(Waiting, ids, st.integers(0, 63), counts),
        st.builds(Waited, ids),
    ),
    max_size=20,
)


@given(names, ids, ids, deltas)
def test_a_batch_reads_back_as_it_was_written(sender: str, token: int, seq: int, ds: list) -> None:
    b = Batch(sender, token, seq, ds)
    msg, picture = decode(encode_batch(b))
    assert msg == b
    assert picture is None


waiters = st.lists(st.tuples(ids, st.integers(0, 63), counts, seconds), max_size=5)


@given(names, ids, ids, st.lists(placed, max_size=5), st.lists(ids, max_size=5), waiters)
def test_a_snapshot_and_a_picture_read_back(
    sender: str,
    token: int,
    seq: int,
    ps: list[Placed],
    decoding: list[int],
    waiting: list[tuple[int, int, int, float]],
) -> None:
    snap = Snapshot(sender, token, seq, ps, decoding, [Admitted(1, "team", 5)], waiting)
    pic = Picture({"gpu0": b"\x01" * 16}, [("conv", "gpu0")], b'{"gpu0": {}}')
    msg, got = decode(encode_snapshot(snap, pic))
    assert msg == snap
    assert got == pic


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@given(json_values)
def test_anything_else_is_refused_whole(value: object) -> None:
    try:
        raw = orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return
    with contextlib.suppress(WireError):
        decode(raw)


@given(
    st.lists(st.sampled_from(["p", "f", "k", "e", "x", "t", "u", "w", "v", 1, None, "y"])),
    json_values,
)
def test_a_delta_of_any_shape_is_read_or_refused(head: list[object], tail: object) -> None:
    body = {"from": "r", "token": 1, "seq": 1, "deltas": [[*head, tail], head]}
    with contextlib.suppress(WireError):
        decode(orjson.dumps(body))


def test_an_end_from_a_router_that_does_not_say_finished_reads_as_not() -> None:
    # Routers before 2026-12-06 wrote four members: such an end teaches no answer length.
    body = {"from": "r", "token": 1, "seq": 1, "deltas": [["e", 7, 40, 0.5]]}
    msg, _ = decode(orjson.dumps(body))
    assert isinstance(msg, Batch) and msg.deltas == [Ended(7, 40, 0.5, False)]
    body["deltas"] = [["e", 7, 40, 0.5, 1]]  # not a boolean: refused whole
    with pytest.raises(WireError):
        decode(orjson.dumps(body))


@given(st.binary(max_size=200))
def test_bytes_are_read_or_refused(raw: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(raw)


def test_blocks_travel_as_the_same_prompt() -> None:
    text = b"the same system prompt, long enough for several blocks of text " * 8
    seed = seed_of("shared")
    assert seed == seed_of("shared") != seed_of("other")
    here = PromptBlocks(text, 16, seed)
    there = PromptBlocks.unpacked(here.packed())
    m = PrefixMap(1, 1000)
    m.record(0, there)
    assert m.matched(here) == [len(here)]
    # An engine's picture, held and given to another map, matches as the first did.
    copy = PrefixMap(1, 1000)
    copy.record(0, PromptBlocks.unpacked(m.held(0)))
    assert copy.matched(here) == [len(here)]
    try:
        PromptBlocks.unpacked(b"\x00" * 7)
    except ValueError:
        pass
    else:
        raise AssertionError("7 bytes are no hash")


def test_a_joiner_reads_a_picture_that_comes_in_pieces() -> None:
    """A loaded fleet's picture is hundreds of kilobytes: it arrives in pieces, and the
    joiner must read them all (reading what had arrived took the first piece alone)."""
    import asyncio
    from typing import Any, cast

    import aiohttp
    from aiohttp import web

    from narwhal.router.ha.leadership import Leadership
    from narwhal.router.metrics import RouterMetrics
    from narwhal.router.peering.exchange import PATH, Exchange
    from narwhal.router.policies.open import OpenPolicy

    snap = Snapshot("peer", 7, 3, [], [], [Admitted(1, "team", 5)])
    pic = Picture({f"gpu{i}": bytes(range(8)) * 2000 for i in range(8)}, [("c", "gpu0")], None)
    body = encode_snapshot(snap, pic)
    assert len(body) > 100_000

    async def serve(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        third = len(body) // 3
        for piece in (body[:third], body[third : 2 * third], body[2 * third :]):
            await resp.write(piece)
            await asyncio.sleep(0.05)  # apart on the wire: three reads, not one
        await resp.write_eof()
        return resp

    async def main() -> Any:
        app = web.Application()
        app.router.add_get(PATH, serve)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = cast(Any, site._server).sockets[0].getsockname()[1]
        ex = Exchange(Leadership(None), OpenPolicy(), cast(Any, None), RouterMetrics(), "s", 60)
        async with aiohttp.ClientSession() as session:
            ex.start(session)
            got = await ex._fetch(f"http://127.0.0.1:{port}", picture=True)
        await runner.cleanup()
        return got

    assert asyncio.run(main()) == (snap, pic)
