"""`/v1/chat/completions`: messages through the chat template (tools shown by the template or
by the engine's own tool prompt, reasoning effort), and the chat writer (deltas, tool
calls, logprobs, usage)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from narwhal.engine.config import EngineConfig
from narwhal.engine.generation import Finish
from narwhal.engine.model import GrammarError, Model
from narwhal.engine.protocol import (
    EFFORTS,
    Job,
    check_model,
    content_text,
    fit,
    flag,
    logprobs,
    sampling_of,
    stream_options,
)
from narwhal.engine.render import DONE, Delta, Output, sse, usage
from narwhal.engine.template import RESERVED, TemplateError, TemplateFault
from narwhal.engine.tools import TRIGGER, ToolPlan, plan_tools
from narwhal.errors import ApiError, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_job(body: dict[str, Any], config: EngineConfig, model: Model) -> Job:
    check_model(body, model)
    messages = _messages(body.get("messages"))
    kwargs = _template_kwargs(body, config)
    _effort(body, model, kwargs)
    template = model.template
    plan = plan_tools(body, template.renders_tools, template.function_form)
    tools = body.get("tools")
    if plan is not None and plan.own_prompt:
        messages = _with_tool_prompt(messages, plan)
        tools = None
    elif not template.renders_tools:
        tools = None
    try:
        prompt = template.render(messages, tools=tools, kwargs=kwargs)
    except TemplateError as e:
        raise invalid(str(e), "messages") from e
    except TemplateFault as e:
        raise ApiError(500, str(e), type="server_error", code="template_error") from None
    ids = model.tokenize(prompt)
    sampling = sampling_of(body, config, model, model.n_ctx)
    fit(ids, sampling, model, "messages")
    if plan is not None and plan.grammar and sampling.grammar is None:
        # A client's own grammar or response_format wins; otherwise calls are constrained.
        try:
            calls = model.grammar(plan.grammar)
        except GrammarError as e:  # a schema no value satisfies (`"enum": []`), say
            raise invalid(f"the tools' parameter schemas admit no call: {e}", "tools") from None
        if plan.required:
            sampling.grammar = calls
        else:
            sampling.lazy_grammar = (calls, [TRIGGER])
    job = Job("chat", ids, sampling, stream=flag(body, "stream"), body=body, tools=plan)
    job.logprobs = logprobs(body, sampling, chat=True)
    job.split_reasoning = config.reasoning_format == "auto"
    job.start_in_reasoning = model.template.opens_reasoning(prompt)
    job.reasoning_pairs = model.template.reasoning_pairs
    job.answer_headers = model.template.answer_headers
    stream_options(body, job)
    return job


def _with_tool_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The engine's own tool prompt, for templates that cannot show tools: it joins the
    system message, and earlier calls and results are written in the form it teaches."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>"
                + orjson.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                ).decode()
                + "</tool_call>"
                for c in m["tool_calls"]
            )
            m = {
                "role": "assistant",
                "content": (m["content"] + "\n" if m["content"] else "") + calls,
            }
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + plan.prompt()}
    else:
        out.insert(0, {"role": "system", "content": plan.prompt()})
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a nonempty list", "messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid("each message must be an object", p)
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"role must be one of {', '.join(ROLES)}", f"{p}.role")
        if "reasoning_content" in m and role != "assistant":
            raise invalid(
                "reasoning_content is only accepted on assistant messages", f"{p}.reasoning_content"
            )
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            raise invalid("reasoning_content must be a string", f"{p}.reasoning_content")
        msg: dict[str, Any] = {
            "role": role,
            "content": content_text(m.get("content"), f"{p}.content"),
        }
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:  # as the OpenAI API requires
                raise invalid(
                    "a tool message needs its tool_call_id (a string)", f"{p}.tool_call_id"
                )
            msg["tool_call_id"] = tcid
            if m.get("name") is not None:
                if not isinstance(m["name"], str):
                    raise invalid("name must be a string", f"{p}.name")
                msg["name"] = m["name"]
        elif m.get("name") is not None:
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _history_calls(m["tool_calls"], p)
        # An earlier turn's reasoning is accepted and deliberately not replayed.
        out.append(msg)
    return out


def _history_calls(calls: Any, p: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid("tool_calls must be a list", f"{p}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid("a tool call needs function.name", f"{p}.tool_calls[{j}].function")
        args = fn.get("arguments", "{}")
        where = f"{p}.tool_calls[{j}].function.arguments"
        if isinstance(args, str):
            try:
                args = orjson.loads(args) if args.strip() else {}
            except orjson.JSONDecodeError as e:
                raise invalid("tool call arguments are not valid JSON", where) from e
        elif not isinstance(args, dict):
            raise invalid("tool call arguments must be a JSON string (or an object)", where)
        # Either form is written into the prompt again: as deep as it may be, in both.
        _refuse_unwritable(args, where)
        out.append(
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


# orjson reads JSON nested up to 1,024 levels but writes only 255, and the prompt writes
# earlier calls' arguments out again, inside the objects that carry them (the template's
# tojson of a message, the engine's own tool prompt): keep room for those.
_WRAPPERS = 4


_MAX_DEPTH = 255 - _WRAPPERS


def _refuse_unwritable(value: Any, where: str) -> None:
    try:
        orjson.dumps([[[[value]]]])
    except TypeError:  # orjson's JSONEncodeError: "Recursion limit reached"
        raise invalid(f"{where} nests JSON deeper than {_MAX_DEPTH} levels", where) from None


def _template_kwargs(body: dict[str, Any], config: EngineConfig) -> dict[str, Any]:
    kwargs = dict(config.chat_template_kwargs)
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return kwargs
    if not isinstance(extra, dict):
        raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for k, v in extra.items():
        if k in RESERVED:
            raise invalid(f"'{k}' is reserved", f"chat_template_kwargs.{k}")
        if k in ("enable_thinking", "thinking") and not isinstance(v, bool):
            raise invalid(f"'{k}' must be a boolean", f"chat_template_kwargs.{k}")
    kwargs.update(extra)
    return kwargs


def _effort(body: dict[str, Any], model: Model, kwargs: dict[str, Any]) -> None:
    effort = body.get("reasoning_effort")
    if effort is None and isinstance(body.get("reasoning"), dict):
        effort = body["reasoning"].get("effort")  # the Responses API's spelling
    if effort is None:
        return
    if effort not in EFFORTS:
        raise invalid(f"reasoning_effort must be one of {', '.join(EFFORTS)}", "reasoning_effort")
    switch = model.template.thinking_switch
    if switch is None:
        if effort != "none":
            raise ApiError(
                501,
                "this model's chat template cannot think; only reasoning_effort 'none' is served",
                type="not_implemented_error",
                param="reasoning_effort",
                code="reasoning_unsupported",
            )
        return
    kwargs[switch] = effort != "none"
    kwargs["reasoning_effort"] = effort


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
