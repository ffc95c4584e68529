"""Intake: the body's JSON and shape, the refusal rows that need no engine, and sizing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from narwhal.errors import ApiError, invalid, json_object

if TYPE_CHECKING:
    from narwhal.router.tracing import RequestTrace

CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
RESPONSES = "/v1/responses"
# The dialects whose engines serve the Responses API (relayed as they answer it).
RESPONSES_DIALECTS = frozenset({"lexi", "vllm", "openai"})


@dataclass
class Intake:
    route: str  # CHAT | COMPLETION | RESPONSES
    body: dict[str, Any]
    stream: bool
    wants_token_ids: bool
    include_usage: bool
    prompt_bytes: int
    # The conversation's routing key (`x-session-id`, else the body's `user`), if any.
    session: str | None = None
    max_tokens: int | None = None  # the most output tokens asked for, if the body says
    tenant: str = ""  # whose request (its client key's tenant; "": none)
    rank: int = 1  # its priority class, 0 critical .. 2 sheddable (tenants.fair_queue)
    # The share of its TTFT budget, and of the streams' TPOT allowance, it is admitted
    # against (less for lower classes and for a tenant over its fair share).
    share: float = 1.0
    # Its place among requests waiting for pace: its class, and within a class a tenant
    # over its fair share after the others (0 .. 5; lower goes first).
    standing: int = 2
    trace: RequestTrace | None = None  # its spans' times, where it is traced (router.tracing)

    @property
    def kind(self) -> Literal["chat", "completion"]:
        return "chat" if self.route == CHAT else "completion"

    @property
    def passthrough(self) -> bool:
        """Relayed as the engine answers it, neither validated nor assembled (Responses)."""
        return self.route == RESPONSES

    def prefix_text(self) -> bytes:
        """The prompt's text as one byte string in prompt order (tools, then each message's
        role and content): what cache-aware placement hashes, equal wherever prompts agree.
        Made on demand: only that policy reads it."""
        b = self.body
        if self.route == RESPONSES:
            return b"".join(_input_parts(b))
        tools = b.get("tools")
        # Tools come first in a rendered prompt: requests that differ in them share no prefix.
        parts = [orjson.dumps(tools)] if tools else []
        if self.route == CHAT:
            for m in b["messages"]:
                parts.append(_ROLE_MARK + m["role"].encode() + b"\n")
                parts += _text_parts(m.get("content"))
        else:
            prompt = b["prompt"]
            parts.append(prompt.encode() if isinstance(prompt, str) else orjson.dumps(prompt))
        return b"".join(parts)

    def estimated_prompt_tokens(self) -> int:
        # ~4 bytes a token for English BPE vocabularies; used only when an engine omits usage.
        return max(1, self.prompt_bytes // 4)


def _type(body: dict[str, Any], name: str, kind: type | tuple[type, ...], label: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise invalid(f"'{name}' must be {label}", name)
    if not isinstance(v, kind):
        raise invalid(f"'{name}' must be {label}", name)
    return v


def _text_parts(content: Any) -> list[bytes]:
    if isinstance(content, str):
        return [content.encode()]
    if isinstance(content, list):  # content parts are flat: a part's text is a string
        return [
            t.encode()
            for p in content
            if isinstance(p, dict) and isinstance(t := p.get("text"), str)
        ]
    return []


def _text_bytes(content: Any) -> int:
    return sum(len(p) for p in _text_parts(content))


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


_ROLE_MARK = b"\x00"  # never in JSON text: a role line cannot be confused with content


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


def check(route: str, raw: bytes, model: str) -> Intake:
    body = json_object(raw)
    _refuse_too_deep(raw, body)

    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise invalid("'model' must be a string", "model")
    if name is not None and name != model:
        raise ApiError(
            404, f"The model '{name}' does not exist", param="model", code="model_not_found"
        )

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

    user = body.get("user")
    session = user if isinstance(user, str) and user else None
    if route == RESPONSES:
        v = body.get("max_output_tokens")
        most = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        size = _input_bytes(body) + _beside_bytes(body)
        return Intake(route, body, stream, False, False, size, session, most)
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
    return Intake(route, body, stream, wants_ids, include_usage, prompt_bytes, session, most)


def _input_bytes(body: dict[str, Any]) -> int:
    """A Responses request's prompt size: `instructions` and `input` (a string or items)."""
    return sum(len(p) for p in _input_parts(body))


def _input_parts(body: dict[str, Any]) -> list[bytes]:
    parts = _text_parts(body.get("instructions"))
    raw = body.get("input")
    if isinstance(raw, str):
        return [*parts, raw.encode()]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a nonempty list of items", "input")
    for i in raw:
        if isinstance(i, dict):
            parts += _text_parts(i.get("content"))
    return parts


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


def upstream_body(intake: Intake, token_ids: bool) -> bytes:
    """The body sent to the engine: always a stream; token IDs asked for where supported. A
    Responses request goes as the client wrote it."""
    if intake.passthrough:
        return orjson.dumps(intake.body)
    body = dict(intake.body)
    body["stream"] = True
    if token_ids:
        body["return_token_ids"] = True
        body["stream_interval"] = 1
    else:
        body.pop("return_token_ids", None)
    # Usage always: it carries the engine's cached-prompt count, without which a prefix
    # cache hit would teach the predictor a prefill rate no new prompt gets. The relay
    # drops the usage frame for a streaming client that did not ask for it.
    opts = body.get("stream_options")
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return orjson.dumps(body)
