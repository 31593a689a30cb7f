"""Common test hygiene: no DIFFU_* variable of the calling shell leaks into a test."""

from __future__ import annotations

import os

import pytest

DIFFU_PREFIX = "DIFFU_"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _clear_diffu_environment(monkeypatch):
    """Remove every ``DIFFU_*`` variable for the duration of each test (tests set the ones they need)."""
    for name in list(os.environ):
        if name.startswith(DIFFU_PREFIX):
            monkeypatch.delenv(name, raising=False)
    yield
