"""benchmarks/exactness.py's plumbing: a quick run of one trainer writes its table, within the tests' bars; the full
run is the script's job (its results file is what docs/dpo.md, docs/reward.md and docs/async-grpo.md quote)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from hf_dynbsz.testing import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "exactness.py"


def load_script():
    """The script as a module (registered first: its dataclass looks its module up)."""
    if "exactness" not in sys.modules:
        sys.path.insert(0, str(SCRIPT.parent))
        spec = importlib.util.spec_from_file_location("exactness", SCRIPT)
        sys.modules["exactness"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["exactness"])
    return sys.modules["exactness"]


def test_a_quick_run_writes_its_table(tmp_path):
    output = tmp_path / "exactness.md"
    text = load_script().main(["--only", "reward", "--quick", "--no-split", "--output", str(output)])
    assert output.read_text() == text
    assert "python benchmarks/exactness.py --only reward --quick --no-split" in text and "torch" in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| bradley_terry")]
    assert len(rows) == 1
    _, passes, parameters, update, split, _ = (cell.strip() for cell in rows[0])
    assert int(passes.split("-")[0]) > 2 and split == "-"
    assert float(parameters) < 1e-5 and float(update) < 1e-3


def test_unknown_trainers_are_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--only", "ppo"])
