"""LexiEngine's own dependencies are an extra (llama-cpp-python builds from source): say in one
line how to get them, instead of a traceback from a worker that a supervisor restarts."""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "narwhal-serve"
_MODULES = {"llama_cpp": "llama-cpp-python", "jinja2": "jinja2"}


def missing() -> str | None:
    """One line naming what is missing and the install command, or None."""
    absent = [dist for mod, dist in _MODULES.items() if importlib.util.find_spec(mod) is None]
    if not absent:
        return None
    return (
        f"LexiEngine needs {', '.join(absent)}, which the base install does not bring: "
        f"pip install '{DISTRIBUTION}[engine]'"
    )
