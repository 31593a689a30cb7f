"""Common test hygiene: no DIFFU_* variable of the calling shell leaks into a test; one torch thread per xdist
worker; the opt-in markers run only when named."""

from __future__ import annotations

import os

import pytest

DIFFU_PREFIX = "DIFFU_"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per pytest-xdist worker: the README runs two workers on two cores, and tiny models gain nothing from
    # a second thread. Two threads each made the same trainer tests take 3.5x the CPU time and 3x the wall time
    # (OpenMP threads spinning for a core the other worker holds); the launched processes run one thread each too
    # (hf_dynbsz.testing.run_with_timeout).
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clear_diffu_environment(monkeypatch):
    """Remove every ``DIFFU_*`` variable for the duration of each test (tests set the ones they need)."""
    for name in list(os.environ):
        if name.startswith(DIFFU_PREFIX):
            monkeypatch.delenv(name, raising=False)
    yield


#: Markers of long runs that run only when asked for with ``-m``: the whole model zoo (its ``representative`` subset
#: runs by default, see tests/test_model_zoo.py), 90 launches of training scripts checking every exit status, the
#: multi-process runs beyond one launch of each distributed backend and every combination of the vLLM path (``long``;
#: the latter's ``representative`` subset runs by default, tests/test_vllm.py), and TRL's RLOOTrainer,
#: DistillationTrainer, DPOTrainer, RewardTrainer and KTOTrainer tests restated offline (their ``representative``
#: subsets run by default, tests/test_rloo_trl_suite.py, tests/test_distillation_trl_suite.py,
#: tests/test_dpo_trl_suite.py, tests/test_reward_trl_suite.py, tests/test_kto_trl_suite.py).
OPT_IN_MARKERS = ("zoo", "exits", "long", "trl_suite")


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2-style model and its tokenizer saved to a directory (:func:`hf_dynbsz.testing.save_tiny_model`), one
    per test module: the model the trainer tests load by path."""
    from hf_dynbsz.testing import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture
def family_dir(tmp_path_factory, family):
    """The tiny model of the test's ``family`` parameter and the test alphabet's tokenizer saved to a directory
    (:func:`hf_dynbsz.testing.zoo.save_tiny_families`): the model-family tests' model, loaded by path."""
    from hf_dynbsz.testing.zoo import save_tiny_families

    return save_tiny_families(tmp_path_factory, [family])[family]
