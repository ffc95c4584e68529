"""Turning generated pieces into OpenAI-shaped output, what every route shares.

`Output` owns the per-request text state (reasoning split, pending token IDs); each route's
writer (`routes/`) turns its deltas into chunks of that route's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


@dataclass
class Check:
    """One tool call's check against the offered tools (a span where traces are on)."""

    began: float  # monotonic
    ended: float
    call: Call | None  # None: markup that was not a valid call


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
        # Each call checked against the tools' schemas, timed where the request is traced
        # (None: not, and no clock is read per piece).
        self.checks: list[Check] | None = None
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
        checks = self.checks
        began = time.monotonic() if checks is not None else 0.0
        events = (cs.feed(c) if c else []) + (cs.finish() if final else [])
        if checks is not None:
            end = time.monotonic()
            for kind, value in events:
                if kind != "text":  # a call, valid or not
                    checks.append(Check(began, end, value if kind == "call" else None))
        for kind, value in events:
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
