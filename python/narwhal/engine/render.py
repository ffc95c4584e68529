"""Turning generated pieces into OpenAI-shaped output, streaming and not.

`Output` owns the per-request text state (reasoning split, pending token IDs); the writers
turn its deltas into chunks of each route's shape.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from narwhal._native import ThinkSplitter
from narwhal.engine.generation import Finish, Piece
from narwhal.engine.protocol import Job
from narwhal.engine.tools import CLOSE, Call, CallSplitter


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ToolCallFailed(Exception):
    """`tool_choice` required a call and the output held no valid one."""


class Delta:
    __slots__ = ("calls", "content", "logprobs", "reasoning", "token_ids")

    def __init__(
        self,
        reasoning: str,
        content: str,
        token_ids: list[int],
        logprobs: list[dict[str, Any]] | None,
        calls: list[Call] | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.content = content
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.calls = calls or []


class Output:
    """Per-request text state. Token IDs of text that is held back ride on the next delta."""

    def __init__(self, job: Job) -> None:
        self.job = job
        split = job.split_reasoning and job.route in ("chat", "responses")
        self.splitter = (
            ThinkSplitter(job.reasoning_pairs, job.start_in_reasoning, job.answer_headers)
            if split
            else None
        )
        self.call_splitter = CallSplitter(job.tools) if job.tools is not None else None
        self.calls: list[Call] = []
        self.pending_ids: list[int] = []
        self.token_ids: list[int] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[dict[str, Any]] = []

    def piece(self, p: Piece) -> Delta | None:
        if self.splitter is not None:
            r, c = self.splitter.feed(p.text)
        else:
            r, c = "", p.text
        c, calls = self._calls(c, final=False)
        return self._delta(r, c, p.token_ids, p.logprobs, calls)

    def finish(self) -> Delta | None:
        r, c = self.splitter.finish() if self.splitter is not None else ("", "")
        c, calls = self._calls(c, final=True)
        if self.job.tools is not None and self.job.tools.required and not self.calls:
            raise ToolCallFailed(
                "tool_choice requires a tool call and the model's output held no valid one"
            )
        d = self._delta(r, c, [], None, calls)
        if d is None and self.pending_ids:
            # Held-back IDs of text that never showed (a partial delimiter) go out on their
            # own only to a client that asked for IDs: anyone else would get `delta: {}`.
            if self.job.return_token_ids:
                d = Delta("", "", self.pending_ids, None)
            self.pending_ids = []
        return d

    def _calls(self, c: str, final: bool) -> tuple[str, list[Call]]:
        """Content text with verified calls taken out (look-alikes stay as text)."""
        cs = self.call_splitter
        if cs is None:
            return c, []
        text, calls = [], []
        for kind, value in (cs.feed(c) if c else []) + (cs.finish() if final else []):
            if kind == "call":
                calls.append(value)
            elif kind == "bad" and cs.plan.required:
                why = (
                    "is not a valid call of the offered tools"
                    if value.endswith(CLOSE)
                    else "ended inside an unfinished call (max_tokens?)"
                )
                raise ToolCallFailed(
                    f"tool_choice requires a call; the model's output {why}: {value[:200]}"
                )
            else:
                text.append(value)
        self.calls.extend(calls)
        return "".join(text), calls

    def _delta(
        self, r: str, c: str, ids: list[int], lps: list[dict[str, Any]] | None, calls: list[Call]
    ) -> Delta | None:
        self.token_ids.extend(ids)
        if lps:
            self.logprobs.extend(lps)
        if not r and not c and not calls:
            self.pending_ids.extend(ids)
            return None
        if self.pending_ids:
            ids = self.pending_ids + ids
            self.pending_ids = []
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        return Delta(r, c, ids, lps, calls)

    def finish_reason(self, finish: Finish) -> str:
        return "tool_calls" if self.calls and finish.reason == "stop" else finish.reason

    @property
    def has_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.opened


def usage(job: Job, finish: Finish) -> dict[str, Any]:
    p, c = len(job.prompt_ids), finish.completion_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    }


class ChatWriter:
    def __init__(self, job: Job, model_id: str) -> None:
        self.job = job
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model_id
        self.n_calls = 0

    def _chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        ids: list[int] | None = None,
        lps: Any = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": lps,
            "finish_reason": finish,
        }
        if self.job.return_token_ids:
            choice["token_ids"] = ids or []
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def first(self) -> bytes:
        c = self._chunk({"role": "assistant", "content": ""})
        if self.job.return_token_ids:
            c["prompt_token_ids"] = self.job.prompt_ids
        return sse(c)

    def delta(self, d: Delta) -> bytes:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        lps = {"content": d.logprobs} if self.job.logprobs and d.logprobs else None
        ids = d.token_ids
        if delta or not d.calls:
            out = sse(self._chunk(delta, ids=ids, lps=lps))
            ids, lps = [], None
        else:
            out = b""
        for call in d.calls:
            # A verified call: its header (id, type, name), then its arguments.
            index = self.n_calls
            self.n_calls += 1
            head = call.openai(index)
            head["function"] = {"name": call.name, "arguments": ""}
            out += sse(self._chunk({"tool_calls": [head]}, ids=ids, lps=lps))
            ids, lps = [], None
            out += sse(
                self._chunk(
                    {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
                    ids=[],
                )
            )
        return out

    def last(self, finish: Finish, reason: str | None = None) -> bytes:
        out = sse(self._chunk({}, reason or finish.reason))
        if self.job.include_usage:
            out += sse(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage(self.job, finish),
                }
            )
        return out + DONE

    def whole(self, o: Output, finish: Finish) -> dict[str, Any]:
        text = "".join(o.content)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if o.has_reasoning:
            msg["reasoning_content"] = "".join(o.reasoning)
        if o.calls:
            msg["content"] = text or None  # as OpenAI answers a pure tool call
            msg["tool_calls"] = [c.openai() for c in o.calls]
        choice: dict[str, Any] = {
            "index": 0,
            "message": msg,
            "logprobs": {"content": o.logprobs} if self.job.logprobs else None,
            "finish_reason": o.finish_reason(finish),
        }
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.job, finish),
        }
        if self.job.return_token_ids:
            choice["token_ids"] = o.token_ids
            body["prompt_token_ids"] = self.job.prompt_ids
        return body


def _text_logprobs(entries: list[dict[str, Any]], offset0: int) -> dict[str, Any]:
    tokens, lps, tops, offs = [], [], [], []
    off = offset0
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e.get("top_logprobs", [])})
        offs.append(off)
        off += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


class CompletionWriter:
    def __init__(self, job: Job, model_id: str) -> None:
        self.job = job
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model_id
        self.offset = 0
        self.sent_prompt = False

    def _chunk(
        self, text: str, finish: str | None, ids: list[int] | None, lps: Any
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": lps,
            "finish_reason": finish,
        }
        if self.job.return_token_ids:
            choice["token_ids"] = ids or []
            if not self.sent_prompt:
                choice["prompt_token_ids"] = self.job.prompt_ids
                self.sent_prompt = True
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def first(self) -> bytes:
        if not self.job.echo:
            return b""
        return sse(self._chunk(self.job.echo, None, [], None))

    def delta(self, d: Delta) -> bytes:
        lps = _text_logprobs(d.logprobs, self.offset) if self.job.logprobs and d.logprobs else None
        self.offset += len(d.content)
        return sse(self._chunk(d.content, None, d.token_ids, lps))

    def last(self, finish: Finish, reason: str | None = None) -> bytes:
        out = sse(self._chunk("", finish.reason, [], None))
        if self.job.include_usage:
            out += sse(
                {
                    "id": self.id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage(self.job, finish),
                }
            )
        return out + DONE

    def whole(self, o: Output, finish: Finish) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": (self.job.echo or "") + "".join(o.content),
            "logprobs": _text_logprobs(o.logprobs, 0) if self.job.logprobs else None,
            "finish_reason": finish.reason,
        }
        if self.job.return_token_ids:
            choice["token_ids"] = o.token_ids
            choice["prompt_token_ids"] = self.job.prompt_ids
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.job, finish),
        }


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


Writer = ChatWriter | CompletionWriter | ResponsesWriter


def writer_for(job: Job, model_id: str) -> Writer:
    if job.route == "chat":
        return ChatWriter(job, model_id)
    if job.route == "completion":
        return CompletionWriter(job, model_id)
    return ResponsesWriter(job, model_id)
