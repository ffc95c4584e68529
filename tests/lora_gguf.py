"""A LoRA adapter for the test model, written as a GGUF file at test time (a few hundred KB
of random low-rank deltas, no dependency but numpy): what `lexi-engine --lora` loads. Its
deltas are large enough that greedy answers differ from the base model's, and small enough
that the answers stay coherent (much larger, and a near-tie between two tokens turns on how
a batch happened to be summed)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

_ALIGN = 32
_U32, _F32, _STRING = 4, 6, 8
_TENSOR_F32 = 0


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_lora(
    path: Path, n_embd: int = 576, blocks: int = 30, rank: int = 8, seed: int = 0
) -> Path:
    """A rank-`rank` LoRA over every block's `attn_q` (SmolLM2-135M: 576 x 576, 30 blocks)."""
    import numpy as np  # llama-cpp-python's dependency: only where the engine is

    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, Any]] = []
    for i in range(blocks):
        # ggml's dims are numpy's reversed: lora_a is ne [n_in, rank], lora_b ne [rank, n_out].
        a = rng.standard_normal((rank, n_embd)).astype(np.float32) * 0.15
        b = rng.standard_normal((n_embd, rank)).astype(np.float32) * 0.15
        tensors += [(f"blk.{i}.attn_q.weight.lora_a", a), (f"blk.{i}.attn_q.weight.lora_b", b)]
    kv = [
        ("general.architecture", _STRING, _string("llama")),
        ("general.type", _STRING, _string("adapter")),
        ("adapter.type", _STRING, _string("lora")),
        ("adapter.lora.alpha", _F32, struct.pack("<f", float(rank))),
    ]
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, kind, value in kv:
        out += _string(key) + struct.pack("<I", kind) + value
    offset = 0
    for name, t in tensors:
        dims = tuple(reversed(t.shape))
        out += _string(name) + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", _TENSOR_F32, offset)
        offset += -(-t.nbytes // _ALIGN) * _ALIGN
    out += b"\0" * (-len(out) % _ALIGN)
    for _, t in tensors:
        data = t.tobytes()
        out += data + b"\0" * (-len(data) % _ALIGN)
    path.write_bytes(bytes(out))
    return path
