"""Single-stream decode tokens/s: LexiEngine over HTTP vs a bare llama-cpp-python loop,
same model, same prompt, same run (interleaved, best of N each). Decode rate counts from
the first generated token on both sides, so prompt processing and request set-up (which
the TTFT metrics cover) are not in it.

    .venv/bin/python -m bench.engine_decode [--tokens 256] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import httpx

from narwhal.bundled_model import smollm2_path
from tests.support import start_engine

PROMPT = "Write a long story about a lighthouse keeper."
# A fixed-length grammar keeps both sides generating exactly the same number of tokens.
GRAMMAR = "root ::= [a-z ]{{{n}}}"


def bare(model: str, n: int, threads: int) -> float:
    from llama_cpp import Llama
    from llama_cpp.llama_grammar import LlamaGrammar

    from narwhal.engine import kernels

    with kernels.extra_buffer_types(kernels.for_this_build().repack):  # as LexiEngine loads
        llm = Llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    toks = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    g = LlamaGrammar.from_string(GRAMMAR.format(n=n), verbose=False)
    count = 0
    t = 0.0
    for _ in llm.generate(
        toks, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, grammar=g, repeat_penalty=1.0
    ):
        count += 1
        if count == 1:
            t = time.perf_counter()
        if count >= n:
            break
    return (count - 1) / (time.perf_counter() - t)


def over_http(url: str, n: int) -> float:
    body = {
        "prompt": PROMPT,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "grammar": GRAMMAR.format(n=n),
    }
    count = 0
    t = 0.0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"finish_reason":null' in line:
                count += 1
                if count == 1:
                    t = time.perf_counter()
    return (count - 1) / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads, the same on both sides",
    )
    a = p.parse_args()
    model = str(smollm2_path())
    eng = start_engine(model, "--threads", str(a.threads))
    try:
        h, b = [], []
        for _ in range(a.rounds):
            h.append(over_http(eng.url, a.tokens))
            b.append(bare(model, a.tokens, a.threads))
    finally:
        eng.stop()
    print("| threads | tokens | bare llama-cpp-python tok/s | LexiEngine HTTP tok/s | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {a.threads} | {a.tokens} | {max(b):.1f} | {max(h):.1f} | {max(h) / max(b):.2f}x |")


if __name__ == "__main__":
    main()
