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


#: Markers of long runs that run only when asked for with ``-m``: the whole model zoo (its ``representative`` subset
#: runs by default, see tests/test_model_zoo.py), 30 launches of a training script checking every exit status, and TRL's
#: RLOOTrainer tests restated offline (their ``representative`` subset runs by default, tests/test_rloo_trl_suite.py).
OPT_IN_MARKERS = ("zoo", "exits", "trl_suite")


def pytest_collection_modifyitems(config, items):
    """Leave out the tests of :data:`OPT_IN_MARKERS` unless ``-m`` names their marker."""
    selection = config.getoption("-m") or ""
    skipped = [
        item
        for item in items
        if item.get_closest_marker("representative") is None
        and any(item.get_closest_marker(marker) is not None and marker not in selection for marker in OPT_IN_MARKERS)
    ]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        left = set(map(id, skipped))
        items[:] = [item for item in items if id(item) not in left]
