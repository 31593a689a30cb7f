"""Shared pieces of the benchmarks' reports: table formatting, machine facts. The benchmarks build their runs with
:mod:`hf_dynbsz.testing.harness` and draw lengths from the named mixes of :mod:`hf_dynbsz.testing.mixes` (importing
this module puts the repository on ``sys.path``).

A *sequence* length is prompt + completion tokens (the unit of the token budget).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def ensure_repo_on_path() -> None:
    """Let the scripts run from a checkout without installing the package."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


ensure_repo_on_path()


def median(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else float("nan")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_description() -> str:
    """One line: CPU model, cores, Python, and the versions that matter here."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores", f"Python {platform.python_version()}"]
    for name in ("torch", "transformers", "trl", "numpy"):
        try:
            module = __import__(name)
            parts.append(f"{name} {module.__version__}")
        except Exception:  # noqa: BLE001 - a missing optional package is simply not listed
            pass
    return "; ".join(parts)


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def add_speedups(rows, stock: dict, limit: float) -> None:
    """Each row's ratios to ``stock``'s row of the same run: ``speedup`` (wall), ``speedup_cpu``, ``token_limit``
    (``limit``), ``of_limit`` (the speed-up over the limit), ``memory_ratio`` (peak memory)."""
    for row in rows:
        row["speedup"] = stock["train_s"] / row["train_s"]
        row["speedup_cpu"] = stock["train_cpu_s"] / row["train_cpu_s"]
        row["token_limit"] = limit
        row["of_limit"] = row["speedup"] / limit
        row["memory_ratio"] = row["peak_mb"] / stock["peak_mb"]


def speed_cells(row: dict) -> list[str]:
    """A table row's time cells (:func:`add_speedups`' ratios): step seconds, speed-up, token limit, the share of the
    limit, CPU seconds (their speed-up)."""
    return [
        f"{row['train_s']:.2f}",
        f"{row['speedup']:.2f}x",
        f"{row['token_limit']:.2f}x",
        f"{row['of_limit']:.0%}",
        f"{row['train_cpu_s']:.2f} ({row['speedup_cpu']:.2f}x)",
    ]
