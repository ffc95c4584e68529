"""Which weight buffers llama.cpp gets on this CPU, and the record of where the weights went.

llama.cpp can "repack" weights at load into extra buffer types whose layout suits the CPU's
wide kernels (CPU_REPACK on AVX2/AVX-512/NEON, AMX on CPUs with Intel AMX). The AMX kernels
crash on the first decode on Sapphire/Granite Rapids (llama.cpp issue 20824, closed without a
fix; Ollama 17205 and 17249): SIGSEGV inside `ggml_backend_amx_mul_mat`. So repacking is off
by default wherever the build reports AMX, and on elsewhere; `--repack` / `--no-repack`
(llama-server's names) override. The choice is made from what llama.cpp itself reports
(`llama_print_system_info`), not from /proc/cpuinfo: the AMX kernels exist only in builds
compiled with them, and only those builds crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_FEATURE = re.compile(r"([A-Z][A-Z0-9_]*) = (\S+)")
_BUFFER = re.compile(r"(\S+) model buffer size\s*=\s*([0-9.]+) MiB")


def features(system_info: str) -> dict[str, str]:
    """`llama_print_system_info()`'s `NAME = value` pairs ("AMX_INT8" -> "1")."""
    return dict(_FEATURE.findall(system_info))


@dataclass(frozen=True)
class RepackChoice:
    repack: bool
    reason: str


def choose_repack(requested: bool | None, system_info: str) -> RepackChoice:
    """Whether weights go to llama.cpp's extra (repacked) buffer types."""
    amx = features(system_info).get("AMX_INT8") == "1"
    if requested is not None:
        flag = "--repack" if requested else "--no-repack"
        if requested and amx:
            return RepackChoice(
                True,
                f"{flag} given; this build has AMX kernels, which crash "
                "on some CPUs (llama.cpp issue 20824)",
            )
        return RepackChoice(requested, f"{flag} given")
    if amx:
        return RepackChoice(
            False,
            "off by default: this llama.cpp build has AMX kernels, "
            "which crash on the first decode (llama.cpp issue 20824); "
            "--repack turns it on",
        )
    return RepackChoice(
        True, "on by default (no AMX kernels in this build); --no-repack turns it off"
    )


def for_this_build(requested: bool | None = None) -> RepackChoice:
    """`choose_repack` on what the installed llama.cpp reports."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return choose_repack(requested, info)


def buffers(load_log: str) -> dict[str, float]:
    """MiB of weights per buffer type, from llama.cpp's load log ("CPU_REPACK" -> 34.2)."""
    out: dict[str, float] = {}
    for name, mib in _BUFFER.findall(load_log):
        out[name] = out.get(name, 0.0) + float(mib)
    return out


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs (model load), kept instead of printed;
    llama-cpp-python's own log callback is put back afterwards."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def extra_buffer_types(enabled: bool) -> Iterator[None]:
    """Model loads inside the block use (or skip) llama.cpp's extra buffer types.

    `Llama()` takes no such argument; it fills its model params from
    `llama_model_default_params()`, so that one function is wrapped for the load and put
    back after. `Model` checks the loaded params afterwards, so a llama-cpp-python that
    stopped reading them this way fails loudly instead of repacking silently.
    """
    from llama_cpp import llama_cpp as lib

    original = lib.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = enabled
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = original
