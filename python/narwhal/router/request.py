"""The request record: one completion request as the stages see it, written once.

Each part is the output of the stage that owns it and is never written after that stage:

- `intake` (`pipeline/intake.py`): the route, the checked body and what was read from it
  (stream, token IDs, usage, prompt size, session, `max_tokens`, the model asked for and
  the served model it stands for, `router/models.py`);
- `classify` (`pipeline/classify.py`): its `Standing` (whose it is, its class, the share of
  its budget it is judged against, its order among requests waiting for pace).

Its trace, where it is traced, is the flow's (`router/tracing.py`), handed to the stages
that record into it.

A record is frozen: a stage that adds its output makes the next record (`classified`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import orjson

CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
RESPONSES = "/v1/responses"
ROUTES = (CHAT, COMPLETION, RESPONSES)
# The dialects whose engines serve the Responses API (relayed as they answer it).
RESPONSES_DIALECTS = frozenset({"lexi", "vllm", "openai"})


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a request stands among the others (classify's output)."""

    tenant: str = ""  # whose request (its client key's tenant; "": none)
    rank: int = 1  # its priority class, 0 critical .. 2 sheddable (tenants.fair_queue)
    # The share of its TTFT budget, and of the streams' TPOT allowance, it is judged
    # against (less for lower classes and for a tenant over its fair share).
    share: float = 1.0
    # Its place among requests waiting for pace: its class, and within a class a tenant
    # over its fair share after the others (0 .. 5; lower goes first).
    order: int = 2


@dataclass(frozen=True, slots=True)
class Request:
    route: str  # CHAT | COMPLETION | RESPONSES
    body: dict[str, Any]
    stream: bool
    wants_token_ids: bool
    include_usage: bool
    prompt_bytes: int
    # The conversation's routing key (`x-session-id`, else the body's `user`), if any.
    session: str | None = None
    max_tokens: int | None = None  # the most output tokens asked for, if the body says
    # The model as the client named it (the router's `model` where it named none), and the
    # served model that stands for (an alias's target): what the engine is asked for.
    model: str = ""
    served: str = ""
    standing: Standing = Standing()

    def classified(self, standing: Standing) -> Request:
        """This request with classify's output."""
        return dataclasses.replace(self, standing=standing)

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
            return b"".join(input_parts(b))
        tools = b.get("tools")
        # Tools come first in a rendered prompt: requests that differ in them share no prefix.
        parts = [orjson.dumps(tools)] if tools else []
        if self.route == CHAT:
            for m in b["messages"]:
                parts.append(_ROLE_MARK + m["role"].encode() + b"\n")
                parts += text_parts(m.get("content"))
        else:
            prompt = b["prompt"]
            parts.append(prompt.encode() if isinstance(prompt, str) else orjson.dumps(prompt))
        return b"".join(parts)

    def estimated_prompt_tokens(self) -> int:
        # ~4 bytes a token for English BPE vocabularies; used only when an engine omits usage.
        return max(1, self.prompt_bytes // 4)

    def upstream_body(self, token_ids: bool, several: bool = False) -> bytes:
        """The body sent to the engine: always a stream; token IDs asked for where
        supported; the served model named where the client named an alias, or named none
        and the engine serves `several` (one that serves one answers with it anyway). A
        Responses request goes as the client wrote it, its model renamed likewise."""
        named = self.body.get("model")
        renamed = self.served and (named != self.served if named is not None else several)
        if self.passthrough:
            if not renamed:
                return orjson.dumps(self.body)
            return orjson.dumps({**self.body, "model": self.served})
        body = dict(self.body)
        if renamed:
            body["model"] = self.served
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


_ROLE_MARK = b"\x00"  # never in JSON text: a role line cannot be confused with content


def text_parts(content: Any) -> list[bytes]:
    """A message's text, part by part (content parts are flat: a part's text is a string)."""
    if isinstance(content, str):
        return [content.encode()]
    if isinstance(content, list):
        return [
            t.encode()
            for p in content
            if isinstance(p, dict) and isinstance(t := p.get("text"), str)
        ]
    return []


def input_parts(body: dict[str, Any]) -> list[bytes]:
    """A Responses request's prompt text: `instructions`, then `input` (a string or items);
    intake has checked that `input` is one or the other."""
    parts = text_parts(body.get("instructions"))
    raw = body.get("input")
    if isinstance(raw, str):
        return [*parts, raw.encode()]
    for i in raw if isinstance(raw, list) else ():
        if isinstance(i, dict):
            parts += text_parts(i.get("content"))
    return parts
