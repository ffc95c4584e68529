"""End to end on a GPU host: build llama-cpp-python for CUDA, serve, chat, throughput.

Run on a machine with an NVIDIA GPU and the CUDA toolkit (nvcc), from the repository root:

    .venv/bin/python -m bench.gpu_e2e [--model PATH] [--skip-build] [--tokens 256]

1. builds llama-cpp-python with `CMAKE_ARGS="-DGGML_CUDA=on"` into this venv (unless
   `--skip-build`) and checks that the build can offload;
2. starts `narwhal up` (on a GPU build it offloads every layer by itself) on a free port;
3. sends one chat request and prints the answer;
4. measures decode throughput through the router at 1 and 8 concurrent streams
   (`--tokens` each, a grammar keeps the length fixed), and prints a table.

Bounded: every step has a timeout; the server is stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time

import httpx

from tests.support import BIN, Server, free_port

PIN = "llama-cpp-python==0.3.36"


def build() -> None:
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_CUDA=on", "FORCE_CMAKE": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--force-reinstall",
            "--no-deps",
            "--no-cache-dir",
            PIN,
        ],
        env=env,
        check=True,
        timeout=3600,
    )


def offloads() -> bool:
    code = "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


async def streams(url: str, n: int, tokens: int) -> float:
    """Output tokens a second over `n` concurrent streams of `tokens` each."""
    body = {
        "model": "main",
        "max_tokens": tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count."}],
        "grammar": 'root ::= "' + "one " * (tokens * 2) + '"',
    }

    async def one(c: httpx.AsyncClient) -> int:
        r = await c.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient() as c:
        await one(c)  # warm
        t = time.perf_counter()
        done = await asyncio.gather(*(one(c) for _ in range(n)))
        return sum(done) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF (default: the SmolLM2 test model)")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi: this bench needs an NVIDIA GPU", file=sys.stderr)
        return 2
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv"], timeout=60)
    if not a.skip_build:
        build()
    if not offloads():
        print(
            "this llama-cpp-python cannot offload to the GPU (see the build log)", file=sys.stderr
        )
        return 1
    port = free_port()
    cmd = [
        str(BIN / "narwhal"),
        "up",
        "--port",
        str(port),
        "--parallel",
        "8",
        "--ctx-size",
        "16384",
    ]
    if a.model:
        cmd += ["--model", a.model]
    s = Server(cmd, "/ready", port, timeout=600)
    try:
        r = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "main",
                "max_tokens": 32,
                "messages": [{"role": "user", "content": "Say hello in five words."}],
            },
        )
        print("chat:", r.status_code, r.json()["choices"][0]["message"]["content"])
        print("| streams | output tokens/s |\n|---|---|")
        for n in (1, 8):
            print(f"| {n} | {asyncio.run(streams(s.url, n, a.tokens)):.0f} |", flush=True)
        log = s.stderr()
        print("offload:", next((x for x in log.splitlines() if "offload" in x.lower()), "?"))
    finally:
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
