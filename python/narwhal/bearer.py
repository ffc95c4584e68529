"""`Authorization: Bearer KEY` checks, shared by the router's client keys, its admin token
and LexiEngine's `--api-key`: every key compared in constant time, 401 in the envelope."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from narwhal import asgi
from narwhal.asgi import Scope
from narwhal.errors import ApiError


def require(scope: Scope, keys: Sequence[bytes], what: str = "API key") -> None:
    match(scope, keys, what)


def match(scope: Scope, keys: Sequence[bytes], what: str = "API key") -> int:
    """The index of the key the request came with, or 401."""
    auth = asgi.header(scope, b"authorization") or ""
    # The header's own bytes (asgi.header decodes them as Latin-1, one char a byte): a key
    # is its UTF-8 bytes, so a non-ASCII key matches a client that sends it in UTF-8.
    given = auth[7:].encode("latin-1") if auth[:7].lower() == "bearer " else b""
    # Every key compared, each in constant time: which one matched does not show.
    found = -1
    for i, k in enumerate(keys):
        if hmac.compare_digest(given, k):
            found = i
    if found < 0:
        raise ApiError(
            401,
            f"invalid or missing {what} (Authorization: Bearer ...)",
            type="authentication_error",
            code="invalid_api_key",
        )
    return found
