"""Sequence parallelism (DeepSpeed Ulysses): peak memory per process and step time for long completions, and the
longest completion that trains under a per-process memory cap, with ``sequence_parallel_size`` 1 and 2.

Run from the repository root (about 25 minutes on 2 CPU cores; ``--quick`` for a smaller run):

    python benchmarks/sequence_parallel.py

Every configuration is a fresh ``accelerate launch`` (DDP over gloo on CPU). Both train the same GRPO steps: one
prompt (16 tokens) with 2 completions of exactly ``L`` tokens per step (scripted rollouts, so no generation time),
each training pass holding one sequence: ``sp_size=1`` is 1 process with ``per_device_train_batch_size=2`` and a
budget of one sequence; ``sp_size=2`` is 2 processes (one group) with ``per_device_train_batch_size=1`` and half that
budget per device, so a pass's row spans the group. The model is a Qwen2-style decoder whose activations count (hidden
256, 4 layers, 8 heads, 2 key/value heads, a 64-token vocabulary), fp32, sdpa, gradient checkpointing off (TRL's
default is on); each process runs 1 thread (2 cores: ``sp_size=2`` uses both, ``sp_size=1`` one), and glibc returns
freed blocks over 128 KiB to the system (``MALLOC_MMAP_THRESHOLD_``), so that the resident set is what the process
uses, not what its heap kept.

Peak memory is each process's resident-set high-water mark over the whole run (sampled, and ``VmHWM``), the largest
over processes: the figure a per-process memory cap applies to. The increment is that peak minus the process's
resident set just before training (the weights, optimizer and libraries). Step time is the median ``step_time`` of
the steps after the first. The longest completion under a cap: the largest ``L`` (to ``--resolution`` tokens, by
doubling then bisection) whose measured peak is at most ``--cap_mib`` (default: the ``sp_size=1`` peak at the second
table length); measured, not enforced: a run over the cap is not killed.

Writes ``benchmarks/results/sequence_parallel.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT_TOKENS = 16
if str(ROOT) not in sys.path:  # the driver runs from a checkout
    sys.path.insert(0, str(ROOT))


def build_run(length: int, sequence_parallel_size: int, steps: int, out: str, layers: int):
    """The plugin's trainer of one run: completions of ``length`` tokens after a prompt of PROMPT_TOKENS, one
    sequence per pass over the sequence-parallel group, ``layers`` layers of hidden 256."""
    import numpy as np

    from hf_dynbsz.testing import ModelShape, scripted_run

    budget = -(-(length + PROMPT_TOKENS) // sequence_parallel_size)  # one sequence per pass, over the group
    return scripted_run(
        "grpo_dynamic",
        out + "-run",
        ModelShape(256, layers, num_heads=8, num_kv_heads=2, vocab_size=64),
        completion_lengths=lambda rng, n, rank: np.full(n, length),
        prompt_length=lambda rng: PROMPT_TOKENS,
        max_completion_length=length,
        max_positions=length + PROMPT_TOKENS + 8,
        prompts=64,
        prompt_prefix="p",
        reward=lambda completions, **kw: [float(i % 2) for i in range(len(completions))],
        per_device_train_batch_size=2 // sequence_parallel_size,
        gradient_accumulation_steps=1,
        num_generations=2,
        max_steps=steps,
        beta=0.0,
        learning_rate=1e-6,
        max_tokens_per_microbatch=budget,
        max_tokens_per_microbatch_logprob=budget,
        self_check=False,
        sequence_parallel_size=sequence_parallel_size,
        gradient_checkpointing=False,
        activation_checkpointing=False,
    )


def worker(length: int, sequence_parallel_size: int, steps: int, out: str, layers: int) -> None:
    from hf_dynbsz.execution.device_memory import status_mib
    from hf_dynbsz.testing import ResidentSetSampler, quiet_worker

    quiet_worker(threads=1)
    trainer = build_run(length, sequence_parallel_size, steps, out, layers)
    before = status_mib("VmRSS")
    with ResidentSetSampler() as sampler:
        trainer.train()
    peak = max(sampler.peak_mib, status_mib("VmHWM") or 0.0)
    steps_logged = [e for e in trainer.state.log_history if "step_time" in e]
    record = {
        "rank": trainer.accelerator.process_index,
        "peak_mib": peak,
        "before_mib": before,
        "step_times": [e["step_time"] for e in steps_logged],
        "passes": [e.get("dynbsz/microbatches") for e in steps_logged],
        "tokens_per_pass": [e.get("dynbsz/tokens_per_microbatch_max") for e in steps_logged],
    }
    with open(f"{out}.rank{record['rank']}.json", "w") as f:
        json.dump(record, f)
    trainer.end()
    sys.stdout.flush()
    os._exit(0)


def run(length: int, size: int, steps: int, scratch: Path, layers: int = 4) -> dict:
    from hf_dynbsz.testing import accelerate_command

    out = scratch / f"L{length}-sp{size}"
    command = accelerate_command(
        "cpu_ddp.yaml",
        Path(__file__).resolve(),
        *("--worker", "--length", length, "--size", size, "--steps", steps, "--out", out, "--layers", layers),
        num_processes=size,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }  # freed large blocks go back to the system: the resident set is use
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"L={length} sp={size} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(size)]
    times = sorted(t for t in records[0]["step_times"][1:])
    return {
        "length": length,
        "sp_size": size,
        "peak_mib": max(r["peak_mib"] for r in records),
        "increment_mib": max(r["peak_mib"] - r["before_mib"] for r in records),
        "step_seconds": times[len(times) // 2],
        "passes": records[0]["passes"],
        "tokens_per_pass": records[0]["tokens_per_pass"],
        "wall_seconds": time.perf_counter() - started,
    }


def longest_under(cap: float, size: int, results: dict, scratch: Path, layers: int, resolution: int) -> int | None:
    """The longest completion (a multiple of ``resolution``) whose measured peak is at most ``cap``: doubling from
    the shortest length measured, then bisection (runs of 2 steps; each measured run is kept in ``results``)."""

    def fits(length: int) -> bool:
        if (length, size) not in results:
            results[length, size] = run(length, size, 2, scratch, layers)
            print(json.dumps(results[length, size]), flush=True)
        return results[length, size]["peak_mib"] <= cap

    low = min(length for length, s in results if s == size)
    if not fits(low):
        return None
    high = low * 2
    while fits(high):
        low, high = high, high * 2
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--lengths", default="2048,4096,8192", help="completion lengths of the table")
    parser.add_argument(
        "--resolution", type=int, default=256, help="tokens: the longest under the cap is found to this"
    )
    parser.add_argument(
        "--cap_mib",
        type=float,
        default=None,
        help="per-process memory cap, MiB (default: the sp_size=1 peak at the second table length)",
    )
    parser.add_argument("--quick", action="store_true", help="lengths 1024,2048, 2 layers, resolution 512")
    cli = parser.parse_args()
    if cli.quick:
        cli.lengths, cli.layers, cli.resolution = "1024,2048", 2, 512
    return cli


def report_text(results: dict, lengths: list[int], cap: float, longest: dict, quick: bool) -> str:
    """The report: per length, the peaks, increments and step times of sp_size 1 and 2; the longest completion under
    ``cap`` MiB of each."""
    from common import machine_description, markdown_table

    rows = []
    for length in lengths:
        one, two = results[length, 1], results[length, 2]
        rows.append(
            [
                length + PROMPT_TOKENS,
                f"{one['peak_mib']:.0f}",
                f"{two['peak_mib']:.0f}",
                f"{one['increment_mib']:.0f}",
                f"{two['increment_mib']:.0f}",
                f"{two['increment_mib'] / one['increment_mib']:.2f}x",
                f"{one['step_seconds']:.2f}",
                f"{two['step_seconds']:.2f}",
                f"{one['step_seconds'] / two['step_seconds']:.2f}x",
            ]
        )
    header = ["tokens per sequence", "peak MiB/process, sp 1", "sp 2", "increment MiB, sp 1", "sp 2"]
    header += ["increment sp 2 / sp 1", "s/step, sp 1", "sp 2", "speed-up"]
    ratio = (longest[2] / longest[1]) if longest[1] and longest[2] else None
    summary = (
        f"Longest completion whose measured per-process peak stays under {cap:.0f} MiB: sp_size=1: "
        f"{longest[1]} tokens, sp_size=2: {longest[2]} tokens" + (f" ({ratio:.2f}x)." if ratio else ".")
    )
    command = "python benchmarks/sequence_parallel.py" + (" --quick" if quick else "")
    return (
        f"# Sequence parallelism (DeepSpeed Ulysses): sp_size 1 vs 2\n\n`{command}` on {machine_description()}.\n\n"
        f"Two completions of L tokens (prompt {PROMPT_TOKENS}) per step, one sequence per training pass; "
        "see the script's docstring for the setup.\n\n" + markdown_table(header, rows) + "\n\n" + summary + "\n"
    )


def plot(results: dict, cap: float) -> None:
    """Peak MiB per process against completion tokens, per sp_size, with the cap (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for size in (1, 2):
        points = sorted((length, record["peak_mib"]) for (length, s), record in results.items() if s == size)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"sp_size={size}")
    axis.axhline(cap, color="gray", linestyle="--", label=f"cap {cap:.0f} MiB")
    axis.set_xlabel("completion tokens")
    axis.set_ylabel("peak MiB per process")
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "sequence_parallel.png", dpi=120)


def main() -> None:
    cli = parse_args()
    if cli.worker:
        worker(cli.length, cli.size, cli.steps, cli.out, cli.layers)
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "hf-dynbsz-sp-bench"
    scratch.mkdir(parents=True, exist_ok=True)
    lengths = [int(v) for v in cli.lengths.split(",")]
    results = {}
    for length in lengths:
        for size in (1, 2):
            results[length, size] = run(length, size, cli.steps, scratch, cli.layers)
            print(json.dumps(results[length, size]), flush=True)
    cap = cli.cap_mib or results[lengths[1], 1]["peak_mib"]
    longest = {size: longest_under(cap, size, results, scratch, cli.layers, cli.resolution) for size in (1, 2)}
    text = report_text(results, lengths, cap, longest, cli.quick)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sequence_parallel.md").write_text(text)
    (RESULTS / "sequence_parallel.json").write_text(
        json.dumps({"cap_mib": cap, "longest": longest, "runs": [results[key] for key in sorted(results)]}, indent=1)
    )
    plot(results, cap)
    print(text)


if __name__ == "__main__":
    main()
