"""Narwhal: an LLM-serving front door, and LexiEngine, its llama.cpp engine."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("narwhal-serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
