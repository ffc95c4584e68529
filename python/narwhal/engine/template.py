"""Chat prompt rendering with Hugging Face-compatible Jinja templates, sandboxed.

Templates come from the GGUF or from `--chat-template-file`; both run in Jinja's immutable
sandbox, so a template cannot reach Python internals or mutate its inputs.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_BYTES = 256 * 1024

# Variables the engine itself passes; a client may not override them through kwargs.
RESERVED = frozenset(
    {"messages", "tools", "documents", "bos_token", "eos_token", "add_generation_prompt",
     "raise_exception", "strftime_now", "tool_choice"}
)

# Fallback when a GGUF carries no template (ChatML, which most small models were tuned on).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "(message['content'] or '') + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    opt = orjson.OPT_INDENT_2 if indent else 0
    # HF templates expect `tojson` to keep non-ASCII text as is.
    return orjson.dumps(value, option=opt).decode()


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_source(raw: bytes, origin: str) -> str:
    """Check a template file's bytes as `--chat-template-file` requires; returns the text."""
    if not raw:
        raise TemplateError(f"{origin} is empty")
    if len(raw) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{origin} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TemplateError(f"{origin} is not valid UTF-8 (byte {e.start})") from e
    if not text.strip():
        raise TemplateError(f"{origin} is empty")
    try:
        _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{origin} does not parse: {e.message} (line {e.lineno})") from e
    return text


class ChatTemplate:
    """A compiled chat template and what it can do."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _environment().from_string(source)
        # A template "has a thinking switch" when it reads one of the common variables.
        self.thinking_switch = next(
            (v for v in ("enable_thinking", "thinking") if v in source), None
        )
        self.renders_tools = "tools" in source
        # Templates trained on `<function=NAME><parameter=K>` calls (Qwen3-Coder and kin).
        self.function_form = "<function=" in source
        # Pairs the template declares for reasoning output, `<think>` first.
        self.reasoning_pairs: list[tuple[str, str]] = [("<think>", "</think>")]
        if "<|channel|>" in source:
            self.reasoning_pairs.append(("<|channel|>analysis<|message|>", "<|end|>"))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        variables: dict[str, Any] = dict(kwargs or {})
        variables.update(
            messages=messages,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=add_generation_prompt,
        )
        if tools:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an opened `<think>` block."""
        tail = prompt.rstrip()
        return tail.endswith("<think>")
