"""Weight buffers: repacking is chosen from what the llama.cpp build reports, and where the
weights went is read from its load log. The choice is tested on the reported features, so
the AMX default is checked on any CPU."""

from __future__ import annotations

import pytest

from narwhal.engine import kernels

# llama_print_system_info() of a native build on Sapphire Rapids, and on an AVX2-only EPYC.
AMX_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
AVX2_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
    "BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)


def test_features_are_read_from_the_system_info() -> None:
    f = kernels.features(AMX_INFO)
    assert f["AMX_INT8"] == "1" and f["AVX512"] == "1" and f["REPACK"] == "1"
    assert "AMX_INT8" not in kernels.features(AVX2_INFO)


def test_a_build_with_amx_kernels_does_not_repack_by_default() -> None:
    c = kernels.choose_repack(None, AMX_INFO)
    assert c.repack is False and "AMX" in c.reason and "--repack" in c.reason


def test_elsewhere_repacking_is_on_by_default() -> None:
    c = kernels.choose_repack(None, AVX2_INFO)
    assert c.repack is True and "--no-repack" in c.reason
    assert kernels.choose_repack(None, "AMX_INT8 = 0 | ").repack is True


@pytest.mark.parametrize("info", [AMX_INFO, AVX2_INFO])
@pytest.mark.parametrize("asked", [True, False])
def test_the_flags_win(info: str, asked: bool) -> None:
    c = kernels.choose_repack(asked, info)
    assert c.repack is asked
    assert ("--repack" if asked else "--no-repack") in c.reason


def test_buffer_sizes_are_read_from_the_load_log() -> None:
    log = (
        "load_tensors: loading model tensors, this can take a while... (mmap = true)\n"
        "load_tensors:   CPU_Mapped model buffer size =    98.12 MiB\n"
        "load_tensors:   CPU_REPACK model buffer size =    34.50 MiB\n"
        "load_tensors:          AMX model buffer size =     1.25 MiB\n"
    )
    assert kernels.buffers(log) == {"CPU_Mapped": 98.12, "CPU_REPACK": 34.5, "AMX": 1.25}
    assert kernels.buffers("nothing of the kind") == {}


@pytest.mark.slow
@pytest.mark.parametrize("repack", [True, False])
def test_the_model_loads_with_the_choice_it_was_given(model_path: str, repack: bool) -> None:
    from narwhal.engine.config import EngineConfig
    from narwhal.engine.model import Model

    m = Model(EngineConfig(model=model_path, repack=repack, threads=1))
    assert bool(m.llama.model_params.use_extra_bufts) is repack
    assert m.repack is repack
    assert sum(m.buffers.values()) > 50  # the 98 MB model's weights, found in the log
    assert m.tokenize("hello")  # and it works
