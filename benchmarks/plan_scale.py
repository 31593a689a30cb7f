"""``hf-dynbsz plan --lengths`` at cluster scale: the time the simulation of a lengths file takes, beyond imports.

Each case writes a lengths file of ``PROMPT COMPLETION`` lines in training order: the prompts of the long-tailed mix
of :mod:`hf_dynbsz.testing.mixes` (prompts 32-96 tokens, completions lognormal with median ``M / 7`` clipped to
``[8, M]``, ``M = 4096``), each prompt's ``num_generations`` completions consecutive (they share the prompt, as
GRPO's do). It then runs ``hf_dynbsz.cli.main(["plan", ...])`` in this process, its table written to a file, and
times the call: the imports the command does (transformers, TRL, the package) are done before the clock starts,
by a first call on a small file. The plan: ``per_device_train_batch_size 8``, ``gradient_accumulation_steps 2``,
``num_generations 8``, the automatic budget, ``packing_layout auto``, ``balance_across_ranks`` on (the table shows
each step with and without balancing), planned for GPUs (the command's default) on each attention implementation of
``--attention``: sdpa, where "auto" trains padded rows (samples share nothing), and flash_attention_2, where it trains
padding-free rows with a prefix tree (the default ``share_prompt_prefix="tree"``: each prompt's completions share
it).

Usage (from the repository root)::

    python benchmarks/plan_scale.py            # 16,384 lengths over 64 processes, 131,072 over 512
    python benchmarks/plan_scale.py --quick    # 4,096 lengths over 64 processes
    python benchmarks/plan_scale.py --profile  # also a cProfile summary of each case (slower)
    python benchmarks/plan_scale.py --attention sdpa  # one attention implementation only

Writes ``benchmarks/results/plan_scale.md``: the time of each case (the median and the slowest of ``--repeats``
runs), the layout the plan printed and the process's peak resident memory so far (imports included).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, ensure_repo_on_path, load_average, machine_description, markdown_table, median  # noqa: E402

ensure_repo_on_path()

MAX_COMPLETION = 4096
PLAN = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--num_generations", "8"]
CASES = {"full": [(16_384, 64), (131_072, 512)], "quick": [(4_096, 64)]}
ATTENTION = ["sdpa", "flash_attention_2"]


def write_lengths(path: Path, samples: int, num_generations: int = 8, seed: int = 0) -> None:
    """``samples`` lines ``PROMPT COMPLETION``: each prompt's ``num_generations`` completions in a row."""
    import numpy as np

    from hf_dynbsz.testing.mixes import completion_lengths, prompt_lengths

    rng = np.random.default_rng(seed)
    prompts = np.repeat(prompt_lengths("long_tailed", -(-samples // num_generations), rng), num_generations)[:samples]
    completions = completion_lengths("long_tailed", samples, MAX_COMPLETION, rng)
    path.write_text("".join(f"{p} {c}\n" for p, c in zip(prompts.tolist(), completions.tolist())))


def run_plan(lengths: Path, processes: int, output: Path, attention: str = "sdpa") -> float:
    """Seconds ``hf-dynbsz plan --lengths`` takes in this process, its stdout written to ``output``."""
    from hf_dynbsz.cli import main

    argv = ["plan", *PLAN, "--num_processes", str(processes), "--lengths", str(lengths)]
    argv += ["--attn_implementation", attention]
    with open(output, "w") as handle, contextlib.redirect_stdout(handle):
        start = time.perf_counter()
        status = main(argv)
        seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"hf-dynbsz plan exited with {status}: {' '.join(argv)}")
    return seconds


def planned_layout(output: Path) -> str:
    """The layout the plan's simulation names (``layout: padded;``), padding-free rows with the sharing rule of the
    plan's ``share_prompt_prefix`` row."""
    text = output.read_text()
    layout = text.split("layout: ", 1)[1].split(";", 1)[0]
    if layout != "padding_free":
        return layout
    sharing = next(line.split()[1] for line in text.splitlines() if line.startswith("share_prompt_prefix "))
    return f"padding-free, share_prompt_prefix {sharing}"


def profile(lengths: Path, processes: int, output: Path, attention: str) -> str:
    """The 15 costliest functions (cumulative) of one run."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run_plan, lengths, processes, output, attention)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(15)
    return text.getvalue()


def time_case(lengths: Path, samples: int, processes: int, attention: str, work: Path, args) -> list:
    """One row of the report: ``args.repeats`` runs of the plan of ``lengths`` over ``processes`` on ``attention``."""
    output = work / "plan.out"
    seconds = [run_plan(lengths, processes, output, attention) for _ in range(args.repeats)]
    steps = samples // (processes * 16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"{samples} lengths over {processes} processes, {attention}: {median(seconds):.2f} s (median)", flush=True)
    if args.profile:
        print(profile(lengths, processes, output, attention))
    row = [f"{samples:,}", processes, steps, attention, planned_layout(output)]
    return [*row, f"{median(seconds):.2f}", f"{max(seconds):.2f}", f"{peak:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4,096 lengths over 64 processes only")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (the median is reported)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile summary of each case")
    parser.add_argument("--out", default=str(RESULTS_DIR / "plan_scale.md"), help="the markdown report")
    parser.add_argument("--attention", choices=ATTENTION, help="one attention implementation (default: each)")
    args = parser.parse_args()
    rows, load_before = [], load_average()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        write_lengths(work / "warm.txt", 256)
        run_plan(work / "warm.txt", 2, work / "warm.out")  # the command's imports, outside the clock
        for samples, processes in CASES["quick" if args.quick else "full"]:
            lengths = work / f"lengths_{samples}.txt"
            write_lengths(lengths, samples)
            for attention in [args.attention] if args.attention else ATTENTION:
                rows.append(time_case(lengths, samples, processes, attention, work, args))
    header = ["lengths", "processes", "optimizer steps", "attention", "layout", "seconds (median)"]
    header += ["seconds (slowest)", "peak RSS MiB"]
    report = "\n".join(
        [
            "# `hf-dynbsz plan --lengths` at cluster scale",
            "",
            f"Machine: {machine_description()}; load average before: {load_before}.",
            f"Plan: {' '.join(PLAN)}, automatic budget, packing_layout auto (planned for GPUs), "
            "balance_across_ranks on; "
            f"long-tailed lengths (max completion {MAX_COMPLETION}); runs per case: {args.repeats}; imports excluded.",
            "",
            markdown_table(header, rows),
            "",
        ]
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
