"""What active routers tell each other, as it travels: read strictly, bounded, and refused
whole (`WireError`) when any part of it is not what a router writes.

A sender's messages are numbered: each delta has the next sequence number of the sender's
term (its fencing token), so a receiver knows when it missed one and asks for a snapshot
instead of folding a picture with a hole in it.

Deltas (lists, the kind first):

- `["p", id, engine, tokens, predicted_s, blocks, session, stall_s, n, rank, cap, tenant]`:
  work placed on `engine`: `tokens` to prefill, its projected TTFT (None: none), its
  prompt's block hashes (base64 of packed u64s; None), its conversation's key, the prefill
  seconds charged to the engine's TPOT ledger and the length its stream is held to (None:
  no TPOT target), its class, its max_tokens, its tenant;
- `["f", id]`: its first token came (its prefill has run; it decodes);
- `["k", [id, tokens, id, tokens, ...]]`: the decoding streams whose output tokens so far
  changed since the last such delta, each with its count (told every PROGRESS_S: the TPOT
  ledger measures them as the placing router does);
- `["e", id, output_tokens, decode_s, finished]`: it ended (its seat is free); `finished`
  (absent from routers before 2026-12-06: false) when the answer ended on its own, short of
  its max_tokens, so that its length teaches every router's answer lengths (a cut or capped
  answer's does not);
- `["x", engine, blocks, keep]`: `engine` was found to hold only the first `keep` of these
  blocks (its answer's cached tokens said so): the picture drops the rest;
- `["t", id, tenant, tokens]`: a request of `tenant` was let in, its prompt's estimate;
- `["u", id, tokens]`: that request ended, with what it measured (None: nothing);
- `["w", id, order, size]`: a request of `order` (its place among waiters: lower goes
  first) and a prompt of `size` bytes began to wait for an engine to keep its streams'
  pace;
- `["v", id]`: it no longer waits (placed, refused or gone).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import orjson

# A batch of deltas, and a snapshot (every piece of work live at a router, and its picture of
# every engine's cache): what one message may hold.
MAX_DELTAS = 8192
MAX_BODY = 64 * 1024 * 1024
MAX_NAME = 256  # engines', tenants', routers' names
MAX_SESSION = 512
MAX_BLOCKS_B64 = 4 * 1024 * 1024  # a prompt's hashes: 8 bytes a block of 16+ bytes of text
MAX_ID = 2**63 - 1
MAX_ORDER = 63  # a waiter's order (the router's own are fewer: a bound, not a meaning)


def seed_of(secret: str) -> int:
    """The prompt-block hash seed active routers share, drawn from their secret: the same
    on each, unknown to clients (who could otherwise aim a collision at another's prefix)."""
    digest = hashlib.blake2b(secret.encode(), digest_size=8, person=b"narwhal-prefix").digest()
    return int.from_bytes(digest, "little")


class WireError(ValueError):
    """A message no router writes: refused whole (400)."""


@dataclass(frozen=True, slots=True)
class Placed:
    id: int
    engine: str
    tokens: int
    predicted_s: float | None
    blocks: bytes | None  # packed hashes
    session: str | None
    stall_s: float | None
    n: int | None
    rank: int
    cap: int | None
    tenant: str | None

    def row(self) -> list[Any]:
        b = base64.b64encode(self.blocks).decode() if self.blocks is not None else None
        return [
            "p",
            self.id,
            self.engine,
            self.tokens,
            self.predicted_s,
            b,
            self.session,
            self.stall_s,
            self.n,
            self.rank,
            self.cap,
            self.tenant,
        ]


@dataclass(frozen=True, slots=True)
class First:
    id: int

    def row(self) -> list[Any]:
        return ["f", self.id]


@dataclass(frozen=True, slots=True)
class Progress:
    counts: list[int]  # id, tokens, id, tokens, ...

    def row(self) -> list[Any]:
        return ["k", self.counts]


@dataclass(frozen=True, slots=True)
class Ended:
    id: int
    output_tokens: int
    decode_s: float
    finished: bool = False

    def row(self) -> list[Any]:
        return ["e", self.id, self.output_tokens, self.decode_s, self.finished]


@dataclass(frozen=True, slots=True)
class Evicted:
    engine: str
    blocks: bytes  # packed hashes
    keep: int

    def row(self) -> list[Any]:
        return ["x", self.engine, base64.b64encode(self.blocks).decode(), self.keep]


@dataclass(frozen=True, slots=True)
class Admitted:
    id: int
    tenant: str
    tokens: int

    def row(self) -> list[Any]:
        return ["t", self.id, self.tenant, self.tokens]


@dataclass(frozen=True, slots=True)
class Released:
    id: int
    tokens: int | None

    def row(self) -> list[Any]:
        return ["u", self.id, self.tokens]


@dataclass(frozen=True, slots=True)
class Waiting:
    id: int
    order: int
    size: int  # its prompt's bytes

    def row(self) -> list[Any]:
        return ["w", self.id, self.order, self.size]


@dataclass(frozen=True, slots=True)
class Waited:
    id: int

    def row(self) -> list[Any]:
        return ["v", self.id]


Delta = Placed | First | Progress | Ended | Evicted | Admitted | Released | Waiting | Waited


@dataclass(frozen=True, slots=True)
class Batch:
    """Deltas from router `sender` in its term `token`, the first numbered `seq`."""

    sender: str
    token: int
    seq: int
    deltas: list[Delta]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything live at router `sender` now (its work placed, its first tokens, its
    tenants' requests, its requests waiting for pace), the next delta to be numbered
    `seq`."""

    sender: str
    token: int
    seq: int
    placed: list[Placed]
    decoding: list[int]  # ids of those whose first token came
    admitted: list[Admitted]
    # Its requests waiting for pace: (id, order, prompt bytes, seconds waited so far).
    waiting: list[tuple[int, int, int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Picture:
    """A router's picture of the fleet, for one that joins: each engine's cached blocks
    (packed, newest first), the conversations' engines, and its predictor's profiles."""

    cache: dict[str, bytes]
    sessions: list[tuple[str, str]]
    profiles: bytes | None


def encode_batch(b: Batch) -> bytes:
    return orjson.dumps(
        {"from": b.sender, "token": b.token, "seq": b.seq, "deltas": [d.row() for d in b.deltas]}
    )


def encode_snapshot(s: Snapshot, picture: Picture | None = None) -> bytes:
    body: dict[str, Any] = {
        "from": s.sender,
        "token": s.token,
        "seq": s.seq,
        "snapshot": {
            "placed": [p.row() for p in s.placed],
            "decoding": s.decoding,
            "admitted": [a.row() for a in s.admitted],
            "waiting": [list(w) for w in s.waiting],
        },
    }
    if picture is not None:
        body["picture"] = {
            "cache": {k: base64.b64encode(v).decode() for k, v in picture.cache.items()},
            "sessions": [list(kv) for kv in picture.sessions],
            "profiles": picture.profiles.decode() if picture.profiles is not None else None,
        }
    return orjson.dumps(body)


def decode(raw: bytes) -> tuple[Batch | Snapshot, Picture | None]:
    """A message as a router wrote it, or WireError."""
    if len(raw) > MAX_BODY:
        raise WireError(f"a message is at most {MAX_BODY} bytes")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise WireError("not JSON") from None
    if not isinstance(data, dict):
        raise WireError("not an object")
    sender = _name(data.get("from"), "from")
    token, seq = _id(data.get("token"), "token"), _count(data.get("seq"), "seq")
    picture = _picture(data["picture"]) if data.get("picture") is not None else None
    if "snapshot" in data:
        snap = data["snapshot"]
        if not isinstance(snap, dict):
            raise WireError("snapshot: not an object")
        placed = [_placed(r) for r in _rows(snap.get("placed"), "snapshot.placed")]
        decoding = [_id(i, "snapshot.decoding") for i in _rows(snap.get("decoding"), "decoding")]
        admitted = [_admitted(r) for r in _rows(snap.get("admitted"), "snapshot.admitted")]
        waiting = [_waiter(r) for r in _rows(snap.get("waiting", []), "snapshot.waiting")]
        return Snapshot(sender, token, seq, placed, decoding, admitted, waiting), picture
    deltas = [_delta(r) for r in _rows(data.get("deltas"), "deltas")]
    return Batch(sender, token, seq, deltas), picture


def _rows(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise WireError(f"{what}: not a list")
    if len(v) > MAX_DELTAS * 16:
        raise WireError(f"{what}: too many")
    return v


def _delta(r: Any) -> Delta:
    if not isinstance(r, list) or not r:
        raise WireError("a delta is a non-empty list")
    kind = r[0]
    if kind == "p":
        return _placed(r)
    if kind == "f" and len(r) == 2:
        return First(_id(r[1], "id"))
    if kind == "k" and len(r) == 2:
        counts = r[1]
        if not isinstance(counts, list) or len(counts) % 2 or len(counts) > 2 * MAX_DELTAS * 16:
            raise WireError("progress: [id, tokens, ...] pairs")
        for i in range(0, len(counts), 2):
            _id(counts[i], "progress id")
            _count(counts[i + 1], "progress tokens")
        return Progress(counts)
    if kind == "e" and len(r) in (4, 5):
        finished = r[4] if len(r) == 5 else False
        if type(finished) is not bool:
            raise WireError("finished: true or false")
        return Ended(
            _id(r[1], "id"), _count(r[2], "output_tokens"), _seconds(r[3], "decode_s"), finished
        )
    if kind == "x" and len(r) == 4:
        return Evicted(_name(r[1], "engine"), _blocks(r[2]), _count(r[3], "keep"))
    if kind == "t":
        return _admitted(r)
    if kind == "u" and len(r) == 3:
        return Released(_id(r[1], "id"), None if r[2] is None else _count(r[2], "tokens"))
    if kind == "w" and len(r) == 4:
        return Waiting(_id(r[1], "id"), _order(r[2]), _count(r[3], "size"))
    if kind == "v" and len(r) == 2:
        return Waited(_id(r[1], "id"))
    raise WireError(f"not a delta: {str(kind)[:20]!r} with {len(r)} members")


def _placed(r: Any) -> Placed:
    if not isinstance(r, list) or len(r) != 12 or r[0] != "p":
        raise WireError("a placement is ['p', and 11 members]")
    blocks = None if r[5] is None else _blocks(r[5])
    session = r[6]
    if session is not None and not (isinstance(session, str) and len(session) <= MAX_SESSION):
        raise WireError("session: not a conversation's key")
    rank = r[9]
    if type(rank) is not int or not 0 <= rank <= 2:
        raise WireError("rank: 0, 1 or 2")
    return Placed(
        _id(r[1], "id"),
        _name(r[2], "engine"),
        _count(r[3], "tokens"),
        None if r[4] is None else _seconds(r[4], "predicted_s"),
        blocks,
        session,
        None if r[7] is None else _seconds(r[7], "stall_s"),
        None if r[8] is None else _count(r[8], "n"),
        rank,
        None if r[10] is None else _count(r[10], "cap"),
        None if r[11] is None else _name(r[11], "tenant"),
    )


def _blocks(v: Any) -> bytes:
    if not isinstance(v, str) or len(v) > MAX_BLOCKS_B64:
        raise WireError("blocks: not base64 of packed hashes")
    try:
        blocks = base64.b64decode(v, validate=True)
    except binascii.Error:
        raise WireError("blocks: not base64") from None
    if len(blocks) % 8:
        raise WireError("blocks: 8 bytes a hash")
    return blocks


def _admitted(r: Any) -> Admitted:
    if not isinstance(r, list) or len(r) != 4 or r[0] != "t":
        raise WireError("an admission is ['t', id, tenant, tokens]")
    return Admitted(_id(r[1], "id"), _name(r[2], "tenant"), _count(r[3], "tokens"))


def _waiter(r: Any) -> tuple[int, int, int, float]:
    if not isinstance(r, list) or len(r) != 4:
        raise WireError("a waiter is [id, order, size, age_s]")
    return _id(r[0], "id"), _order(r[1]), _count(r[2], "size"), _seconds(r[3], "age_s")


def _order(v: Any) -> int:
    if type(v) is not int or not 0 <= v <= MAX_ORDER:
        raise WireError(f"order: 0 to {MAX_ORDER}")
    return v


def _picture(p: Any) -> Picture:
    if not isinstance(p, dict):
        raise WireError("picture: not an object")
    cache_in = p.get("cache")
    if not isinstance(cache_in, dict) or len(cache_in) > 4096:
        raise WireError("picture.cache: not an object of engines")
    cache = {}
    for name, b64 in cache_in.items():
        if not isinstance(b64, str):
            raise WireError("picture.cache: base64 of packed hashes")
        try:
            raw = base64.b64decode(b64, validate=True)
        except binascii.Error:
            raise WireError("picture.cache: not base64") from None
        if len(raw) % 8:
            raise WireError("picture.cache: 8 bytes a hash")
        cache[_name(name, "picture.cache")] = raw
    sessions = []
    for kv in _rows(p.get("sessions"), "picture.sessions"):
        if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)):
            raise WireError("picture.sessions: [key, engine] pairs")
        if len(kv[0]) > MAX_SESSION:
            raise WireError("picture.sessions: a key too long")
        sessions.append((kv[0], _name(kv[1], "picture.sessions")))
    profiles = p.get("profiles")
    if profiles is not None and not isinstance(profiles, str):
        raise WireError("picture.profiles: the predictor's export")
    return Picture(cache, sessions, profiles.encode() if profiles is not None else None)


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME:
        raise WireError(f"{what}: a name of 1 to {MAX_NAME} characters")
    return v


def _id(v: Any, what: str) -> int:
    if type(v) is not int or not 0 < v <= MAX_ID:
        raise WireError(f"{what}: a positive integer")
    return v


def _count(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_ID:
        raise WireError(f"{what}: a count")
    return v


def _seconds(v: Any, what: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v < 1e7:
        raise WireError(f"{what}: seconds")
    return float(v)
