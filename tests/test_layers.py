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
        if path.name != "__init__.py" and path.parent.name not in ("testing", "trainers"):
            assert not any(name.startswith("hf_dynbsz.trainers") for name in internal_imports(path)), path


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
    assert {"benchmarks/step_time.py", "tests/distributed_grpo.py", "hf_dynbsz/trainers/grpo.py"} <= names
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


def module_name(path: Path) -> str:
    """``hf_dynbsz/planning/cost.py`` -> ``hf_dynbsz.planning.cost`` (a package is its ``__init__``'s name)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """The ``hf_dynbsz`` modules ``path`` imports anywhere in it (at the top, inside a function, under
    ``TYPE_CHECKING``): ``from hf_dynbsz.a import b`` imports the module ``hf_dynbsz.a.b`` where there is one, else
    ``hf_dynbsz.a``."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            modules |= submodules or {node.module}
    return modules - {module_name(path)}


IMPORT_GRAPH = {name: imported_modules(path) for name, path in MODULES.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold more than one module (Tarjan's algorithm): each is
    a set of modules that import each other, directly or through others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_import_graph_is_found():
    assert "hf_dynbsz.planning.plan" in IMPORT_GRAPH["hf_dynbsz.cli"], IMPORT_GRAPH["hf_dynbsz.cli"]
    assert "hf_dynbsz.planning.settings" in IMPORT_GRAPH["hf_dynbsz.planning.coerce"]  # under TYPE_CHECKING


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_of_the_package_imports_itself_through_others():
    """The modules form floors: no import circle, however long, at the top or inside a function."""
    cycles = import_cycles(IMPORT_GRAPH)
    assert not cycles, "; ".join(" <-> ".join(cycle) for cycle in cycles)


def test_planning_imports_nothing_of_the_package_outside_planning():
    for name, imported in IMPORT_GRAPH.items():
        if name.startswith("hf_dynbsz.planning"):
            outside = {module for module in imported if not module.startswith("hf_dynbsz.planning")}
            assert not outside, f"{name} imports {sorted(outside)}"


def floor_imports(importer: str, imported: str) -> list[str]:
    """Every ``a -> b`` import of a module of folder ``importer`` from a module of folder ``imported``."""
    return [
        f"{name} -> {module}"
        for name, modules in IMPORT_GRAPH.items()
        if name.startswith(f"hf_dynbsz.{importer}.")
        for module in sorted(modules)
        if module.startswith(f"hf_dynbsz.{imported}.")
    ]


def test_execution_stands_on_parallel_and_parallel_imports_nothing_of_execution():
    """``parallel/`` moves tensors between processes; ``execution/`` builds what travels (a batch's records) and
    runs the passes: one direction only."""
    assert floor_imports("execution", "parallel"), "the check looks at the wrong folders"
    assert not floor_imports("parallel", "execution"), floor_imports("parallel", "execution")
