"""Request intake for LexiEngine, what every route shares: OpenAI-shaped fields checked one
by one, sampling, grammar, logprobs, the context check, stream options.

Each checker raises `ApiError` (400, with `param`) on the first bad field, so a client sees
exactly which field to fix. A route's job builder (`routes/`) makes a `Job`: a tokenized
prompt plus sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.engine.config import EngineConfig
from narwhal.engine.generation import Sampling
from narwhal.engine.model import GrammarError, Model
from narwhal.engine.schema_check import check_schema
from narwhal.engine.tools import ToolPlan
from narwhal.errors import ApiError, invalid

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


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


def num(body: dict[str, Any], name: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise invalid(f"'{name}' must be {kind}", name)
    if not (lo <= v <= hi):
        raise invalid(f"'{name}' must be between {lo:g} and {hi:g}", name)
    return v


def flag(body: dict[str, Any], name: str) -> bool:
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


def sampling_of(body: dict[str, Any], config: EngineConfig, model: Model, n_ctx: int) -> Sampling:
    n = num(body, "n", 1, 2**31, integer=True)
    if n is not None and n > 1:
        raise invalid("n > 1 is not supported", "n")
    d = config.sampling
    temp = num(body, "temperature", 0, 2)
    top_p = num(body, "top_p", 0, 1)
    top_k = num(body, "top_k", 0, 100000, integer=True)
    min_p = num(body, "min_p", 0, 1)
    seed = num(body, "seed", -(2**63), 2**64, integer=True)
    limit = None
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens", "n_predict"):
        v = num(body, name, 1, 2**31, integer=True)
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
    interval = num(body, "stream_interval", 1, 1024, integer=True) or 1
    frequency = num(body, "frequency_penalty", -2, 2)
    presence = num(body, "presence_penalty", -2, 2)
    repeat = None
    for name in ("repetition_penalty", "repeat_penalty"):  # vLLM's and llama-server's names
        repeat = num(body, name, 0, 10)
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


def logprobs(body: dict[str, Any], sampling: Sampling, chat: bool) -> bool:
    if chat:
        want = flag(body, "logprobs")
        top = num(body, "top_logprobs", 0, 20, integer=True)
        if top is not None and not want:
            raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        if want:
            sampling.logprobs = int(top or 0)
        return want
    n = num(body, "logprobs", 0, 20, integer=True)
    if n is not None:
        sampling.logprobs = int(n)
        return True
    return False


def content_text(content: Any, path: str) -> str:
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


def fit(prompt_ids: list[int], sampling: Sampling, model: Model, param: str) -> None:
    if len(prompt_ids) >= model.n_ctx:
        raise ApiError(
            400,
            f"the prompt is {len(prompt_ids)} tokens; the context holds {model.n_ctx}",
            param=param,
            code="context_length_exceeded",
        )


def stream_options(body: dict[str, Any], job: Job) -> None:
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise invalid("'include_usage' must be a boolean", "stream_options.include_usage")
        job.include_usage = iu
    job.return_token_ids = flag(body, "return_token_ids")
    cache = body.get("cache_prompt", True)
    if not isinstance(cache, bool):
        raise invalid("'cache_prompt' must be a boolean", "cache_prompt")
    job.cache_prompt = cache
