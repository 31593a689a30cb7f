"""benchmarks/gpu_check.py's plumbing on CPU: the tiny run passes and reports every check (those that need CUDA as
skipped), and a plugin with a deliberately wrong loss makes it fail. The GPU run itself is the script's job."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from hf_dynbsz.testing import REPO_ROOT, run_with_timeout

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
HEADER = ["check", "setting", "measured", "limit / goal", "result"]
TIMEOUT_S = 300  # the tiny run takes under a minute on 2 idle cores; other jobs may share them


def table_rows(text: str) -> list[list[str]]:
    """The markdown table's rows (header and separator left out), as lists of cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines and [cell.strip() for cell in lines[0].strip("|").split("|")] == HEADER, text
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def gpu_check(tmp_path, *args: str, expect_failure: bool = False) -> tuple[str, list[list[str]]]:
    output = tmp_path / "gpu_check.md"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--output", str(output), *args]
    printed = run_with_timeout(command, REPO_ROOT, TIMEOUT_S, "gpu_check.py --tiny", expect_failure=expect_failure)
    text = output.read_text()
    assert text.strip() in printed  # the table printed is the table written
    return text, table_rows(text)


def load_script():
    """The script as a module (registered first: its dataclasses look their module up while it runs)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


def test_the_tiny_run_passes_and_reports_every_check(tmp_path):
    text, rows = gpu_check(tmp_path)
    assert "no check failed" in text
    results = {}
    for check, setting, measured, limit, result in rows:
        results.setdefault(check, []).append((setting, measured, limit, result))
    fp32 = results["equal to stock (fp32)"]
    assert [r[-1] for r in fp32[:4]] == ["pass"] * 4
    assert {setting.split(", ")[2] for setting, *_ in fp32[:4]} == {"grpo", "bnpo", "dapo"}
    assert any("prompts not shared" in setting for setting, *_ in fp32) and any(
        "prefix tree" in measured for _, measured, *_ in fp32
    )
    assert all("params" in measured and "update" in measured for _, measured, _, result in fp32 if result == "pass")
    assert results["stock's bf16 noise"][0][-1] == "info"
    bf16 = [row for row in results["equal to stock (bf16)"] if row[0].startswith("bf16, sdpa")]
    bf16 = [row for row in bf16 if "packing_layout" not in row[0]]
    assert len(bf16) == 2 and all(row[-1] == "pass" for row in bf16)
    padded = [row for row in fp32 + results["equal to stock (bf16)"] if "packing_layout padded" in row[0]]
    assert len(padded) == 2 and all(row[-1] == "pass" and "trained as: padded" in row[1] for row in padded)
    for layout in ("stock", "padded", "auto"):  # on CPU the speed rows are information, on both mixes
        speed_rows = results[f"speed: {layout}"]
        mixes = [setting.split(", ")[:2] for setting, *_ in speed_rows]
        assert mixes == [["tiny", "long_tailed"], ["tiny", "prompt_heavy"]]
        assert all(result == "info" and "step" in measured for _, measured, _, result in speed_rows)
        if layout != "stock":
            assert all("token limit" in measured and "training phase" in measured for _, measured, *_ in speed_rows)
    for layout in ("varlen", "flex"):  # their kernels run on CUDA only
        assert all(row[-1].startswith("skipped: no CUDA") for row in results[f"speed: {layout}"])
    assert [row[-1] for row in results["first step: auto"]] == ["info", "info"]
    for name in ("stock", "groups", "tree", "tree vs groups"):  # the agentic mix: the tool block once per pass
        ((setting, measured, _, result),) = results[f"prefix tree: {name}"]
        assert result == "info" and setting.startswith("tiny, agentic")
    assert "saved by the tree" in results["prefix tree: tree vs groups"][0][1]
    assert results["host syncs"][0][-1].startswith("skipped: no CUDA")
    ((_, measured, _, result),) = results["profile"]
    assert result == "info" and "gpu_check_profile.md" in measured
    assert "dynbsz/forward" in (tmp_path / "gpu_check_profile.md").read_text()  # the plugin's step, profiled
    assert results["max_memory_fraction_per_device held"][0][-1] == "skipped: no CUDA"
    assert results["real CUDA out-of-memory recovered"][0][-1] == "skipped: no CUDA"
    skipped = [row for row in rows if row[1] in ("flash_attention_2", "flex_attention")]
    assert len(skipped) == 2 and all(row[-1].startswith("skipped: no CUDA") for row in skipped)
    assert not any(row[-1] == "FAIL" for row in rows)


def test_a_plugin_with_a_wrong_loss_fails_the_check(tmp_path):
    """Every pass's loss 10% too large (a hidden fault only this test uses): each fp32 row fails, the exit status
    is non-zero."""
    text, rows = gpu_check(tmp_path, "--checks", "sdpa-fp32", "--fault", "loss_scale", expect_failure=True)
    assert "4 check(s) FAILED" in text
    assert [row[-1] for row in rows] == ["FAIL"] * 4
    for row in rows:
        update = float(row[2].split("update ")[1].split(";")[0])
        assert 0.05 < update < 0.2, row  # the 10% error, measured


def test_an_extra_site_outside_a_site_packages_folder_is_refused(tmp_path):
    script = load_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--extra-site", str(tmp_path / "carried")])
    assert script.parse_args(["--extra-site", str(tmp_path / "site-packages")]).extra_site.name == "site-packages"
    with pytest.raises(SystemExit):
        script.parse_args(["--checks", "sdpa-fp32,nothing"])
    with pytest.raises(SystemExit):
        script.parse_args(["--speed-layouts", "varlen,nothing"])
    assert script.parse_args(["--speed-layouts", "varlen,auto"]).speed_layouts == "varlen,auto"


def test_the_carried_wheels_pin_a_trl_the_package_accepts():
    import re

    from packaging.requirements import Requirement

    script = load_script()
    pins = dict(spec.split("==") for spec in script.WHEELS)
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    trl = Requirement(re.search(r'^\s*"(trl[^"]*)"', pyproject, re.MULTILINE).group(1))
    assert pins["trl"] in trl.specifier
    assert {"datasets", "pyarrow", "pandas", "dill", "multiprocess", "xxhash", "requests"} <= set(pins)
