"""The simulated engine's cost model, measured on a real GPU (needs PyTorch and CUDA).

    python -m bench.fleet.calibrate --out calibration.json

bench/fleet/gpu.py models a step as `step_base_s + step_per_seq_s x decoding sequences +
prefill tokens / prefill_tps`, with constants taken from public figures. This runs the
work such a step does, on the GPU it finds, for a model of Llama-3-8B's shape in bf16
(random weights: the cost does not depend on their values): the weights' matrix products
over every token in the step, attention over each sequence's KV cache, a KV pool as vLLM
lays it out. No serving engine is involved, so what it measures is the floor of one (the
GPU's own cost of the step, with CUDA graphs as vLLM replays them for decode, and no
scheduler, sampler or detokenizer), which is what the cost model stands for.

Measured: a decode step by batch and context; prefill throughput by chunk and by how
much context the chunk attends to; and a mixed step (one prefill chunk beside a decode
batch, as chunked prefill runs them) against what the additive model fitted to the first
two predicts. Printed as markdown tables; `--out` writes the figures and the fitted
constants as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Llama-3-8B's shape.
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128_256
GROUP = HEADS // KV_HEADS


def _timed(fn: Callable[[], object], torch: Any, warm: int = 3, runs: int = 15) -> float:
    """Median seconds of `fn` on the GPU (CUDA events)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


