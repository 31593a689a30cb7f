"""``hf-dynbsz report OUTPUT_DIR [OUTPUT_DIR ...]``: compare training runs from their logged metrics.

Each run is read from its ``trainer_state.json`` (``trainer.save_state()`` writes it to the output directory; every
checkpoint holds one too, so a run that stopped early is read from its latest checkpoint). The report is a
markdown table, one row per run (printed, and written with ``--markdown``), and a PNG with one panel per figure
and one line per run: the reward (mean and std: the first curve to check that a run learns) and the mean completion
length beside the efficiency figures: padding fraction, tokens per second, peak memory, micro-batches and dummy
passes per step, and, when the runs logged them, rank imbalance and shared tokens saved. The typical use is a
``DIFFU_*`` sweep (``examples/sweep.sh``): which budget gives the most tokens per second within the memory you have.

Pure reading and plotting: no torch, no TRL (matplotlib for the PNG).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Run", "find_trainer_state", "main", "markdown_table", "plot_runs", "read_run"]

_EXIT_USAGE = 2


class ReportError(ValueError):
    """A problem with the user's input (a directory without a trainer state, ...): exit status 2."""


@dataclass
class Run:
    """One run's logged optimizer steps that carry ``dynbsz/*`` metrics, in step order."""

    name: str
    state_file: Path
    steps: list[dict]

    def values(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` of ``metric`` for the steps that logged it (under its name, or a run of an earlier release
        under its former name, :data:`FORMER_NAMES`)."""
        found = [
            (entry["step"], entry.get(metric, entry.get(FORMER_NAMES.get(metric, metric)))) for entry in self.steps
        ]
        return [(step, float(value)) for step, value in found if value is not None]

    def mean(self, metric: str) -> float | None:
        values = [value for _, value in self.values(metric)]
        return sum(values) / len(values) if values else None

    def maximum(self, metric: str) -> float | None:
        return max((value for _, value in self.values(metric)), default=None)

    def last(self, metric: str) -> float | None:
        values = self.values(metric)
        return values[-1][1] if values else None


def find_trainer_state(directory: str | Path) -> Path:
    """``directory/trainer_state.json``, else that of the latest ``checkpoint-N`` inside it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{str(directory)!r} is not a directory: give a training run's output_dir.")
    state = directory / "trainer_state.json"
    if state.is_file():
        return state
    checkpoints = [
        path
        for path in directory.glob("checkpoint-*")
        if re.fullmatch(r"checkpoint-\d+", path.name) and (path / "trainer_state.json").is_file()
    ]
    if not checkpoints:
        raise ReportError(
            f"{str(directory)!r} holds no trainer_state.json and no checkpoint-N/trainer_state.json: call "
            "trainer.save_state() at the end of training (examples/grpo.py does), or save checkpoints."
        )
    latest = max(checkpoints, key=lambda path: int(path.name.split("-")[1]))
    return latest / "trainer_state.json"


def read_run(directory: str | Path, name: str | None = None) -> Run:
    """The run of ``directory`` (see :func:`find_trainer_state`); ``name`` defaults to the directory's name."""
    state_file = find_trainer_state(directory)
    try:
        history = json.loads(state_file.read_text(encoding="utf-8")).get("log_history", [])
    except (OSError, json.JSONDecodeError, AttributeError) as error:
        raise ReportError(f"cannot read {str(state_file)!r}: {error}") from None
    steps = [
        entry
        for entry in history
        if isinstance(entry, dict) and "step" in entry and any(key.startswith("dynbsz/") for key in entry)
    ]
    if not steps:
        raise ReportError(
            f"{str(state_file)!r} has no dynbsz/ metrics: the run did not use DynamicBatchGRPOTrainer "
            "with dynamic_batching on, or logged nothing (logging_steps)."
        )
    return Run(name or Path(directory).resolve().name, state_file, sorted(steps, key=lambda entry: entry["step"]))


#: Metrics renamed, by their name now: the name earlier releases logged them under.
FORMER_NAMES = {"dynbsz/shared_tokens_saved": "dynbsz/prompt_tokens_saved"}

#: The table's columns: (header, metric, how a run's steps are summarised, format).
COLUMNS = (
    ("steps", None, None, "d"),
    ("tokens/s", "dynbsz/tokens_per_second", "mean", ",.0f"),
    ("peak memory MiB", "dynbsz/peak_memory_mib", "max", ",.0f"),
    ("padding", "dynbsz/padding_fraction", "mean", ".1%"),
    ("micro-batches/step", "dynbsz/microbatches_max_over_ranks", "mean", ".2f"),
    ("dummy passes/step", "dynbsz/dummy_passes", "mean", ".2f"),
    ("train s/step", "dynbsz/train_seconds", "mean", ".3f"),
    ("MFU", "dynbsz/mfu", "mean", ".1%"),
    ("rank imbalance", "dynbsz/rank_imbalance_after", "mean", ".3f"),
    ("shared tokens saved/step", "dynbsz/shared_tokens_saved", "mean", ",.0f"),
    ("reward (last)", "reward", "last", ".3f"),
    ("completion length (mean)", "completions/mean_length", "mean", ",.1f"),
)


def markdown_table(runs: Sequence[Run]) -> str:
    """One row per run: step counts, means over steps (maximum for memory, last for reward); "-" where a run did
    not log the metric (MFU without a known device peak, rank imbalance on one process)."""
    columns = [column for column in COLUMNS if column[1] is None or any(run.values(column[1]) for run in runs)]
    lines = ["| run | " + " | ".join(header for header, *_ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for run in runs:
        cells = []
        for _, metric, how, spec in columns:
            value = len(run.steps) if metric is None else getattr(run, {"max": "maximum"}.get(how, how))(metric)
            cells.append(
                "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
            )
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The PNG's panels: (title, metrics drawn in it); a panel no run logged is left out.
PANELS = (
    ("reward: mean (solid) and std (dashed)", ("reward", "reward_std")),
    ("completion length (mean tokens)", ("completions/mean_length",)),
    ("padding fraction", ("dynbsz/padding_fraction",)),
    ("tokens per second", ("dynbsz/tokens_per_second",)),
    ("peak memory (MiB)", ("dynbsz/peak_memory_mib",)),
    (
        "micro-batches (solid) and dummy passes (dashed) per step",
        ("dynbsz/microbatches_max_over_ranks", "dynbsz/dummy_passes"),
    ),
    ("rank imbalance (largest process cost / mean)", ("dynbsz/rank_imbalance_after",)),
    ("shared tokens saved per step", ("dynbsz/shared_tokens_saved",)),
)


def plot_runs(runs: Sequence[Run], path: str | Path) -> None:
    """The PNG: one panel per figure of :data:`PANELS` that some run logged, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(title, metrics) for title, metrics in PANELS if any(run.values(m) for run in runs for m in metrics)]
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (title, metrics) in zip(axes.flat, panels):
        for index, run in enumerate(runs):
            for style, metric in zip(("-", "--"), metrics):
                points = run.values(metric)
                if points:
                    steps, values = zip(*points)
                    axis.plot(
                        steps,
                        values,
                        style,
                        color=colours[index % len(colours)],
                        marker=".",
                        label=run.name if style == "-" else None,
                    )
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(len(runs), 4), fontsize=9)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dynbsz report",
        description="Compare training runs from the dynbsz/ metrics of their trainer_state.json: a markdown table "
        "(printed) and a PNG of the figures per optimizer step.",
    )
    parser.add_argument(
        "output_dirs",
        nargs="+",
        metavar="OUTPUT_DIR",
        help="a run's output_dir (its trainer_state.json, else its latest checkpoint's)",
    )
    parser.add_argument("--png", default="dynbsz_report.png", help="where to write the PNG (default: %(default)s)")
    parser.add_argument("--markdown", default=None, help="also write the table to this markdown file")
    parser.add_argument(
        "--names", default=None, help="comma-separated run names, one per OUTPUT_DIR (default: the directories' names)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """``hf-dynbsz report``; returns the exit status (2 for a directory that holds no run)."""
    options = _parser().parse_args(list(argv))
    try:
        names = options.names.split(",") if options.names else [None] * len(options.output_dirs)
        if len(names) != len(options.output_dirs):
            raise ReportError(
                f"--names gives {len(names)} names for {len(options.output_dirs)} OUTPUT_DIRs: give "
                "one per directory, in the same order."
            )
        runs = [read_run(directory, name) for directory, name in zip(options.output_dirs, names)]
    except ReportError as error:
        print(f"hf-dynbsz report: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    table = markdown_table(runs)
    print(table)
    if options.markdown:
        Path(options.markdown).write_text(table + "\n", encoding="utf-8")
    try:
        plot_runs(runs, options.png)
    except ImportError:
        print(
            "hf-dynbsz report: PNG not written: matplotlib is not installed (pip install matplotlib, or in a "
            "checkout of hf-dynbsz: pip install -e '.[report]').",
            file=sys.stderr,
        )
        return 0
    print(f"\nPlot written to {options.png}")
    return 0
