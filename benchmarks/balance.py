"""Cross-rank balancing: lopsided against even work on 2 real processes, and a simulation at 8, 32 and 128 ranks.

Part 1, real runs (``accelerate launch``, 2 CPU processes, DDP over gloo, one torch thread each): the dynamic
trainer trains a Qwen2-style model (hidden 128, 3 layers, vocabulary 4096, fp32, sdpa) on scripted completions
(TRL's ``rollout_func``, :class:`hf_dynbsz.testing.ScriptedRollout`). Every optimizer step has the same work in
total: 8 samples per process, half of all samples 448 tokens long (32 prompt + 416 completion), half 64 tokens
(32 + 32). *lopsided*: process 1 holds every long sample; *even*: each process holds half long, half short.
Measured: wall time of the trainer's training phase per optimizer step (``DynamicBatchGRPOTrainer._train_step``
on process 0: the exchange of samples, every pass, and the wait for the other process at the gradient
synchronisation; no generation), median over the measured steps (the first is warm-up), then the median over
repeats; runs interleave the configurations. Goal: lopsided / even <= 1.10 with balancing on.

Part 2, simulation: each step, every one of ``P`` processes holds 16 samples of the long-tailed mix of
``benchmarks/common.py`` (max completion 4096 tokens, prompts 32-96). The processes' schedules are computed by
:func:`hf_dynbsz.planning.schedule.simulate_processes` (the trainer's own scheduling code, each collective computed
over the processes' values) for a 7B-class decoder (the partitioner's default workload model) with padding-free rows
on a varlen kernel and a budget of 16,384 tokens per pass. A process's predicted time is the sum of its passes'
costs; a step's predicted time is that of the slowest process (every process waits for it at the gradient
synchronisation); *perfect* is the total cost over ``P``. Goal: within 5% of perfect at 128 processes. The
planning time a process spends per balanced step (all-gather aside) is measured too: ``Scheduler.plan`` on process
0, its all-gather answered with every process's values, checked equal to the simulated schedule.

Usage (from the repository root)::

    python benchmarks/balance.py            # both parts, about 10 minutes on 2 cores
    python benchmarks/balance.py --quick    # smoke run

Writes ``benchmarks/results/balance.md``, ``balance.png`` and ``balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, ensure_repo_on_path, load_average, machine_description, markdown_table  # noqa: E402

ensure_repo_on_path()
from hf_dynbsz.testing import accelerate_command, run_with_timeout  # noqa: E402

LONG, SHORT, PROMPT = 416, 32, 32
CONFIGS = {  # name: (lengths, balance_across_ranks)
    "lopsided, balancing on": ("lopsided", True),
    "lopsided, balancing off": ("lopsided", False),
    "even, balancing on": ("even", True),
    "even, balancing off": ("even", False),
}


# --------------------------------------------------------------------------------------------------- part 1
def completion_lengths(lengths: str):
    """The scripted completion lengths (tokens) of ``lengths``: "lopsided" gives every long one to process 1,
    "even" alternates long and short on every process."""
    import numpy as np

    def draw(rng, n, rank):
        if lengths == "lopsided":
            return np.full(n, LONG if rank == 1 else SHORT)
        return np.array([LONG if i % 2 == 0 else SHORT for i in range(n)])

    return draw


def timed_train_steps(trainer) -> list[float]:
    """The wall time of each of the plugin's training steps (seconds), filled as the trainer trains."""
    timings = []
    train_step = trainer._dynbsz.train_step

    def timed(model_, window):
        start = time.perf_counter()
        result = train_step(model_, window)
        timings.append(time.perf_counter() - start)
        return result

    trainer._dynbsz.train_step = timed
    return timings


def worker(spec: dict) -> None:
    """One 2-process run (this function runs on every process under accelerate launch)."""
    from hf_dynbsz.testing import ModelShape, quiet_worker, scripted_run

    quiet_worker(threads=1)
    trainer = scripted_run(
        "grpo_dynamic",
        spec["output_dir"],
        ModelShape(128, 3, vocab_size=4096),
        completion_lengths=completion_lengths(spec["lengths"]),
        prompt_length=lambda rng: PROMPT,
        max_completion_length=LONG + 1,
        max_positions=1024,
        prompts=8 * spec["steps"] + 8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_steps=spec["steps"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        seed=0,
        balance_across_ranks=spec["balance"],
        activation_checkpointing=False,
    )
    timings = timed_train_steps(trainer)
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry]
    if trainer.accelerator.is_main_process:
        with open(spec["result"], "w") as handle:
            json.dump(
                {
                    "train_s": timings,
                    "moved": [e.get("dynbsz/samples_moved", 0.0) for e in history],
                    "imbalance_before": [e.get("dynbsz/rank_imbalance_before") for e in history],
                    "imbalance_after": [e.get("dynbsz/rank_imbalance_after") for e in history],
                    "passes": [e["dynbsz/microbatches_max_over_ranks"] for e in history],
                },
                handle,
            )
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # destroy the process group: gloo threads left at exit can abort a process after training


