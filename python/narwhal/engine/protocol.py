"""Request intake for LexiEngine: OpenAI-shaped bodies checked field by field.

Each checker raises `ApiError` (400, with `param`) on the first bad field, so a client sees
exactly which field to fix. The result is a `Job`: a tokenized prompt plus sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.engine.config import EngineConfig
from narwhal.engine.generation import Sampling
from narwhal.engine.model import GrammarError, Model
from narwhal.engine.schema_check import check_schema
from narwhal.engine.template import RESERVED, TemplateError, TemplateFault
from narwhal.engine.tools import TRIGGER, ToolPlan, plan_tools
from narwhal.errors import ApiError, invalid

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Job:
    route: str  # chat | completion | responses
    prompt_ids: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool = False
    return_token_ids: bool = False
    split_reasoning: bool = False
    start_in_reasoning: bool = False
    reasoning_pairs: list[tuple[str, str]] = field(default_factory=list)
    answer_headers: list[str] = field(default_factory=list)
    logprobs: bool = False
    echo: str | None = None  # completions: the prompt text, sent before the output
    tools: ToolPlan | None = None
    cache_prompt: bool = True
    body: dict[str, Any] = field(default_factory=dict)


def _num(body: dict[str, Any], name: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise invalid(f"'{name}' must be {kind}", name)
    if not (lo <= v <= hi):
        raise invalid(f"'{name}' must be between {lo:g} and {hi:g}", name)
    return v


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return v


def check_model(body: dict[str, Any], model: Model) -> None:
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise invalid("'model' must be a string", "model")
    if name not in model.names:
        raise ApiError(
            400, f"requested model is not loaded: {name}", param="model", code="model_not_found"
        )


def _sampling(body: dict[str, Any], config: EngineConfig, model: Model, n_ctx: int) -> Sampling:
    n = _num(body, "n", 1, 2**31, integer=True)
    if n is not None and n > 1:
        raise invalid("n > 1 is not supported", "n")
    d = config.sampling
    temp = _num(body, "temperature", 0, 2)
    top_p = _num(body, "top_p", 0, 1)
    top_k = _num(body, "top_k", 0, 100000, integer=True)
    min_p = _num(body, "min_p", 0, 1)
    seed = _num(body, "seed", -(2**63), 2**64, integer=True)
    limit = None
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens", "n_predict"):
        v = _num(body, name, 1, 2**31, integer=True)
        if v is not None:
            limit = v
            break
    if limit is None:
        limit = int(d["n_predict"]) if d["n_predict"] > 0 else n_ctx
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise invalid("'stop' must be a string or a list of strings", "stop")
    stops = [s for s in stops if s]
    interval = _num(body, "stream_interval", 1, 1024, integer=True) or 1
    frequency = _num(body, "frequency_penalty", -2, 2)
    presence = _num(body, "presence_penalty", -2, 2)
    repeat = None
    for name in ("repetition_penalty", "repeat_penalty"):  # vLLM's and llama-server's names
        repeat = _num(body, name, 0, 10)
        if repeat is not None:
            if repeat == 0:
                raise invalid(f"'{name}' must be greater than 0", name)
            break
    return Sampling(
        temp=float(d["temp"] if temp is None else temp),
        top_p=float(d["top_p"] if top_p is None else top_p),
        top_k=int(d["top_k"] if top_k is None else top_k),
        min_p=float(d["min_p"] if min_p is None else min_p),
        max_tokens=int(limit),
        seed=None if seed is None else int(seed) % (2**32),
        stop=stops,
        grammar=_grammar(body, model),
        stream_interval=int(interval),
        logit_bias=_logit_bias(body, model),
        frequency_penalty=float(frequency or 0),
        presence_penalty=float(presence or 0),
        repeat_penalty=float(1 if repeat is None else repeat),
    )


def _logit_bias(body: dict[str, Any], model: Model) -> list[tuple[int, float]]:
    """OpenAI's form: token IDs (as strings) to a bias in [-100, 100] added to the logit."""
    raw = body.get("logit_bias")
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise invalid("'logit_bias' must be an object of token IDs to numbers", "logit_bias")
    out = []
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < model.n_vocab:
            raise invalid(
                f"'logit_bias' key {key[:40]!r} is not a token ID of this model", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(
                f"'logit_bias' value for {key} must be a number between -100 and 100", "logit_bias"
            )
        out.append((token, float(bias)))
    return out


def _grammar(body: dict[str, Any], model: Model) -> Any:
    g = body.get("grammar")
    rf = body.get("response_format")
    if g is not None:
        if not isinstance(g, str) or not g.strip():
            raise invalid("'grammar' must be a nonempty GBNF string", "grammar")
        try:
            return model.grammar(g)
        except GrammarError as e:
            raise invalid(f"'grammar' {e}", "grammar") from e
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid("'response_format' must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return model.json_object_grammar()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid(
                "'response_format.json_schema.schema' must be an object",
                "response_format.json_schema.schema",
            )
        where = "response_format.json_schema.schema"
        check_schema(schema, where)
        try:
            return model.json_schema_grammar(orjson.dumps(schema).decode())
        except GrammarError as e:
            raise invalid(f"unsupported JSON schema: {e}", where) from e
        except Exception as e:  # a third-party converter: whatever it trips on is the schema's
            raise invalid(f"unsupported JSON schema: {type(e).__name__}: {e}", where) from None
    raise invalid(f"unsupported response_format type '{kind}'", "response_format.type")


def _logprobs(body: dict[str, Any], sampling: Sampling, chat: bool) -> bool:
    if chat:
        want = _bool(body, "logprobs")
        top = _num(body, "top_logprobs", 0, 20, integer=True)
        if top is not None and not want:
            raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        if want:
            sampling.logprobs = int(top or 0)
        return want
    n = _num(body, "logprobs", 0, 20, integer=True)
    if n is not None:
        sampling.logprobs = int(n)
        return True
    return False


def _text(content: Any, path: str) -> str:
    """Message content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                "text",
                "input_text",
                "output_text",
            ):
                raise invalid("only text content parts are supported", f"{path}[{i}]")
            if not isinstance(part.get("text"), str):
                raise invalid("a text part needs 'text'", f"{path}[{i}].text")
            out.append(part["text"])
        return "".join(out)
    raise invalid("content must be a string or a list of text parts", path)


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
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{p}.content")}
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
        if isinstance(args, str):
            try:
                args = orjson.loads(args) if args.strip() else {}
            except orjson.JSONDecodeError as e:
                raise invalid(
                    "tool call arguments are not valid JSON",
                    f"{p}.tool_calls[{j}].function.arguments",
                ) from e
            _refuse_unwritable(args, f"{p}.tool_calls[{j}].function.arguments")
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


def _fit(prompt_ids: list[int], sampling: Sampling, model: Model, param: str) -> None:
    if len(prompt_ids) >= model.n_ctx:
        raise ApiError(
            400,
            f"the prompt is {len(prompt_ids)} tokens; the context holds {model.n_ctx}",
            param=param,
            code="context_length_exceeded",
        )


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
    sampling = _sampling(body, config, model, model.n_ctx)
    _fit(ids, sampling, model, "messages")
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
    job = Job("chat", ids, sampling, stream=_bool(body, "stream"), body=body, tools=plan)
    job.logprobs = _logprobs(body, sampling, chat=True)
    job.split_reasoning = config.reasoning_format == "auto"
    job.start_in_reasoning = model.template.opens_reasoning(prompt)
    job.reasoning_pairs = model.template.reasoning_pairs
    job.answer_headers = model.template.answer_headers
    _stream_options(body, job)
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
    best_of = _num(body, "best_of", 1, 2**31, integer=True)
    if best_of is not None and best_of > 1:
        raise invalid("best_of > 1 is not supported", "best_of")
    sampling = _sampling(body, config, model, model.n_ctx)
    _fit(ids, sampling, model, "prompt")
    job = Job("completion", ids, sampling, stream=_bool(body, "stream"), body=body)
    job.logprobs = _logprobs(body, sampling, chat=False)
    if _bool(body, "echo"):
        if job.logprobs:
            # The prompt's own logprobs would need a scoring pass LexiEngine does not run.
            raise invalid("'echo' together with 'logprobs' is not supported", "echo")
        job.echo = prompt if isinstance(prompt, str) else model.detokenize(ids)
    _stream_options(body, job)
    return job


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
                {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}
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


def _stream_options(body: dict[str, Any], job: Job) -> None:
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise invalid("'include_usage' must be a boolean", "stream_options.include_usage")
        job.include_usage = iu
    job.return_token_ids = _bool(body, "return_token_ids")
    cache = body.get("cache_prompt", True)
    if not isinstance(cache, bool):
        raise invalid("'cache_prompt' must be a boolean", "cache_prompt")
    job.cache_prompt = cache