class Model:
    """Random bf16 weights of Llama-3-8B's shape, a KV pool of `kv_tokens` tokens for the
    decoding sequences and one of `prompt_len` tokens for the sequence in prefill."""

    def __init__(self, torch: Any, layers: int, kv_tokens: int, prompt_len: int) -> None:
        self.torch = torch
        dev, dt = "cuda", torch.bfloat16

        def w(*shape: int) -> Any:
            return torch.empty(*shape, device=dev, dtype=dt).normal_(0, 0.02)

        q_kv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [
            (w(HIDDEN, q_kv), w(HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, 2 * FFN), w(FFN, HIDDEN))
            for _ in range(layers)
        ]
        self.head = w(HIDDEN, VOCAB)
        per_token = KV_HEADS * HEAD_DIM
        self.kd = [w(kv_tokens * per_token) for _ in range(layers)]
        self.vd = [w(kv_tokens * per_token) for _ in range(layers)]
        self.kp = [w(1, KV_HEADS, prompt_len, HEAD_DIM) for _ in range(layers)]
        self.vp = [w(1, KV_HEADS, prompt_len, HEAD_DIM) for _ in range(layers)]

    def step(self, x: Any, chunk: int, ctx: int, batch: int, length: int) -> Any:
        """One forward step over `x`: the first `chunk` rows are one sequence's prompt chunk
        attending to `ctx` earlier tokens and to itself (causally); the other `batch` rows
        are decoding sequences, each attending to `length` cached tokens."""
        torch = self.torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        mask = None
        if chunk and ctx:
            # The chunk's queries see every earlier token and the chunk's own, causally.
            mask = torch.ones(chunk, ctx + chunk, device="cuda", dtype=torch.bool).tril(ctx)
        for i, (wqkv, wo, wup, wdown) in enumerate(self.layers):
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            qkv = h @ wqkv
            q = qkv[:, : HEADS * HEAD_DIM]
            outs = []
            if chunk:
                qc = q[:chunk].view(1, chunk, HEADS, HEAD_DIM).transpose(1, 2)
                # Each KV head serves HEADS / KV_HEADS query heads: expanded, so that a fused
                # kernel (flash, or memory-efficient with the mask) takes the whole chunk.
                kc = self.kp[i][:, :, : ctx + chunk].repeat_interleave(GROUP, dim=1)
                vc = self.vp[i][:, :, : ctx + chunk].repeat_interleave(GROUP, dim=1)
                if mask is not None:
                    o = sdpa(qc, kc, vc, attn_mask=mask)
                else:
                    o = sdpa(qc, kc, vc, is_causal=True)
                outs.append(o.transpose(1, 2).reshape(chunk, HEADS * HEAD_DIM))
            if batch:
                # One query a sequence: attention reads its keys and values once, as a decode
                # kernel does (two batched products per KV head group).
                qd = q[chunk:].reshape(batch, KV_HEADS, GROUP, HEAD_DIM)
                size = batch * KV_HEADS * length * HEAD_DIM
                kd = self.kd[i][:size].view(batch, KV_HEADS, length, HEAD_DIM)
                vd = self.vd[i][:size].view(batch, KV_HEADS, length, HEAD_DIM)
                p = torch.softmax((qd @ kd.transpose(-1, -2)) * HEAD_DIM**-0.5, dim=-1)
                outs.append((p @ vd).reshape(batch, HEADS * HEAD_DIM))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + a @ wo
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            gate, up = (h @ wup).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ wdown
        # Only the last position of each sequence needs logits.
        last = x[chunk - 1 : chunk] if chunk else x[:0]
        return torch.cat([last, x[chunk:]]) @ self.head

    def run(self, chunk: int, ctx: int, batch: int, length: int, graph: bool) -> Callable[[], Any]:
        torch = self.torch
        x = torch.empty(chunk + batch, HIDDEN, device="cuda", dtype=torch.bfloat16).normal_()
        if not graph:
            return lambda: self.step(x, chunk, ctx, batch, length)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.step(x, chunk, ctx, batch, length)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.step(x, chunk, ctx, batch, length)
        return g.replay


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares `y = a + b x`."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer for a quick try")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="2048,8192", help="decode: cached tokens a sequence")
    ap.add_argument("--chunks", default="512,2048,8192", help="prefill chunk sizes, no context")
    ap.add_argument("--prefill-contexts", default="0,4096,8192,16384", help="for a 2048 chunk")
    ap.add_argument("--kv-tokens", type=int, default=262_144, help="the KV pool, in tokens")
    ap.add_argument("--no-graph", action="store_true", help="eager decode (no CUDA graphs)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch  # only here: the rest of bench/ needs no GPU

    batches = [int(b) for b in a.batches.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    chunks = [int(c) for c in a.chunks.split(",")]
    pctx = [int(c) for c in a.prefill_contexts.split(",")]
    longest = max(max(chunks), 2048 + max(pctx))
    t0 = time.monotonic()
    m = Model(torch, a.layers, a.kv_tokens, longest)
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": a.layers,
        "graphs": not a.no_graph,
        "decode": [],
        "prefill": [],
        "mixed": [],
    }
    print(f"{out['gpu']}, torch {out['torch']}, {a.layers} layers of Llama-3-8B's shape, bf16")
    print("\n| context | batch | decode step (ms) |\n|---|---|---|")
    for length in contexts:
        for b in batches:
            if b * length > a.kv_tokens:
                continue
            s = _timed(m.run(0, 0, b, length, not a.no_graph), torch)
            out["decode"].append({"context": length, "batch": b, "step_s": s})
            print(f"| {length} | {b} | {s * 1000:.2f} |")
    print("\n| chunk | context | prefill (tokens/s) |\n|---|---|---|")
    for c in chunks:
        s = _timed(m.run(c, 0, 0, 0, False), torch, runs=7)
        out["prefill"].append({"chunk": c, "context": 0, "step_s": s, "tps": c / s})
        print(f"| {c} | 0 | {c / s:,.0f} |")
    for ctx in pctx:
        if ctx == 0 and 2048 in chunks:
            continue
        s = _timed(m.run(2048, ctx, 0, 0, False), torch, runs=7)
        out["prefill"].append({"chunk": 2048, "context": ctx, "step_s": s, "tps": 2048 / s})
        print(f"| 2048 | {ctx} | {2048 / s:,.0f} |")
    fits = {}
    for length in contexts:
        pts = [d for d in out["decode"] if d["context"] == length]
        if len(pts) >= 2:
            base, per_seq = _fit([d["batch"] for d in pts], [d["step_s"] for d in pts])
            fits[length] = (base, per_seq)
    out["fits"] = {str(k): {"step_base_s": b, "step_per_seq_s": p} for k, (b, p) in fits.items()}
    print("\n| context | step_base_s (ms) | step_per_seq_s (ms) |\n|---|---|---|")
    for length, (b, p) in fits.items():
        print(f"| {length} | {b * 1000:.2f} | {p * 1000:.3f} |")
    # A mixed step: one 2048-token chunk (its sequence at 4096 tokens of context) beside a
    # decode batch at the shortest context, against the additive model.
    length = min(contexts)
    chunk_s = next(
        (p["step_s"] for p in out["prefill"] if p["chunk"] == 2048 and p["context"] == 4096),
        math.nan,
    )
    print(
        f"\n| decode batch (context {length}) | mixed step with a 2048 chunk (ms) "
        "| the simulator's additive model (ms) |\n|---|---|---|"
    )
    for b in batches:
        if length not in fits or b * length > a.kv_tokens:
            continue
        s = _timed(m.run(2048, 4096, b, length, False), torch, runs=7)
        base, per_seq = fits[length]
        model = base + per_seq * b + chunk_s
        out["mixed"].append({"batch": b, "context": length, "step_s": s, "additive_s": model})
        print(f"| {b} | {s * 1000:.2f} | {model * 1000:.2f} |")
    out["seconds"] = time.monotonic() - t0
    if a.out:
        a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
