"""`/v1/responses`: instructions and input items made into a chat job, and the Responses
writer (reasoning as a `reasoning` item, the answer as a `message` item)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from narwhal.engine.config import EngineConfig
from narwhal.engine.generation import Finish
from narwhal.engine.model import Model
from narwhal.engine.protocol import Job, check_model, content_text
from narwhal.engine.render import Delta, Output, sse_event
from narwhal.engine.routes.chat import chat_job
from narwhal.errors import invalid


def responses_job(body: dict[str, Any], config: EngineConfig, model: Model) -> Job:
    check_model(body, model)
    prev = body.get("previous_response_id")
    if prev is not None:
        # LexiEngine keeps no responses: continuing one would silently drop its context.
        raise invalid(
            f"Previous response with id {str(prev)[:100]!r} not found (LexiEngine "
            "does not store responses: send the conversation as input)",
            "previous_response_id",
        )
    raw = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise invalid("only message input items are supported", f"input[{i}]")
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise invalid("unsupported role", f"input[{i}].role")
            messages.append(
                {"role": role, "content": content_text(item.get("content"), f"input[{i}].content")}
            )
    else:
        raise invalid("'input' must be a string or a nonempty list of messages", "input")
    if body.get("tools"):
        raise invalid("tools are served on /v1/chat/completions", "tools")
    chat_like = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    chat_like["messages"] = messages
    job = chat_job(chat_like, config, model)
    job.route = "responses"
    job.body = body
    return job


class ResponsesWriter:
    """The Responses API: reasoning as a `reasoning` item, the answer as a `message` item."""

    def __init__(self, job: Job, model_id: str) -> None:
        self.job = job
        self.id = "resp_" + secrets.token_hex(12)
        self.msg_id = "msg_" + secrets.token_hex(12)
        self.rs_id = "rs_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model_id
        self.seq = 0
        self.open: str | None = None  # which item is streaming: reasoning | message
        self.items: list[dict[str, Any]] = []
        self.text = {"reasoning": "", "message": ""}

    def _ev(self, name: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse_event(name, {"type": name, "sequence_number": self.seq, **fields})

    def _response(
        self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": use,
        }

    def _item(self, kind: str, text: str, status: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {
                "type": "reasoning",
                "id": self.rs_id,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
            }
        return {
            "type": "message",
            "id": self.msg_id,
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def _open(self, kind: str) -> bytes:
        out = self._close()
        self.open = kind
        idx = len(self.items)
        out += self._ev(
            "response.output_item.added", output_index=idx, item=self._item(kind, "", "in_progress")
        )
        part = (
            {"type": "reasoning_text", "text": ""}
            if kind == "reasoning"
            else {"type": "output_text", "text": "", "annotations": []}
        )
        out += self._ev(
            "response.content_part.added",
            output_index=idx,
            item_id=self.rs_id if kind == "reasoning" else self.msg_id,
            content_index=0,
            part=part,
        )
        return out

    def _close(self, status: str = "completed") -> bytes:
        if self.open is None:
            return b""
        kind, self.open = self.open, None
        idx = len(self.items)
        text = self.text[kind]
        item_id = self.rs_id if kind == "reasoning" else self.msg_id
        done = (
            "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        )
        item = self._item(kind, text, status)
        self.items.append(item)
        return (
            self._ev(done, output_index=idx, item_id=item_id, content_index=0, text=text)
            + self._ev(
                "response.content_part.done",
                output_index=idx,
                item_id=item_id,
                content_index=0,
                part=item["content"][0],
            )
            + self._ev("response.output_item.done", output_index=idx, item=item)
        )

    def first(self) -> bytes:
        r = self._response("in_progress", [])
        return self._ev("response.created", response=r) + self._ev(
            "response.in_progress", response=r
        )

    def delta(self, d: Delta) -> bytes:
        out = b""
        for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
            if not text:
                continue
            if self.open != kind:
                out += self._open(kind)
            self.text[kind] += text
            name = (
                "response.reasoning_text.delta"
                if kind == "reasoning"
                else "response.output_text.delta"
            )
            out += self._ev(
                name,
                output_index=len(self.items),
                item_id=self.rs_id if kind == "reasoning" else self.msg_id,
                content_index=0,
                delta=text,
            )
        return out

    def _usage(self, finish: Finish) -> dict[str, Any]:
        p, c = len(self.job.prompt_ids), finish.completion_tokens
        return {
            "input_tokens": p,
            "output_tokens": c,
            "total_tokens": p + c,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        }

    def last(self, finish: Finish, reason: str | None = None) -> bytes:
        status = "completed" if finish.reason == "stop" else "incomplete"
        out = self._close(status)  # the item the cut fell in is as incomplete as the whole
        body = self._response(status, self.items, self._usage(finish))
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + self._ev(f"response.{status}", response=body)

    def whole(self, o: Output, finish: Finish) -> dict[str, Any]:
        items = []
        if o.has_reasoning:
            items.append(self._item("reasoning", "".join(o.reasoning), "completed"))
        status = "completed" if finish.reason == "stop" else "incomplete"
        items.append(self._item("message", "".join(o.content), status))
        body = self._response(status, items, self._usage(finish))
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body
