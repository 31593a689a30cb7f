"""Package surface: lazy exports, a planning core free of torch/trl, and the TRL version guard."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_dynbsz

ROOT = Path(__file__).resolve().parents[1]


def test_planning_core_imports_neither_torch_nor_trl():
    code = (
        "import sys, hf_dynbsz, hf_dynbsz.planning.env, hf_dynbsz.planning.plan, hf_dynbsz.planning.partition,"
        " hf_dynbsz.planning.schedule, hf_dynbsz.planning.balance,"
        " hf_dynbsz.planning.model_support, hf_dynbsz.planning.settings, hf_dynbsz._trl_compat, hf_dynbsz.testing;"
        "heavy = [m for m in ('torch', 'trl', 'transformers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_public_names_resolve():
    for name in (
        "DynamicBatchGRPOConfig",
        "DynamicBatchGRPOTrainer",
        "DynamicBatchRLOOConfig",
        "DynamicBatchRLOOTrainer",
        "DynamicBatchDistillationConfig",
        "DynamicBatchDistillationTrainer",
        "BatchSizePlan",
        "partition_by_token_budget",
        "apply_env_overrides",
        "OversizeSequenceError",
        "WorkloadModel",
    ):
        assert getattr(hf_dynbsz, name) is not None
    with pytest.raises(AttributeError):
        hf_dynbsz.NoSuchThing  # noqa: B018


def test_installed_trl_is_inside_the_tested_range():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf_dynbsz.check_trl_version() is True


@pytest.mark.parametrize("version", ["1.15.0", "1.17.0", "2.0.0"])
def test_untested_trl_versions_warn_clearly(version, monkeypatch):
    monkeypatch.setattr(hf_dynbsz._trl_compat, "_checked", False)
    with pytest.warns(
        RuntimeWarning,
        match=rf"trl {version} is installed.*private GRPOTrainer hooks, RLOOTrainer hooks and DistillationTrainer",
    ):
        assert hf_dynbsz.check_trl_version(version) is False
