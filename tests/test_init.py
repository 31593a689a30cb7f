"""Package surface: lazy exports, a planning core free of torch/trl, and the TRL version guard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_dynbsz
from hf_dynbsz import _trl_compat

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


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("1.15.0", False),
        ("1.16.0", True),
        ("1.16.1", True),
        ("1.17.0", False),
        ("1.18.2", False),
        ("2.0.0.dev0", False),
        ("1.17.0.dev0", False),  # TRL's main branch after 1.16: pip's <1.17 excludes it too
        ("1.16.0rc1", False),
        ("not-a-version", False),
    ],
)
def test_trl_version_decision(version, inside):
    allow = _trl_compat.ALLOW_UNTESTED_TRL_ENV
    assert _trl_compat.trl_version_decision(version, {}) == ("ok" if inside else "stop")
    assert _trl_compat.trl_version_decision(version, {allow: "1"}) == ("ok" if inside else "warn")
    for value in ("true", " YES ", "on"):
        assert _trl_compat.trl_version_decision(version, {allow: value}) == ("ok" if inside else "warn")
    for value in ("0", "", "false", "no"):
        assert _trl_compat.trl_version_decision(version, {allow: value}) == ("ok" if inside else "stop")


def test_the_decision_reads_os_environ_by_default(monkeypatch):
    monkeypatch.delenv(_trl_compat.ALLOW_UNTESTED_TRL_ENV, raising=False)
    assert _trl_compat.trl_version_decision("1.18.0") == "stop"
    monkeypatch.setenv(_trl_compat.ALLOW_UNTESTED_TRL_ENV, "1")
    assert _trl_compat.trl_version_decision("1.18.0") == "warn"


def test_the_tested_range_is_the_declared_requirement():
    """pyproject.toml's trl requirement and ``TESTED_TRL_RANGE`` (which the import check reads) say the same."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    (line,) = re.findall(r'^\s*"(trl[<>=!~ ].*?)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    trl = Requirement(line)
    lower, upper = hf_dynbsz.TESTED_TRL_RANGE
    assert trl.specifier == SpecifierSet(f">={lower},<{upper}")


@pytest.mark.parametrize("version", ["1.15.0", "1.17.0", "1.18.2", "2.0.0.dev0"])
def test_untested_trl_versions_stop_with_one_clear_message(version, monkeypatch):
    monkeypatch.delenv(_trl_compat.ALLOW_UNTESTED_TRL_ENV, raising=False)
    with pytest.raises(hf_dynbsz.UntestedTRLVersionError) as stop:
        hf_dynbsz.check_trl_version(version)
    assert isinstance(stop.value, ImportError)
    message = str(stop.value)
    assert f"trl {version} is installed" in message
    assert "trl>=1.16.0,<1.17.0" in message  # the tested range
    assert "pip install 'trl>=1.16.0,<1.17.0'" in message  # the fix
    assert "HF_DYNBSZ_ALLOW_UNTESTED_TRL=1" in message  # the way on
    assert "private GRPOTrainer hooks, RLOOTrainer hooks and DistillationTrainer" in message


def test_the_variable_turns_the_stop_into_one_warning(monkeypatch):
    monkeypatch.setattr(_trl_compat, "_warned", False)
    environ = {_trl_compat.ALLOW_UNTESTED_TRL_ENV: "1"}
    with pytest.warns(
        RuntimeWarning, match=r"trl 1\.18\.0 is installed.*HF_DYNBSZ_ALLOW_UNTESTED_TRL is set"
    ) as caught:
        assert hf_dynbsz.check_trl_version("1.18.0", environ) is False
        assert hf_dynbsz.check_trl_version("1.18.0", environ) is False
    assert len(caught) == 1


def fake_trl(tmp_path: Path, version: str) -> Path:
    """A folder to put first on PYTHONPATH: a ``trl`` distribution of ``version`` (metadata and a package)."""
    info = tmp_path / f"trl-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trl\nVersion: {version}\n")
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return tmp_path


def import_with_trl(tmp_path: Path, version: str, allow: bool) -> subprocess.CompletedProcess:
    """``import hf_dynbsz`` in a fresh interpreter that finds the fake TRL ``version`` first. It prints ``imported N``
    once the import returned, N the RuntimeWarnings the import gave, then ``after M``, M those after a second check."""
    env = {k: v for k, v in os.environ.items() if k != _trl_compat.ALLOW_UNTESTED_TRL_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_trl(tmp_path, version)), str(ROOT)])
    if allow:
        env[_trl_compat.ALLOW_UNTESTED_TRL_ENV] = "1"
    code = "\n".join(
        [
            "import importlib.metadata, warnings",
            f"assert importlib.metadata.version('trl') == {version!r}, importlib.metadata.version('trl')",
            "with warnings.catch_warnings(record=True) as caught:",
            "    warnings.simplefilter('always')",
            "    import hf_dynbsz",
            "    print('imported', sum(w.category is RuntimeWarning for w in caught), flush=True)",
            "    hf_dynbsz.check_trl_version()",
            "print('after', sum(w.category is RuntimeWarning for w in caught))",
            "print(*(w.message for w in caught), sep='\\n')",
        ]
    )
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_import_stops_at_an_untested_trl(tmp_path):
    result = import_with_trl(tmp_path, "1.18.0", allow=False)
    assert result.returncode != 0 and "imported" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_dynbsz._trl_compat.UntestedTRLVersionError: ")
    assert "trl 1.18.0 is installed" in last and "trl>=1.16.0,<1.17.0" in last
    assert "HF_DYNBSZ_ALLOW_UNTESTED_TRL=1" in last


def test_import_goes_on_with_one_warning_when_allowed(tmp_path):
    result = import_with_trl(tmp_path, "1.18.0", allow=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[:2] == ["imported 1", "after 1"], result.stdout  # at import, and only once
    assert "trl 1.18.0 is installed" in lines[2] and "HF_DYNBSZ_ALLOW_UNTESTED_TRL is set" in lines[2]


def test_import_is_silent_inside_the_range(tmp_path):
    result = import_with_trl(tmp_path, "1.16.1", allow=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == ["imported 0", "after 0"], result.stdout
