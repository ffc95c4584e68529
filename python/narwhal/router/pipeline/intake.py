"""Intake: the body's JSON and shape, the refusal rows that need no engine, and sizing;
its output is the request record (`router/request.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from narwhal.errors import invalid, json_object
from narwhal.router.models import not_found
from narwhal.router.request import CHAT, RESPONSES, Request, input_parts, text_parts


def _type(body: dict[str, Any], name: str, kind: type | tuple[type, ...], label: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise invalid(f"'{name}' must be {label}", name)
    if not isinstance(v, kind):
        raise invalid(f"'{name}' must be {label}", name)
    return v


def _text_bytes(content: Any) -> int:
    return sum(len(p) for p in text_parts(content))


def _message_bytes(m: dict[str, Any]) -> int:
    """A message's share of the prompt: its text, and the tool calls it made (a history's
    calls are rendered into the prompt with their arguments)."""
    n = _text_bytes(m.get("content"))
    calls = m.get("tool_calls")
    if calls:
        n += _json_bytes(calls)
    return n


# What else a template renders into the prompt: the tools' schemas, the legacy functions,
# a JSON schema to answer in, the template's own arguments. A tenant's tokens a minute are
# estimated from all of it: 8 KB is 8 KB whether it sits in `messages` or in `tools`.
_BESIDE = ("tools", "functions", "response_format", "chat_template_kwargs")


def _beside_bytes(body: dict[str, Any]) -> int:
    return sum(_json_bytes(body[k]) for k in _BESIDE if body.get(k))


def _json_bytes(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return 0  # too deep: refused before this counts (_refuse_too_deep)


# orjson reads JSON nested up to 1,024 levels but writes only 255: a body between the two
# would pass intake and fail when it is written for the engine, after placement.
_MAX_DEPTH = 255


def _refuse_too_deep(raw: bytes, body: dict[str, Any]) -> None:
    if raw.count(b"[") + raw.count(b"{") <= _MAX_DEPTH:  # cannot nest that deep: no walk
        return
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise invalid(f"the request body nests JSON deeper than {_MAX_DEPTH} levels") from None


def check(
    route: str,
    raw: bytes,
    models: str | Callable[[str | None], str],
    session: str | None = None,
) -> Request:
    """The checked request (or the client's error); `models`: the one model served (any
    other name is 404) or what resolves a name to the served model (`Catalog.resolve`);
    `session`: the conversation's key from the request's header, over the body's `user`."""
    body = json_object(raw)
    _refuse_too_deep(raw, body)

    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise invalid("'model' must be a string", "model")
    if isinstance(models, str):
        if name is not None and name != models:
            raise not_found(name)
        served = models
    else:
        served = models(name)
    model = name if name is not None else served

    stream = bool(_type(body, "stream", bool, "a boolean"))
    for width in ("n", "best_of"):
        v = _type(body, width, int, "an integer")
        if v is not None and v > 1:
            raise invalid(f"Invalid sampling width: {width} must be 1", width)
        if v is not None and v < 1:
            raise invalid(f"'{width}' must be at least 1", width)
    most = None
    for limit in ("max_tokens", "max_completion_tokens"):
        v = _type(body, limit, int, "an integer")
        if v is not None and v < 1:
            raise invalid(f"'{limit}' must be at least 1", limit)
        if v is not None:
            most = v if most is None else min(most, v)
    wants_ids = bool(_type(body, "return_token_ids", bool, "a boolean"))
    opts = _type(body, "stream_options", dict, "an object") or {}
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("'include_usage' must be a boolean", "stream_options.include_usage")

    if not session:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    if route == RESPONSES:
        v = body.get("max_output_tokens")
        most = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        size = _input_bytes(body) + _beside_bytes(body)
        return Request(route, body, stream, False, False, size, session, most, model, served)
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a nonempty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise invalid("each message must be an object with a role", f"messages[{i}]")
        prompt_bytes = sum(_message_bytes(m) for m in messages) + _beside_bytes(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_bytes = len(prompt.encode())
        elif isinstance(prompt, list) and prompt:
            prompt_bytes = sum(len(p.encode()) if isinstance(p, str) else 4 for p in prompt)
        else:
            raise invalid("'prompt' must be a string or a nonempty list", "prompt")
        prompt_bytes += _beside_bytes(body)

    if not stream:
        _refuse_unassemblable(body)
    tools = _type(body, "tools", list, "a list")
    for i, t in enumerate(tools or ()):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise invalid("only function tools are supported", f"tools[{i}].type")
    return Request(
        route,
        body,
        stream,
        wants_ids,
        include_usage,
        prompt_bytes,
        session,
        most,
        model,
        served,
    )


def _input_bytes(body: dict[str, Any]) -> int:
    """A Responses request's prompt size: `instructions` and `input` (a string or items)."""
    raw = body.get("input")
    if not isinstance(raw, str) and (not isinstance(raw, list) or not raw):
        raise invalid("'input' must be a string or a nonempty list of items", "input")
    return sum(len(p) for p in input_parts(body))


def _refuse_unassemblable(body: dict[str, Any]) -> None:
    """What the non-streaming assembler could never return is refused up front."""
    if body.get("audio") is not None:
        raise invalid("audio output is not supported", "audio")
    mods = body.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise invalid("only the text modality is supported", "modalities")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text", "json_object", "json_schema"):
        raise invalid("unsupported response_format", "response_format.type")
