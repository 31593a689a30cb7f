"""The package's layers, as folders: what each may import.

``hf_dynbsz/planning`` is the pure planning core (settings, budgets, partition, schedule, memory model, model
support): no module in it imports torch, transformers, TRL, accelerate or DeepSpeed, at the top or inside a function.
The test walks the folder, so a module added there later is checked without editing a list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dynbsz"
HEAVY = {"torch", "transformers", "trl", "accelerate", "deepspeed", "datasets", "peft"}


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every import in ``path`` (absolute imports; relative ones stay in hf_dynbsz)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def internal_imports(path: Path) -> set[str]:
    """The ``hf_dynbsz`` modules ``path`` imports (absolute form, as the package writes them)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_dynbsz"):
            modules.add(node.module)
    return modules


PLANNING = sorted((PACKAGE / "planning").rglob("*.py"))


def test_the_planning_folder_is_found():
    assert len(PLANNING) >= 10, PLANNING


@pytest.mark.parametrize("path", PLANNING, ids=lambda path: path.name)
def test_a_planning_module_imports_no_torch_or_trainer_library(path):
    assert not imported_roots(path) & HEAVY, f"{path.name} imports {sorted(imported_roots(path) & HEAVY)}"


@pytest.mark.parametrize("path", PLANNING, ids=lambda path: path.name)
def test_a_planning_module_imports_only_the_planning_layer(path):
    outside = {module for module in internal_imports(path) if not module.startswith("hf_dynbsz.planning")}
    assert not outside, f"{path.name} imports {sorted(outside)} from outside hf_dynbsz/planning"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import torch.nn\n    from trl import GRPOConfig\n")
    assert imported_roots(sample) == {"torch", "trl"}


def test_the_layers_below_the_trainer_do_not_import_it():
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("trainer.py", "__init__.py") and path.parent.name != "testing":
            assert "hf_dynbsz.trainer" not in internal_imports(path), path


MAX_FUNCTION_LINES = 80
REPO = PACKAGE.parent
#: The package, the benchmarks and the tests' helper modules (the scripts that build and run training: the workers
#: ``accelerate launch`` starts, the memory-capped run); the test modules themselves are specifications, not counted.
SIZED = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py"))
SIZED += sorted(path for path in (REPO / "tests").glob("*.py") if not path.name.startswith(("test_", "conftest")))


def long_functions(path: Path, root: Path = REPO) -> list[str]:
    """``path``'s functions over :data:`MAX_FUNCTION_LINES` lines (docstrings and all), named from ``root``."""
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_the_sized_modules_are_found():
    names = {path.relative_to(REPO).as_posix() for path in SIZED}
    assert {"benchmarks/step_time.py", "tests/distributed_grpo.py", "hf_dynbsz/trainer.py"} <= names
    assert "tests/test_layers.py" not in names


def test_no_function_in_the_package_the_benchmarks_or_the_tests_helpers_is_over_80_lines():
    """A function longer than that is two functions (ruff's statement limit, PLR0915, catches most; this counts
    lines, docstrings and all)."""
    long = [entry for path in SIZED for entry in long_functions(path)]
    assert not long, long


def test_the_size_check_sees_a_long_function(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(sample, tmp_path) == [f"sample.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
