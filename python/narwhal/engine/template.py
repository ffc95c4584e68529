"""Chat prompt rendering with Hugging Face-compatible Jinja templates, sandboxed.

Templates come from the GGUF or from `--chat-template-file`; both run in Jinja's immutable
sandbox, so a template cannot reach Python internals or mutate its inputs.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_BYTES = 256 * 1024

# Variables the engine itself passes, and the sandbox's globals (a template calling
# namespace() would call the client's string instead): kwargs may not override them.
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "bos_token",
        "eos_token",
        "add_generation_prompt",
        "raise_exception",
        "strftime_now",
        "tool_choice",
        "namespace",
        "range",
        "dict",
        "cycler",
        "joiner",
        "lipsum",
    }
)

# Fallback when a GGUF carries no template (ChatML, which most small models were tuned on).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "(message['content'] or '') + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateFault(RuntimeError):
    """The template itself cannot render (not the request's doing): a 500."""


# A render is bounded: its output (a prompt far past any context) and its time, looked at
# per output piece. Jinja's sandbox already caps each range() at 100,000.
MAX_RENDER_CHARS = 16 * 1024 * 1024
RENDER_BUDGET_S = 5.0


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


class _Budget(threading.local):
    deadline = float("inf")
    ticks = 0


_budget = _Budget()


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the render's time budget looked at on every call, attribute and
    item access: a loop that writes nothing (`{% set ns.n = ns.n + 1 %}` nested twice) is
    stopped too, not only one that keeps writing. Renders run on worker threads, so the
    deadline is per thread."""

    def _tick(self) -> None:
        b = _budget
        b.ticks += 1
        if b.ticks & 255 == 0 and time.monotonic() > b.deadline:
            raise TemplateFault(f"the chat template ran over {RENDER_BUDGET_S:g} s")

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._tick()
        return super().getitem(obj, argument)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    del env.globals["lipsum"]  # lipsum(n=100000): seconds of CPU and tens of MB per call
    return env


def _compile(env: ImmutableSandboxedEnvironment, text: str, origin: str) -> jinja2.Template:
    """Compile a template, refusing what can never render here: include, import and
    extends (there is no loader), and anything the compiler itself trips on."""
    from jinja2 import nodes

    try:
        tree = env.parse(text)
        for kind in (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends):
            if next(tree.find_all(kind), None) is not None:
                raise TemplateError(
                    f"{origin} uses {kind.__name__.lower()}, which a chat "
                    "template cannot (no other templates are loaded)"
                )
        return env.from_string(tree)
    except TemplateError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{origin} does not parse: {e.message} (line {e.lineno})") from e
    except Exception as e:  # the compiler folding 10**100000, say
        raise TemplateError(f"{origin} does not compile: {type(e).__name__}: {e}") from None


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
    _compile(_environment(), text, origin)
    return text


class ChatTemplate:
    """A compiled chat template and what it can do."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(_environment(), source, "the chat template")
        # A template "has a thinking switch" when it reads one of the common variables.
        self.thinking_switch = next(
            (v for v in ("enable_thinking", "thinking") if v in source), None
        )
        self.renders_tools = "tools" in source
        # Templates trained on `<function=NAME><parameter=K>` calls (Qwen3-Coder and kin).
        self.function_form = "<function=" in source
        # Pairs the template declares for reasoning output, `<think>` first.
        self.reasoning_pairs: list[tuple[str, str]] = [("<think>", "</think>")]
        # What may open the answer after a closed block; the splitter drops it.
        self.answer_headers: list[str] = []
        if "<|channel|>" in source:
            self.reasoning_pairs.append(("<|channel|>analysis<|message|>", "<|end|>"))
            self.answer_headers = [
                "<|start|>assistant<|channel|>final<|message|>",
                "<|channel|>final<|message|>",
            ]

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
        started = time.monotonic()
        _budget.deadline = started + RENDER_BUDGET_S
        try:
            out: list[str] = []
            size = 0
            for piece in self._template.generate(**variables):
                out.append(piece)
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise TemplateError(
                        f"the chat template renders more than {MAX_RENDER_CHARS} characters"
                    )
                if time.monotonic() - started > RENDER_BUDGET_S:
                    raise TemplateFault(f"the chat template ran over {RENDER_BUDGET_S:g} s")
            return "".join(out)
        except (TemplateError, TemplateFault):
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # e.g. `1 + messages[0].content`, range() over the cap
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            _budget.deadline = float("inf")

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an opened `<think>` block."""
        tail = prompt.rstrip()
        return tail.endswith("<think>")
