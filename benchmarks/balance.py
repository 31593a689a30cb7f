"""Cross-rank balancing: lopsided against even work on 2 real processes, and a simulation at 8, 32 and 128 ranks.

Part 1, real runs (``accelerate launch``, 2 CPU processes, DDP over gloo, one torch thread each): the dynamic
trainer trains a Qwen2-style model (hidden 128, 3 layers, vocabulary 4096, fp32, sdpa) on scripted completions
(TRL's ``rollout_func``, :class:`hf_dynbsz.testing.PrefixRollout`). Every prompt begins with the same 16-token block (a
system prompt, as a chat template gives), then 32 tokens of its own; 4 completions per prompt, 8 samples per process
and optimizer step (2 prompts). Every optimizer step has the same work in total: half of all completions 416 tokens
long, half 32. *lopsided*: process 1 holds every long completion; *even*: each prompt has 2 long and 2 short ones.
With a prefix tree (``share_prompt_prefix="tree"``, the default) the block makes each process's samples one subtree.
Under a budget of :data:`ONE_PASS` tokens (``max_tokens_per_microbatch``: a process's step in one pass, as a budget
set for a large device gives) that subtree is one unit, which moving whole units cannot split; under the automatic
budget (stock's micro-batch, 4 x 465 tokens) the long process's subtree is cut into one piece per prompt, the short
one's stays whole. With ``"groups"`` each prompt's samples are a unit. Configurations (:data:`CONFIGS`): lopsided and
even, under the tree and prompt groups with balancing on and the one-pass budget, under the tree with balancing off,
and under the tree with the automatic budget. Measured: wall time of the trainer's training phase per optimizer step
(``DynamicBatchGRPOTrainer._train_step`` on process 0: the exchange of samples, every pass, and the wait for the other
process at the gradient synchronisation; no generation), and the busier process's CPU time in it (robust to the
other jobs of a shared machine: a process waiting at the synchronisation spends none); median over the measured steps
(the first is warm-up), then the median over repeats; runs interleave the configurations. Goal: lopsided / even <=
1.05 under the tree with balancing on. Exactness: stock ``GRPOTrainer`` trains the lopsided work once; the final
parameters of the first lopsided tree run with balancing on (one-pass budget), and their update, against stock's.

Part 2, simulation: each step, every one of ``P`` processes holds 16 samples of the long-tailed mix of
``benchmarks/common.py`` (max completion 4096 tokens, prompts 32-96). The processes' schedules are computed by
:func:`hf_dynbsz.planning.schedule.simulate_processes` (the trainer's own scheduling code, each collective computed
over the processes' values) for a 7B-class decoder (the partitioner's default workload model) with padding-free rows
on a varlen kernel and a budget of 16,384 tokens per pass. A process's predicted time is the sum of its passes'
costs; a step's predicted time is that of the slowest process (every process waits for it at the gradient
synchronisation); *perfect* is the total cost over ``P``. Goal: within 5% of perfect at 128 processes. The
planning time a process spends per balanced step (all-gather aside) is measured too, in CPU time: ``Scheduler.plan``
on process 0, its all-gather answered with every process's values, checked equal to the simulated schedule.

Usage (from the repository root)::

    python benchmarks/balance.py            # both parts, about 25 minutes on 2 cores (longer when shared)
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

LONG, SHORT, PROMPT, BLOCK = 416, 32, 32, 16
#: A budget that holds a process's whole step (8 samples: at most 16 + 2 x (32 + 4 x 417) tokens) in one pass.
ONE_PASS = 4096
CONFIGS = {  # name: (lengths, share_prompt_prefix, balance_across_ranks, max_tokens_per_microbatch)
    "lopsided, tree, balancing on": ("lopsided", "tree", True, ONE_PASS),
    "even, tree, balancing on": ("even", "tree", True, ONE_PASS),
    "lopsided, groups, balancing on": ("lopsided", "groups", True, ONE_PASS),
    "even, groups, balancing on": ("even", "groups", True, ONE_PASS),
    "lopsided, tree, balancing off": ("lopsided", "tree", False, ONE_PASS),
    "even, tree, balancing off": ("even", "tree", False, ONE_PASS),
    "lopsided, tree, balancing on, automatic budget": ("lopsided", "tree", True, None),
    "even, tree, balancing on, automatic budget": ("even", "tree", True, None),
}
#: The run whose parameters are compared with stock's on the same (lopsided) work.
CHECKED = "lopsided, tree, balancing on"
GOAL = 1.05
PARAM_TOLERANCE, UPDATE_TOLERANCE = 1e-5, 1e-3


# --------------------------------------------------------------------------------------------------- part 1
def completion_lengths(lengths: str):
    """The scripted completion lengths (tokens) of ``lengths``: "lopsided" gives every long one to process 1,
    "even" alternates long and short on every process (2 of each per prompt)."""
    import numpy as np

    def draw(rng, n, rank):
        if lengths == "lopsided":
            return np.full(n, LONG if rank == 1 else SHORT)
        return np.array([LONG if i % 2 == 0 else SHORT for i in range(n)])

    return draw


def timed_train_steps(trainer) -> tuple[list[float], list[float]]:
    """The wall time and this process's CPU time of each of the plugin's training steps (seconds), filled as the
    trainer trains."""
    wall, cpu = [], []
    train_step = trainer._dynbsz.train_step

    def timed(model_, window):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = train_step(model_, window)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        return result

    trainer._dynbsz.train_step = timed
    return wall, cpu


def content_reward(completions, **kwargs) -> list[float]:
    """A reward from the completion's characters (their codes summed, mod 7, over 7): the completions of a prompt
    differ in it even where their lengths are equal (the lopsided work's are), so every step learns something and the
    comparison with stock's parameters compares updates."""
    return [sum(map(ord, completion)) % 7 / 7 for completion in completions]


def worker(spec: dict) -> None:
    """One 2-process run (this function runs on every process under accelerate launch)."""
    import torch

    from hf_dynbsz.testing import ModelShape, quiet_worker, scripted_run

    quiet_worker(threads=1)
    stock = spec["sharing"] is None
    plugin = {}
    if not stock:
        plugin = dict(balance_across_ranks=spec["balance"], share_prompt_prefix=spec["sharing"])
        plugin.update(max_tokens_per_microbatch=spec["budget"])
    trainer = scripted_run(
        "grpo_stock" if stock else "grpo_dynamic",
        spec["output_dir"],
        ModelShape(128, 3, vocab_size=4096),
        completion_lengths=completion_lengths(spec["lengths"]),
        prompt_length=lambda rng: PROMPT,
        shared=BLOCK,
        reward=content_reward,
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
        activation_checkpointing=False,
        **plugin,
    )
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    timings, cpu = ([], []) if stock else timed_train_steps(trainer)
    trainer.train()
    with open(f"{spec['result']}.rank{trainer.accelerator.process_index}", "w") as handle:
        json.dump(cpu, handle)
    history = [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry]
    if trainer.accelerator.is_main_process:
        if spec.get("params_out"):
            model = trainer.accelerator.unwrap_model(trainer.model)
            final = {name: p.detach().clone() for name, p in model.named_parameters()}
            torch.save({"initial": initial, "final": final}, spec["params_out"])
        with open(spec["result"], "w") as handle:
            json.dump(
                {
                    "train_s": timings,
                    "moved": [e.get("dynbsz/samples_moved", 0.0) for e in history],
                    "split": [e.get("dynbsz/units_split", 0.0) for e in history],
                    "imbalance_before": [e.get("dynbsz/rank_imbalance_before") for e in history],
                    "imbalance_after": [e.get("dynbsz/rank_imbalance_after") for e in history],
                    "passes": [e["dynbsz/microbatches_max_over_ranks"] for e in history],
                },
                handle,
            )
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # destroy the process group: gloo threads left at exit can abort a process after training


def run_config(name: str, steps: int, timeout: float, params_out: str | None = None) -> dict:
    """One 2-process run of configuration ``name`` (or "stock": stock GRPOTrainer on the lopsided work)."""
    lengths, sharing, balance, budget = CONFIGS.get(name, ("lopsided", None, False, None))
    with tempfile.TemporaryDirectory(prefix="dynbsz-balance-") as tmp:
        spec = {
            "lengths": lengths,
            "sharing": sharing,
            "balance": balance,
            "budget": budget,
            "steps": steps,
            "output_dir": os.path.join(tmp, "out"),
            "result": os.path.join(tmp, "result.json"),
            "params_out": params_out,
        }
        command = accelerate_command("cpu_ddp.yaml", Path(__file__).resolve(), "--worker", json.dumps(spec))
        run_with_timeout(command, Path(tmp), timeout, f"balance benchmark run {name}")
        with open(spec["result"]) as handle:
            result = json.load(handle)
        cpu = []
        for rank in range(2):
            with open(f"{spec['result']}.rank{rank}") as handle:
                cpu.append(json.load(handle))
        result["train_cpu"] = [max(step) for step in zip(*cpu)]  # per step, the busier process's CPU time
        return result


def exactness(steps: int, timeout: float) -> dict:
    """The parameters of a run of :data:`CHECKED` and of stock's on the same work: their relative differences."""
    import torch

    from hf_dynbsz.testing import relative_difference, update_difference

    with tempfile.TemporaryDirectory(prefix="dynbsz-balance-params-") as tmp:
        ours, stock = os.path.join(tmp, "ours.pt"), os.path.join(tmp, "stock.pt")
        result = run_config(CHECKED, steps, timeout, params_out=ours)
        run_config("stock", steps, timeout, params_out=stock)
        ours, stock = torch.load(ours), torch.load(stock)
    return {
        "param_difference": relative_difference(ours["final"], stock["final"]),
        "update_difference": update_difference(stock["initial"], ours["final"], stock["final"]),
        "split": result["split"],
    }


def real_runs(repeats: int, steps: int, timeout: float, only: list[str]) -> list[dict]:
    runs = {name: [] for name in only}
    for repeat in range(repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            result = run_config(name, steps, timeout)
            result["load"] = float(load_average().split()[0])  # 1-minute load average after the run
            runs[name].append(result)
            print(
                f"repeat {repeat} {name:32s} train s/step {statistics.median(result['train_s'][1:]):.3f}  "
                f"load {load_average()}",
                flush=True,
            )
    rows = []
    for name, results in runs.items():
        balanced = results[0]["imbalance_before"][0] is not None
        rows.append(
            {
                "config": name,
                "train_s": statistics.median(statistics.median(r["train_s"][1:]) for r in results),
                "train_s_repeats": [statistics.median(r["train_s"][1:]) for r in results],
                "train_cpu": statistics.median(statistics.median(r["train_cpu"][1:]) for r in results),
                "train_cpu_repeats": [statistics.median(r["train_cpu"][1:]) for r in results],
                "passes": statistics.median(p for r in results for p in r["passes"][1:]),
                "load": [r["load"] for r in results],
                "moved": statistics.median(m for r in results for m in r["moved"][1:]) if balanced else 0.0,
                "split": statistics.median(m for r in results for m in r["split"][1:]) if balanced else 0.0,
                "imbalance_before": (
                    statistics.median(v for r in results for v in r["imbalance_before"][1:] if v) if balanced else None
                ),
                "imbalance_after": (
                    statistics.median(v for r in results for v in r["imbalance_after"][1:] if v) if balanced else None
                ),
            }
        )
    return rows


def even_of(name: str) -> str:
    """The even run of the same setting as run ``name``."""
    return name.replace("lopsided", "even")


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
    """CPU seconds process 0 spends in ``Scheduler.plan`` for a balanced step (its schedule checked against the
    simulated one, ``expected``)."""
    import dataclasses

    from hf_dynbsz.planning.prefix_tree import PrefixTree
    from hf_dynbsz.planning.schedule import StepRequest

    gathered = [  # the samples share nothing (no shared prompts): each process's tree is its samples alone
        StepRequest(own, [n - p for n, p in zip(lengths, own)], PrefixTree.alone(lengths), budget).values()
        for lengths, own in zip(per_process, prompts)
    ]
    planner = dataclasses.replace(scheduler, group=Gathered(gathered))
    start = time.process_time()  # its CPU time: what it costs, whatever else runs on the machine
    schedule = planner.plan(per_process[0], budget, prompt_lengths=prompts[0])
    seconds = time.process_time() - start
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
def render(real: list[dict], simulated: list[dict], seconds: float, exact: dict | None = None) -> str:
    lines = [
        "# Cross-rank balancing",
        "",
        f"Generated by `python benchmarks/balance.py {' '.join(sys.argv[1:])}` in {seconds / 60:.1f} min. Machine: "
        f"{machine_description()}.",
        "",
        "## Two real processes (DDP on CPU): lopsided against even work",
        "",
        *render_real(real, exact),
    ]
    return "\n".join([*lines, *render_simulated(simulated), ""])


def render_real(real: list[dict], exact: dict | None) -> list[str]:
    """Part 1's table, its ratios and the comparison with stock."""
    by_name, lines = {row["config"]: row for row in real}, []
    body = []
    for row in real:
        even = by_name.get(even_of(row["config"]))
        body.append(
            [
                row["config"],
                f"{row['train_s']:.3f}",
                ", ".join(f"{value:.3f}" for value in row["train_s_repeats"]),
                "-" if even is None else f"{row['train_s'] / even['train_s']:.2f}",
                "-" if even is None else ", ".join(
                    f"{a / b:.2f}" for a, b in zip(row["train_s_repeats"], even["train_s_repeats"])),
                f"{row['train_cpu']:.3f}",
                "-" if even is None else f"{row['train_cpu'] / even['train_cpu']:.2f}",
                "-" if even is None else ", ".join(
                    f"{a / b:.2f}" for a, b in zip(row["train_cpu_repeats"], even["train_cpu_repeats"])),
                f"{row['passes']:.0f}",
                f"{row['moved']:.0f}",
                f"{row['split']:.0f}",
                "-" if row["imbalance_before"] is None else f"{row['imbalance_before']:.2f}",
                "-" if row["imbalance_after"] is None else f"{row['imbalance_after']:.2f}",
            ]
        )  # fmt: skip
    lines.append(
        markdown_table(
            [
                "work",
                "train s/step",
                "per repeat",
                "vs even (same setting)",
                "per repeat",
                "busier process CPU s/step",
                "vs even",
                "per repeat",
                "passes/step",
                "samples moved",
                "units cut",
                "rank imbalance before",
                "after",
            ],
            body,
        )  # fmt: skip
    )
    loads = [load for row in real for load in row.get("load", [])]
    if loads:
        lines += ["", f"1-minute load average after each run: {min(loads):.1f} to {max(loads):.1f} (2 cores, shared)."]
    lines.append("")
    for name in [row["config"] for row in real if row["config"].startswith("lopsided")]:
        if even_of(name) in by_name:
            ratio = by_name[name]["train_s"] / by_name[even_of(name)]["train_s"]
            cpu = by_name[name]["train_cpu"] / by_name[even_of(name)]["train_cpu"]
            goal = name.startswith("lopsided, tree, balancing on")
            verdict = f" (goal <= {GOAL:.2f}: {'met' if max(ratio, cpu) <= GOAL else 'missed'})" if goal else ""
            lines.append(
                f"Lopsided / even, {name.removeprefix('lopsided, ')}: **{ratio:.2f}** wall, **{cpu:.2f}** the busier "
                f"process's CPU time{verdict}."
            )
    if exact is not None:
        met = exact["param_difference"] <= PARAM_TOLERANCE and exact["update_difference"] <= UPDATE_TOLERANCE
        lines += [
            "",
            f"Exactness ({CHECKED}, units cut per step {exact['split']}): parameters {exact['param_difference']:.1e} "
            f"and their update {exact['update_difference']:.1e} from stock's on the same work (tolerances "
            f"{PARAM_TOLERANCE:g} / {UPDATE_TOLERANCE:g}: {'met' if met else 'missed'}).",
        ]
    return lines


def render_simulated(simulated: list[dict]) -> list[str]:
    """Part 2's table and verdict (nothing when it did not run)."""
    if not simulated:
        return []
    lines = [
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
                "planning CPU ms per process per step",
            ],
            body,
        )
    )
    largest = simulated[-1]
    lines += [
        "",
        f"At {largest['processes']} processes balancing is within {100 * (largest['with'] - 1):.1f}% of "
        f"perfect on average (goal 5%: {'met' if largest['with'] <= 1.05 else 'missed'}).",
    ]
    return lines


