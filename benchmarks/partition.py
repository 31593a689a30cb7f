"""Token-budget partitioner vs simple baselines: micro-batch count, budget overshoot, balance, speed.

Compares, for the same sequence lengths (the long-tailed, bimodal and uniform mixes of
``benchmarks/common.py``, at full scale: ``max_completion_length`` 2048 by default):

* ``ours``: ``hf_dynbsz.planning.partition.partition_by_token_budget`` (the count of first-fit-decreasing, then
  micro-batches balanced by the workload model; what the trainer calls);
* ``fixed count, safe B``: stock TRL's fixed micro-batch of ``B`` consecutive sequences, with ``B = budget //
  (longest possible sequence)``, the largest per_device_train_batch_size that can never exceed the budget.
  In the padded layout its rows are padded as stock TRL pads them: to the longest sequence of the step
  (TRL pads to the longest row of the whole generation batch);
* ``fixed count, mean B``: the same with ``B = budget // mean length``, the count a user would pick from the
  average (fewer micro-batches, but over budget whenever long sequences meet);
* ``sorted greedy``: sort by length (longest first), fill micro-batches in that order, open a new one
  when the next sequence does not fit (next-fit decreasing);
* ``first-fit decreasing``: ``hf_dynbsz.testing.first_fit_decreasing``.

Each is run on "steps" of ``--step-size`` sequences (default 256, one device's samples of one optimizer step,
the way the trainer calls the partitioner), over ``--n`` sequences in total (default 100,000), in both
layouts: ``padding_free`` (a micro-batch computes the sum of its lengths) and ``padded`` (rows x its
own longest row).  Reported per mix, layout and algorithm:

* micro-batches, in total and relative to the lower bound ``token_lower_bound`` (``ceil(tokens / budget)``
  per step, summed);
* computed / real tokens (padding overhead; 1.00 for padding_free);
* budget overshoot: the largest ``tokens - budget`` of any micro-batch, and how many micro-batches are over
  (must be 0 for ours, except a single sequence longer than the budget, which gets a micro-batch alone; with
  the default settings no sequence is);
* imbalance: max / mean of the micro-batch costs of a step under ``WorkloadModel.default`` (a 7B-class
  decoder; varlen attention for padding_free), averaged over steps (1.00 = perfectly even);
* time per 100,000 sequences: the wall time of all the per-step calls, scaled to 100,000 sequences
  (median of ``--repeats`` passes).

A second table times what the scheduler runs per optimizer step of one process, on steps of 4,096 sequences
(more than one device's step holds in practice): ``min_num_microbatches``, then ``partition_by_token_budget`` at
that count (the busiest process), at one more and at 32 more (processes waiting for a busier one), each step on
new lengths.  The target is under 5 ms per step.

Usage (from the repository root; numpy only, no torch)::

    /work/venv/bin/python benchmarks/partition.py            # full run (~1-2 minutes)
    /work/venv/bin/python benchmarks/partition.py --quick    # 10,000 sequences, 1 repeat

Writes ``benchmarks/results/partition.md`` and ``benchmarks/results/partition.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402

from hf_dynbsz.planning.partition import (  # noqa: E402
    WorkloadModel,
    microbatch_tokens,
    min_num_microbatches,
    partition_by_token_budget,
    token_lower_bound,
)
from hf_dynbsz.testing import MIX_LABELS, MIXES, PROMPT_RANGE, first_fit_decreasing, sequence_lengths  # noqa: E402

LAYOUTS = ("padding_free", "padded")
ALGORITHMS = ("ours", "ffd", "sorted_greedy", "fixed_safe", "fixed_mean")
ALGORITHM_LABELS = {
    "ours": "ours (partition_by_token_budget)",
    "ffd": "first-fit decreasing",
    "sorted_greedy": "sorted greedy",
    "fixed_safe": "fixed count, safe B",
    "fixed_mean": "fixed count, mean B",
}


# --------------------------------------------------------------------------------------------- baselines
def fixed_count(lengths, rows: int) -> list[list[int]]:
    """Stock TRL: consecutive micro-batches of ``rows`` sequences, whatever their lengths."""
    n = len(lengths)
    return [list(range(start, min(start + rows, n))) for start in range(0, n, rows)]


def sorted_greedy(lengths, max_tokens: int, layout: str) -> list[list[int]]:
    """Longest first (ties by index); close the micro-batch when the next sequence does not fit."""
    order = np.argsort(-np.asarray(lengths), kind="stable").tolist()
    values = np.asarray(lengths).tolist()
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = widest = 0
    for index in order:
        length = values[index]
        if layout == "padding_free":
            fits = tokens + length <= max_tokens
        else:  # rows x longest row; the first row of a run is its longest
            fits = (len(current) + 1) * max(widest, length) <= max_tokens
        if current and not fits:
            batches.append(current)
            current, tokens, widest = [], 0, 0
        current.append(index)
        tokens += length
        widest = max(widest, length)
    if current:
        batches.append(current)
    return batches


def run_algorithm(name: str, lengths, max_tokens: int, layout: str, safe_rows: int, mean_rows: int):
    if name == "ours":
        return partition_by_token_budget(
            lengths, max_tokens, layout=layout, attention="varlen" if layout == "padding_free" else "dense"
        )
    if name == "ffd":
        return first_fit_decreasing(lengths, max_tokens, layout)
    if name == "sorted_greedy":
        return sorted_greedy(lengths, max_tokens, layout)
    if name == "fixed_safe":
        return fixed_count(lengths, safe_rows)
    if name == "fixed_mean":
        return fixed_count(lengths, mean_rows)
    raise ValueError(name)


# ------------------------------------------------------------------------------------------- measurement
def evaluate(
    lengths: np.ndarray,
    step_size: int,
    max_tokens: int,
    layout: str,
    algorithm: str,
    safe_rows: int,
    mean_rows: int,
    repeats: int,
) -> dict:
    workload = WorkloadModel.default(layout=layout, attention="varlen")
    steps = [lengths[start : start + step_size] for start in range(0, len(lengths), step_size)]
    step_lists = [step.tolist() for step in steps]
    seconds = []
    results = None
    for _ in range(repeats):
        start = time.perf_counter()
        results = [run_algorithm(algorithm, step, max_tokens, layout, safe_rows, mean_rows) for step in steps]
        seconds.append(time.perf_counter() - start)
    count = lower = over = singleton_over = 0
    worst_over = 0
    computed = real = 0
    imbalances = []
    stock_padding = algorithm.startswith("fixed") and layout == "padded"
    for values, microbatches, step in zip(step_lists, results, steps):
        lower += token_lower_bound(step, max_tokens)
        used = [mb for mb in microbatches if mb]
        count += len(used)
        costs = []
        step_longest = max(values)
        for mb in used:
            mb_lengths = [values[i] for i in mb]
            # Stock TRL pads every row to the longest row of the whole generation batch (here: the step).
            shape = [step_longest] * len(mb) if stock_padding else mb_lengths
            tokens = microbatch_tokens(shape, layout)
            computed += tokens
            real += sum(mb_lengths)
            if tokens > max_tokens:
                if len(mb) == 1:
                    singleton_over += 1
                else:
                    over += 1
                    worst_over = max(worst_over, tokens - max_tokens)
            costs.append(workload.cost(shape, layout, attention="varlen"))
        imbalances.append(max(costs) / (sum(costs) / len(costs)))
    return {
        "microbatches": count,
        "lower_bound": lower,
        "computed_over_real": computed / real,
        "over_count": over,
        "worst_over": worst_over,
        "oversize_singletons": singleton_over,
        "imbalance": statistics.fmean(imbalances),
        "imbalance_worst": max(imbalances),
        "seconds_per_100k": statistics.median(seconds) * 100_000 / len(lengths),
    }


#: Samples of one device's optimizer step the planning time is measured at (a few thousand at most in practice).
STEP_SAMPLES = 4096
#: Target: the scheduler's per-step partitioning work at STEP_SAMPLES samples stays under this (ms).
STEP_TARGET_MS = 5.0


def time_steps(
    mix: str, max_tokens: int, layout: str, max_completion_length: int, steps: int, seed: int
) -> list[tuple[str, int, float, float]]:
    """(what, micro-batches, median ms, worst ms) per optimizer step of STEP_SAMPLES sequences, each step new data:
    the scheduler's count (:func:`min_num_microbatches`) and partition at that count (what a process that needs the
    most passes runs), at one more and at 32 more (processes that wait for a busier one)."""
    attention = "varlen" if layout == "padding_free" else "dense"
    timings = {extra: [] for extra in (0, 1, 32)}
    counts = {extra: [] for extra in (0, 1, 32)}
    for step in range(steps):
        base = sequence_lengths(mix, STEP_SAMPLES, max_completion_length, seed + 1000 + step)
        for extra in timings:
            lengths = base.copy()
            lengths[0] += extra + 1  # other data for each timing: each counts its own first-fit, as a new step does
            start = time.perf_counter()
            minimum = min_num_microbatches(lengths, max_tokens, layout=layout)
            result = partition_by_token_budget(
                lengths, max_tokens, num_microbatches=minimum + extra, layout=layout, attention=attention
            )
            timings[extra].append(1000 * (time.perf_counter() - start))
            counts[extra].append(len(result))
    return [
        (
            f"count + partition at minimum + {extra}",
            round(statistics.fmean(counts[extra])),
            statistics.median(timings[extra]),
            max(timings[extra]),
        )
        for extra in timings
    ]


# -------------------------------------------------------------------------------------------------- output
def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "ours": "#1f77b4",
        "ffd": "#ff7f0e",
        "sorted_greedy": "#2ca02c",
        "fixed_safe": "#7f7f7f",
        "fixed_mean": "#d62728",
    }
    mixes = [m for m in MIXES if any(r["mix"] == m for r in rows)]
    panels = [
        ("count_ratio", "micro-batches / lower bound", False),
        ("worst_over", "worst excess over budget, tokens", False),
        ("imbalance", "cost imbalance (max / mean)", False),
        ("ms_per_100k", "ms per 100,000 sequences (log)", True),
    ]
    figure, axes = plt.subplots(len(LAYOUTS), len(panels), figsize=(19, 7.5))
    width = 0.8 / len(ALGORITHMS)
    for r_index, layout in enumerate(LAYOUTS):
        for c_index, (key, label, log) in enumerate(panels):
            axis = axes[r_index][c_index]
            for position, algorithm in enumerate(ALGORITHMS):
                xs, ys = [], []
                for m_index, mix in enumerate(mixes):
                    match = [
                        r for r in rows if r["mix"] == mix and r["layout"] == layout and r["algorithm"] == algorithm
                    ]
                    if match:
                        xs.append(m_index + (position - (len(ALGORITHMS) - 1) / 2) * width)
                        ys.append(match[0][key])
                bars = axis.bar(xs, ys, width, color=colours[algorithm], label=ALGORITHM_LABELS[algorithm])
                for bar, value in zip(bars, ys):
                    axis.annotate(
                        f"{value:.2f}" if value < 10 and value != int(value) else f"{value:.0f}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                    )
            if log:
                axis.set_yscale("log")
            axis.set_xticks(range(len(mixes)), [MIX_LABELS[m] for m in mixes], fontsize=8)
            axis.set_title(f"{layout}: {label}", fontsize=10)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10,000 sequences, 1 repeat")
    parser.add_argument("--n", type=int, help="sequences in total per mix (default 100000)")
    parser.add_argument("--step-size", type=int, default=256, help="sequences per partitioner call (one step)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    parser.add_argument("--max-completion-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, help="timing passes (median reported; default 3)")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return parser.parse_args()


def measure_mix(args, mix: str, n: int, repeats: int) -> tuple[list[dict], list[tuple]]:
    """``mix``'s rows (one per layout and algorithm) and its planning-time tables (one per layout)."""
    budget = args.max_tokens
    lengths = sequence_lengths(mix, n, args.max_completion_length, args.seed)
    safe_rows = max(1, budget // (PROMPT_RANGE[1] + args.max_completion_length))
    mean_rows = max(1, int(budget // lengths.mean()))
    print(
        f"{mix}: {n} lengths, median {int(np.median(lengths))}, mean {lengths.mean():.0f}, max "
        f"{lengths.max()}; safe B={safe_rows}, mean B={mean_rows}",
        flush=True,
    )
    rows, speed_tables = [], []
    for layout in LAYOUTS:
        for algorithm in ALGORITHMS:
            result = evaluate(lengths, args.step_size, budget, layout, algorithm, safe_rows, mean_rows, repeats)
            result.update(mix=mix, layout=layout, algorithm=algorithm, safe_rows=safe_rows, mean_rows=mean_rows)
            result.update(
                count_ratio=result["microbatches"] / result["lower_bound"],
                ms_per_100k=result["seconds_per_100k"] * 1000,
            )
            rows.append(result)
            print(
                f"  {layout:6s} {algorithm:13s} micro-batches {result['microbatches']:6d} "
                f"(x{result['count_ratio']:.3f} of bound)  over {result['over_count']}  "
                f"imbalance {result['imbalance']:.3f}  {result['ms_per_100k']:.0f} ms/100k",
                flush=True,
            )
        steps = 3 if args.quick else 12
        timings = time_steps(mix, budget, layout, args.max_completion_length, steps=steps, seed=args.seed)
        speed_tables.append((mix, layout, timings))
    return rows, speed_tables


def quality_table(rows: list[dict]) -> str:
    header = ["mix", "layout", "algorithm", "micro-batches", "/ lower bound", "computed / real tokens"]
    header += ["over budget (worst excess tokens)", "imbalance max/mean (worst step)", "ms per 100k sequences"]
    body = []
    for row in rows:
        label = ALGORITHM_LABELS[row["algorithm"]]
        if row["algorithm"] == "fixed_safe":
            label += f" (B={row['safe_rows']})"
        elif row["algorithm"] == "fixed_mean":
            label += f" (B={row['mean_rows']})"
        over = f"{row['over_count']} ({row['worst_over']})"
        if row["oversize_singletons"]:
            over += f" + {row['oversize_singletons']} oversize singletons"
        body.append(
            [
                MIX_LABELS[row["mix"]],
                row["layout"],
                label,
                row["microbatches"],
                f"{row['count_ratio']:.3f}",
                f"{row['computed_over_real']:.3f}",
                over,
                f"{row['imbalance']:.3f} ({row['imbalance_worst']:.2f})",
                f"{row['ms_per_100k']:.0f}",
            ]
        )
    return markdown_table(header, body)


def speed_table(speed_tables: list[tuple]) -> str:
    body = []
    for mix, layout, timings in speed_tables:
        for label, count, median_ms, worst_ms in timings:
            body.append([MIX_LABELS[mix], layout, label, count, f"{median_ms:.1f}", f"{worst_ms:.1f}"])
    return markdown_table(["mix", "layout", "calls per step", "micro-batches", "median ms", "worst ms"], body)


QUALITY_NOTE = (
    "*micro-batches / lower bound*: total micro-batches over the sum of per-step `token_lower_bound` "
    "(ceil(tokens / budget)). *computed / real tokens*: positions computed (padding included) over real "
    "tokens. *over budget*: micro-batches with more computed tokens than the budget (largest excess in "
    "brackets). *imbalance*: max / mean of `WorkloadModel.default` cost over a step's micro-batches, mean "
    "over steps (worst step in brackets). *ms per 100k sequences*: all per-step calls, scaled. The lower "
    "bound counts tokens only, so the padded layout cannot reach it (a padded micro-batch computes rows x "
    "its longest row); there first-fit decreasing on the sorted lengths is already the fewest "
    "micro-batches, "
    "and ours matches that count while evening out the cost. Fixed-count rows in the padded layout are "
    "padded the way stock TRL pads them, to the longest sequence of the step. The uniform mix has nothing "
    "to optimise (all sequences equal): every algorithm ties there, and it checks that ours costs nothing."
)


def report_markdown(args, quality: str, speed: str, settings: str, worst_median: float, seconds: float) -> str:
    command = "python benchmarks/partition.py" + (" --quick" if args.quick else "")
    sections = [
        f"# Partitioner vs baselines{' (quick run)' if args.quick else ''}",
        f"Generated by `{command}` in {seconds:.0f} s. {settings}",
        f"Machine: {machine_description()}; load average {load_average()} (shared machine).",
        "## Quality and speed, per optimizer step of " + str(args.step_size) + " sequences",
        quality,
        QUALITY_NOTE,
        f"## Planning time per optimizer step of {STEP_SAMPLES:,} sequences",
        speed,
        f"What the scheduler runs per step and process: the pass count, then the partition at the count every "
        f"process agreed on (each step new data, so first-fit is computed once per step as in training). "
        f"Target: "
        f"under {STEP_TARGET_MS:g} ms per step; the largest median here is {worst_median:.1f} ms.",
    ]
    return "\n\n".join(sections) + "\n"


def main() -> None:
    args = parse_args()
    n = args.n or (10_000 if args.quick else 100_000)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    rows, speed_tables = [], []
    for mix in args.mixes.split(","):
        mix_rows, mix_speed = measure_mix(args, mix, n, repeats)
        rows += mix_rows
        speed_tables += mix_speed
    quality, speed = quality_table(rows), speed_table(speed_tables)
    worst_median = max(median for _, _, timings in speed_tables for _, _, median, _ in timings)
    settings = (
        f"{n:,} sequences per mix (prompt {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} tokens + completion, "
        f"max_completion_length {args.max_completion_length}), budget {args.max_tokens} tokens per micro-batch, "
        f"partitioned in steps of {args.step_size} sequences; timings: median of {repeats} pass(es)."
    )
    markdown = report_markdown(args, quality, speed, settings, worst_median, time.perf_counter() - started)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "partition_quick" if args.quick else "partition"
    (args.out_dir / f"{name}.md").write_text(markdown)
    plot(rows, args.out_dir / f"{name}.png", settings)
    print()
    print(quality)
    print()
    print(speed)
    print(f"\nwrote {args.out_dir / (name + '.md')} and {name}.png")


if __name__ == "__main__":
    main()
