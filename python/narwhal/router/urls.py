"""Engine URLs: the password kept out of everything shown or logged, and the credentials a
URL carries (`http://user:password@host`) sent with every request to that engine."""

from __future__ import annotations

import base64
from urllib.parse import unquote, urlsplit, urlunsplit


def redact(url: str) -> str:
    """The URL without a password in it (`user:pass@host` -> `user:***@host`)."""
    try:
        u = urlsplit(url)
        password = u.password
    except ValueError:
        return "<not a URL>"
    if password is None:
        return url
    host = u.netloc.rpartition("@")[2]
    return urlunsplit(u._replace(netloc=f"{u.username}:***@{host}"))


def credentials(url: str) -> tuple[str, str] | None:
    """The user and password a URL carries (percent-decoded), or None."""
    u = urlsplit(url)
    if u.username is None and u.password is None:
        return None
    return unquote(u.username or ""), unquote(u.password or "")


def authorization(url: str, api_key: str | None) -> str | None:
    """The Authorization header every request to this engine carries: its key as a bearer
    token, else the URL's credentials as Basic (as the health probes send them)."""
    if api_key:
        return f"Bearer {api_key}"
    cred = credentials(url)
    if cred is None:
        return None
    return "Basic " + base64.b64encode(f"{cred[0]}:{cred[1]}".encode()).decode("ascii")
