"""Process fixtures (the servers themselves are in tests/support.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.support import EtcdServer, Server, start_test_engine

# CI explores the same examples every run (a red CI names a bug it can reproduce); a
# developer's run explores new ones each time.
# How fast examples come depends on the machine and what else runs on it, never on the
# code under test: no deadline, and no health check on generation time.
_unhurried = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, **_unhurried)
settings.register_profile("dev", **_unhurried)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def model_path() -> str:
    from narwhal.bundled_model import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """A real etcd for a module's tests (skipped where etcd is not installed)."""
    try:
        e = EtcdServer()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield e
    e.stop()


@pytest.fixture(scope="session")
def scripted() -> Iterator[Server]:
    s = start_test_engine("tests.scripted_engine")
    yield s
    s.stop()


# The matrix of older and newer Pythons installs the router's side alone (the `test` extra,
# no llama-cpp-python): every test that needs the model is skipped there, and says why.
HAS_ENGINE = importlib.util.find_spec("llama_cpp") is not None
# Test modules that import the engine's llama.cpp side at import time: not collected there.
collect_ignore = [] if HAS_ENGINE else ["test_slots.py", "test_tool_parsing.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if HAS_ENGINE:
        return
    skip = pytest.mark.skip(reason="needs llama-cpp-python (the engine extra)")
    for item in items:
        if "model_path" in getattr(item, "fixturenames", ()) or "engine" in item.keywords:
            item.add_marker(skip)
