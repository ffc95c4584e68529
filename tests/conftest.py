"""Process fixtures (the servers themselves are in tests/support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import Server, start_test_engine


@pytest.fixture(scope="session")
def model_path() -> str:
    from narwhal.bundled_model import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="session")
def scripted() -> Iterator[Server]:
    s = start_test_engine("tests.scripted_engine")
    yield s
    s.stop()