def plot(real: list[dict], simulated: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [row["config"] for row in real]
    left.bar(
        range(len(names)),
        [row["train_s"] for row in real],
        color=["#1f77b4" if "lopsided" in name else "#7f7f7f" for name in names],
    )
    left.set_xticks(range(len(names)), names, rotation=20, fontsize=7, ha="right")
    left.set_title("2 processes: training phase, s / optimizer step", fontsize=10)
    if not simulated:
        right.set_visible(False)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return
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
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="real runs to time")
    parser.add_argument("--no-exactness", action="store_true", help="skip the parameter comparison with stock")
    parser.add_argument("--no-simulation", action="store_true", help="skip part 2")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        worker(json.loads(cli.worker))
        return
    start = time.perf_counter()
    repeats, steps, counts, simulated_steps = cli.repeats, cli.steps, [8, 32, 128], cli.simulated_steps
    if cli.quick:
        repeats, steps, counts, simulated_steps = 1, 3, [8, 32], 3
    out = Path(cli.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    real = real_runs(repeats, steps, cli.timeout, cli.only)
    exact = None if cli.no_exactness else exactness(steps, cli.timeout)
    # kept if part 2 fails
    (out / "balance.json").write_text(json.dumps({"real": real, "exactness": exact}, indent=1))
    simulated = [] if cli.no_simulation else simulate(counts, simulated_steps)
    (out / "balance.md").write_text(render(real, simulated, time.perf_counter() - start, exact))
    (out / "balance.json").write_text(json.dumps({"real": real, "exactness": exact, "simulated": simulated}, indent=1))
    plot(real, simulated, out / "balance.png")
    print(f"wrote {out / 'balance.md'}, balance.png, balance.json")


if __name__ == "__main__":
    main()
