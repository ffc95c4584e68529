"""The resident model: llama-cpp-python loading, tokenizing, names and template."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import Llama

from narwhal.engine import kernels
from narwhal.engine.config import EngineConfig
from narwhal.engine.template import CHATML, ChatTemplate, TemplateError

log = logging.getLogger("lexi_engine")


class GrammarError(ValueError):
    pass


# llama.cpp parses GBNF by recursive descent, one C stack frame per nested group: 30,000
# nested parentheses overflow the stack and kill the process (10,000 did not). Real
# grammars nest a few levels; these bounds leave them all room.
MAX_GRAMMAR_BYTES = 1 << 20
MAX_GRAMMAR_DEPTH = 512
# What does not nest: string literals, character classes (escapes included) and comments.
_GBNF_PARENS = re.compile(r"[()]")
_GBNF_FLAT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')


def check_grammar_bounds(gbnf: str) -> None:
    """Refuse a grammar too large or too deeply nested to hand to llama.cpp."""
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"is over {MAX_GRAMMAR_BYTES} characters")
    depth = deepest = 0
    for c in _GBNF_PARENS.findall(_GBNF_FLAT.sub("", gbnf)):
        if c == "(":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_GRAMMAR_DEPTH:
                    raise GrammarError(f"nests groups over {MAX_GRAMMAR_DEPTH} levels deep")
        elif c == ")":
            depth -= 1


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the model; the message carries llama.cpp's own words."""


class Model:
    def __init__(self, config: EngineConfig) -> None:
        gpu = llama_cpp.llama_supports_gpu_offload()
        if config.n_gpu_layers and not gpu:
            log.warning(
                "--n-gpu-layers %d ignored: this llama-cpp-python build is CPU-only",
                config.n_gpu_layers,
            )
        choice = kernels.for_this_build(config.repack)
        log.info(
            "loading %s (weight repacking %s: %s)",
            config.model,
            "on" if choice.repack else "off",
            choice.reason,
        )
        self.llama, load_log = _load(config, choice.repack, gpu)
        if bool(self.llama.model_params.use_extra_bufts) != choice.repack:
            raise ModelLoadError(
                "llama-cpp-python ignored the weight-repacking choice; this "
                "version is not one LexiEngine supports"
            )
        self.repack = choice.repack
        self.buffers = kernels.buffers(load_log)
        log.info(
            "weights loaded: %s",
            ", ".join(f"{k} {v:.1f} MiB" for k, v in self.buffers.items()) or "?",
        )
        meta = self.llama.metadata
        identity = meta.get("general.name") or Path(config.model).name
        names: tuple[str, ...] = config.aliases or (identity,)
        self.id = names[0]
        # LoRA adapters served as models of their own (their names after the base's).
        self.adapters: dict[str, Any] = {}
        for name, path in config.loras:
            adapter = llama_cpp.llama_adapter_lora_init(self.llama._model.model, path.encode())
            if not adapter:
                raise ModelLoadError(f"--lora {name}: llama.cpp could not load {path}")
            self.adapters[name] = adapter
        self.names = (*names, *self.adapters)
        # Each slot's share of --ctx-size: a request's prompt plus output must fit in it.
        self.n_ctx = config.ctx_size // config.parallel
        self.vocab = self.llama._model.vocab
        self.n_vocab = self.llama.n_vocab()
        self.eos = self.llama.token_eos()
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "false") == "true"
        self.bos_text = self._piece(self.llama.token_bos())
        self.eos_text = self._piece(self.eos)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        source = config.chat_template or meta.get("tokenizer.chat_template") or CHATML
        try:
            self.template = ChatTemplate(source, self.bos_text, self.eos_text)
        except TemplateError as e:
            raise ModelLoadError(f"{e} (--chat-template-file replaces it)") from None

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llama.detokenize([token], special=True).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:  # asked once per token ID: no ctypes call (and GIL hand-off) per token
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
        return eog

    def tokenize(self, text: str) -> list[int]:
        add_bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def detokenize(self, ids: list[int]) -> str:
        return self.llama.detokenize(ids, special=True).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        raw = self._pieces.get(token)
        if raw is None:
            raw = self._pieces[token] = self.llama.detokenize([token])
        return raw

    def grammar(self, gbnf: str) -> str:
        """Compile-check a GBNF grammar against this model's vocabulary; returns it."""
        check_grammar_bounds(gbnf)
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf.encode("utf-8"), b"root")
        if not sampler:
            raise GrammarError("grammar does not parse")
        llama_cpp.llama_sampler_free(sampler)
        return gbnf

    def json_schema_grammar(self, schema_json: str) -> str:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        return self.grammar(json_schema_to_gbnf(schema_json))

    def json_object_grammar(self) -> str:
        from llama_cpp.llama_grammar import JSON_GBNF

        return self.grammar(JSON_GBNF)


def _load(config: EngineConfig, repack: bool, gpu: bool) -> tuple[Llama, str]:
    """The GGUF loaded, and what llama.cpp said while loading it."""
    # This context only serves tokenizing and metadata; decoding runs in the decode
    # loop's own batched context (engine.batch), so it is kept tiny.
    with kernels.captured_log() as load_log, kernels.extra_buffer_types(repack):
        try:
            llama = Llama(
                config.model,
                n_ctx=64,
                n_batch=64,
                n_threads=config.threads,
                n_threads_batch=config.threads,
                n_gpu_layers=config.n_gpu_layers if gpu else 0,
                verbose=False,
            )
        except ValueError as e:
            said = [
                ln.strip()
                for ln in "".join(load_log).splitlines()
                if "error" in ln.lower() or "failed" in ln.lower()
            ]
            raise ModelLoadError(
                f"cannot load {config.model}: " + ("; ".join(said[-3:]) or str(e))
            ) from None
    return llama, "".join(load_log)