def run_config(name: str, steps: int, timeout: float) -> dict:
    lengths, balance = CONFIGS[name]
    with tempfile.TemporaryDirectory(prefix="dynbsz-balance-") as tmp:
        spec = {
            "lengths": lengths,
            "balance": balance,
            "steps": steps,
            "output_dir": os.path.join(tmp, "out"),
            "result": os.path.join(tmp, "result.json"),
        }
        command = accelerate_command("cpu_ddp.yaml", Path(__file__).resolve(), "--worker", json.dumps(spec))
        run_with_timeout(command, Path(tmp), timeout, f"balance benchmark run {name}")
        with open(spec["result"]) as handle:
            return json.load(handle)


def real_runs(repeats: int, steps: int, timeout: float) -> list[dict]:
    runs = {name: [] for name in CONFIGS}
    for repeat in range(repeats):
        order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            result = run_config(name, steps, timeout)
            runs[name].append(result)
            print(
                f"repeat {repeat} {name:26s} train s/step {statistics.median(result['train_s'][1:]):.3f}  "
                f"load {load_average()}",
                flush=True,
            )
    rows = []
    for name, results in runs.items():
        rows.append(
            {
                "config": name,
                "train_s": statistics.median(statistics.median(r["train_s"][1:]) for r in results),
                "passes": statistics.median(p for r in results for p in r["passes"][1:]),
                "moved": statistics.median(m for r in results for m in r["moved"][1:]),
                "imbalance_before": statistics.median(v for r in results for v in r["imbalance_before"][1:] if v),
                "imbalance_after": statistics.median(v for r in results for v in r["imbalance_after"][1:] if v),
            }
            if results[0]["imbalance_before"][0] is not None
            else {
                "config": name,
                "train_s": statistics.median(statistics.median(r["train_s"][1:]) for r in results),
                "passes": statistics.median(p for r in results for p in r["passes"][1:]),
                "moved": 0.0,
                "imbalance_before": None,
                "imbalance_after": None,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------- part 2
class Gathered:
    """The collectives of process 0 when every process's all-gather values are known: one process's planning, the
    collective itself aside."""

    rank = 0

    def __init__(self, gathered: list[list[int]]) -> None:
        self.gathered, self.num_processes = gathered, len(gathered)

    def all_gather(self, values: list[int]) -> list[list[int]]:
        assert values == self.gathered[self.rank]
        return self.gathered

    def all_reduce_max(self, values: list[int]) -> list[int]:
        raise AssertionError("a balanced step runs no all-reduce")


def planning_seconds(scheduler, per_process, budget: int, prompts, expected) -> float:
    """Seconds process 0 spends in ``Scheduler.plan`` for a balanced step (its schedule checked against the
    simulated one, ``expected``)."""
    import dataclasses

    from hf_dynbsz.planning.schedule import StepRequest

    gathered = [
        StepRequest(own, [n - p for n, p in zip(lengths, own)], None, budget).values()
        for lengths, own in zip(per_process, prompts)
    ]
    planner = dataclasses.replace(scheduler, group=Gathered(gathered))
    start = time.perf_counter()
    schedule = planner.plan(per_process[0], budget, prompt_lengths=prompts[0])
    seconds = time.perf_counter() - start
    assert schedule == expected, "process 0 planned otherwise than simulated"
    return seconds


def simulate(process_counts: list[int], steps: int, samples: int = 16, budget: int = 16384) -> list[dict]:
    import numpy as np

    from hf_dynbsz.planning.cost import WorkloadModel
    from hf_dynbsz.planning.schedule import Scheduler, simulate_processes
    from hf_dynbsz.testing import sequence_lengths

    workload = WorkloadModel.default("padding_free", "varlen")
    rows = []
    for processes in process_counts:
        ratios = {True: [], False: []}
        planning = []
        for step in range(steps):
            lengths = sequence_lengths("long_tailed", processes * samples, 4096, seed=1000 * processes + step)
            per_process = [lengths[p * samples : (p + 1) * samples].tolist() for p in range(processes)]
            prompts = [[32] * samples for _ in range(processes)]
            for balance in (True, False):
                scheduler = Scheduler(
                    layout="padding_free", attention="varlen", workload=workload, balance_across_ranks=balance
                )
                schedules = simulate_processes(scheduler, per_process, [budget] * processes, prompts)
                if balance:
                    planning.append(planning_seconds(scheduler, per_process, budget, prompts, schedules[0]))
                times = [
                    sum(workload.cost([s.lengths[i] for i in group]) for group in s.microbatches if group)
                    for s in schedules
                ]
                ratios[balance].append(max(times) / (sum(times) / processes))
        rows.append(
            {
                "processes": processes,
                "without": float(np.mean(ratios[False])),
                "without_worst": float(np.max(ratios[False])),
                "with": float(np.mean(ratios[True])),
                "with_worst": float(np.max(ratios[True])),
                "planning_ms": 1000 * float(np.median(planning)),
            }
        )
        print(
            f"P={processes:4d} predicted step / perfect: {rows[-1]['without']:.3f} without, "
            f"{rows[-1]['with']:.3f} with balancing",
            flush=True,
        )
    return rows


# --------------------------------------------------------------------------------------------------- report
def render(real: list[dict], simulated: list[dict], seconds: float) -> str:
    by_name = {row["config"]: row for row in real}
    lines = [
        "# Cross-rank balancing",
        "",
        f"Generated by `python benchmarks/balance.py` in {seconds / 60:.1f} min. Machine: {machine_description()}.",
        "",
        "## Two real processes (DDP on CPU): lopsided against even work",
        "",
    ]
    body = []
    for row in real:
        even = by_name["even, balancing on" if "on" in row["config"] else "even, balancing off"]
        body.append(
            [
                row["config"],
                f"{row['train_s']:.3f}",
                f"{row['train_s'] / even['train_s']:.2f}",
                f"{row['passes']:.0f}",
                f"{row['moved']:.0f}",
                "-" if row["imbalance_before"] is None else f"{row['imbalance_before']:.2f}",
                "-" if row["imbalance_after"] is None else f"{row['imbalance_after']:.2f}",
            ]
        )
    lines.append(
        markdown_table(
            [
                "work",
                "train s/step",
                "vs even (same setting)",
                "passes/step",
                "samples moved",
                "rank imbalance before",
                "after",
            ],
            body,
        )
    )
    lopsided = by_name["lopsided, balancing on"]["train_s"] / by_name["even, balancing on"]["train_s"]
    off = by_name["lopsided, balancing off"]["train_s"] / by_name["even, balancing off"]["train_s"]
    lines += [
        "",
        f"Lopsided / even: **{lopsided:.2f}** with balancing on (goal <= 1.10: "
        f"{'met' if lopsided <= 1.10 else 'missed'}), {off:.2f} with it off.",
        "",
        "## Simulation: predicted step time over perfect balance",
        "",
    ]
    body = [
        [
            row["processes"],
            f"{row['without']:.3f} ({row['without_worst']:.3f})",
            f"{row['with']:.3f} ({row['with_worst']:.3f})",
            f"{row['planning_ms']:.1f}",
        ]
        for row in simulated
    ]
    lines.append(
        markdown_table(
            [
                "processes",
                "without balancing: mean (worst step)",
                "with balancing: mean (worst step)",
                "planning ms per process per step",
            ],
            body,
        )
    )
    largest = simulated[-1]
    lines += [
        "",
        f"At {largest['processes']} processes balancing is within {100 * (largest['with'] - 1):.1f}% of "
        f"perfect on average (goal 5%: {'met' if largest['with'] <= 1.05 else 'missed'}).",
        "",
    ]
    return "\n".join(lines)


def plot(real: list[dict], simulated: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [row["config"] for row in real]
    left.bar(
        range(len(names)),
        [row["train_s"] for row in real],
        color=["#1f77b4", "#d62728", "#2ca02c", "#7f7f7f"][: len(names)],
    )
    left.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    left.set_title("2 processes: training phase, s / optimizer step", fontsize=10)
    counts = [row["processes"] for row in simulated]
    right.plot(counts, [row["without"] for row in simulated], "o-", label="without balancing", color="#d62728")
    right.plot(counts, [row["with"] for row in simulated], "o-", label="with balancing", color="#1f77b4")
    right.axhline(1.0, color="#7f7f7f", linestyle=":")
    right.set_xscale("log", base=2)
    right.set_xticks(counts, [str(c) for c in counts])
    right.set_xlabel("processes")
    right.set_title("simulated step time / perfect balance (long-tailed)", fontsize=10)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, fewer steps, 8 and 32 processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per real run (the first is warm-up)")
    parser.add_argument("--simulated-steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        worker(json.loads(cli.worker))
        return
    start = time.perf_counter()
    repeats, steps, counts, simulated_steps = cli.repeats, cli.steps, [8, 32, 128], cli.simulated_steps
    if cli.quick:
        repeats, steps, counts, simulated_steps = 1, 3, [8, 32], 3
    real = real_runs(repeats, steps, cli.timeout)
    simulated = simulate(counts, simulated_steps)
    out = Path(cli.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "balance.md").write_text(render(real, simulated, time.perf_counter() - start))
    (out / "balance.json").write_text(json.dumps({"real": real, "simulated": simulated}, indent=1))
    plot(real, simulated, out / "balance.png")
    print(f"wrote {out / 'balance.md'}, balance.png, balance.json")


if __name__ == "__main__":
    main()
