"""Logging for both programs: `--log-format text|json`, `--log-level`, and the access log.

The CLI leaves the choice in the environment (`NARWHAL_LOG_FORMAT`, `NARWHAL_LOG_LEVEL`: no
secrets) and the worker sets its handler from it. An access-log line is a record of logger
`narwhal.access` (router) or `lexi.access` (LexiEngine) whose fields go out as `key=value`
in text and as JSON members in JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from typing import Any

import orjson

from narwhal.asgi import Record

FORMAT_ENV, LEVEL_ENV = "NARWHAL_LOG_FORMAT", "NARWHAL_LOG_LEVEL"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


# A text line is one record: a control character a client chose (a path with %0A, a
# header) must not start what reads as a second, genuine line. Backslashes are escaped
# too, so an escape written by the client cannot pass for one written here.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}
_ESCAPES |= {ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def clean(text: str) -> str:
    """`text` on one line: control characters (and Unicode's line separators) escaped."""
    if text.isprintable() and "\\" not in text:
        return text  # the common case, checked in C
    out = text.translate(_ESCAPES)
    if out.isprintable():
        return out
    return "".join(ch if ch.isprintable() else f"\\u{ord(ch):04x}" for ch in out)


class _Text(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        head = f"{self.formatTime(record)} {record.levelname} {record.name} "
        line = head + clean(record.getMessage())
        extra = " ".join(
            f"{k}={clean(str(v))}" for k, v in _fields(record).items() if v is not None
        )
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            # The traceback stays on its lines: ours, and a reader expects them.
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def choose(fmt: str, level: str) -> None:
    """In the main process: what the worker will use (checked by argparse's choices)."""
    os.environ[FORMAT_ENV] = fmt
    os.environ[LEVEL_ENV] = level


def setup() -> None:
    """In the worker: one handler on stderr, as chosen."""
    fmt = os.environ.get(FORMAT_ENV, "text")
    level = os.environ.get(LEVEL_ENV, "info").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Json() if fmt == "json" else _Text())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level, logging.INFO))
    _access.stream, _access.json = handler.stream, fmt == "json"


class _Access:
    """Access lines written straight to the handler's stream, in the handler's format: one a
    request, so the logging machinery's ~40 µs (a LogRecord, a lock, strftime) would be paid
    per request on the event loop; this costs a few µs."""

    def __init__(self) -> None:
        self.stream: Any = None  # set by setup(); None: access lines off
        self.json = False
        self._second = -1
        self._stamp = ""

    def stamp(self, now: float) -> str:
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"


_access = _Access()


def access(logger: logging.Logger, method: str, path: str, rec: Record, started: float) -> None:
    """One request's access line: `METHOD PATH STATUS` and its fields."""
    stream = _access.stream
    if stream is None or not logger.isEnabledFor(logging.INFO):
        return
    fields = {
        "request_id": rec.id,
        "ms": round((time.monotonic() - started) * 1000, 1),
        **rec.fields,
    }
    now = time.time()
    if _access.json:
        out = {
            "ts": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": "info",
            "logger": logger.name,
            "msg": f"{method} {path} {rec.status}",
            **fields,
        }
        line = orjson.dumps(out, default=str).decode()
    else:
        extra = " ".join(f"{k}={clean(str(v))}" for k, v in fields.items() if v is not None)
        line = (
            f"{_access.stamp(now)} INFO {logger.name} {clean(method)} {clean(path)} "
            f"{rec.status} {extra}"
        )
    with contextlib.suppress(OSError, ValueError):
        stream.write(line + "\n")  # stderr is line-buffered: one write, one line


def add_arguments(p: Any) -> None:
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="log lines as text or one JSON object each (default %(default)s)",
    )
    p.add_argument(
        "--log-level",
        choices=LEVELS,
        default="info",
        help="the least important lines logged (default %(default)s)",
    )
