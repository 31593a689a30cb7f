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


def pytest_collection_modifyitems(config, items):
    """The whole model zoo (marker ``zoo``) runs only when asked for with ``-m zoo``; by default its representative
    subset (marker ``representative``) stands for it (see tests/test_model_zoo.py)."""
    if "zoo" in (config.getoption("-m") or ""):
        return
    skipped = [item for item in items
               if item.get_closest_marker("zoo") is not None and item.get_closest_marker("representative") is None]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item not in skipped]
