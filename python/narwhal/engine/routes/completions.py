"""`/v1/completions`: a prompt (text or token IDs), echo, and the completions writer."""

from __future__ import annotations

import secrets
import time
from typing import Any

from narwhal.engine.config import EngineConfig
from narwhal.engine.generation import Finish
from narwhal.engine.model import Model
from narwhal.engine.protocol import (
    Job,
    check_model,
    fit,
    flag,
    logprobs,
    num,
    sampling_of,
    stream_options,
)
from narwhal.engine.render import DONE, Delta, Output, sse, usage
from narwhal.errors import invalid


def completion_job(body: dict[str, Any], config: EngineConfig, model: Model) -> Job:
    check_model(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.tokenize(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(t < 0 or t >= model.n_vocab for t in prompt):
            raise invalid("prompt token IDs must be in the vocabulary", "prompt")
        ids = list(prompt)
    else:
        raise invalid("'prompt' must be a string or a list of token IDs", "prompt")
    best_of = num(body, "best_of", 1, 2**31, integer=True)
    if best_of is not None and best_of > 1:
        raise invalid("best_of > 1 is not supported", "best_of")
    sampling = sampling_of(body, config, model, model.n_ctx)
    fit(ids, sampling, model, "prompt")
    job = Job("completion", ids, sampling, stream=flag(body, "stream"), body=body)
    job.logprobs = logprobs(body, sampling, chat=False)
    if flag(body, "echo"):
        if job.logprobs:
            # The prompt's own logprobs would need a scoring pass LexiEngine does not run.
            raise invalid("'echo' together with 'logprobs' is not supported", "echo")
        job.echo = prompt if isinstance(prompt, str) else model.detokenize(ids)
    stream_options(body, job)
    return job


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
