"""Host-side time: the plugin's Python work per optimizer step against stock ``trl.GRPOTrainer``'s, on a model of
almost no compute, where a step is TRL's and the plugin's Python work (as on a fast GPU).

A random Qwen2-style model of hidden size 16 and one layer (a 37-token character vocabulary), completions of at most
24 tokens from a scripted rollout (the long-tailed mix of ``benchmarks/common.py``: the same samples for every
trainer), 8 x 4 samples a step (``--gradient-accumulation-steps 1``: 8 x 1, one stock slice a step, so that stock and
the plugin run one pass each and the step is overhead against overhead), fp32 on the CPU, one thread. Stock and the
plugin under each sharing rule (``share_prompt_prefix`` "tree", the default, and "groups") train ``--steps`` optimizer
steps each, ``--repeats`` times, interleaved in one process; a step's wall time comes from a callback around it, the
steady step is the median after the first ``WARM_UP`` steps. The plugin's own parts are timed by wrapping its
executor's methods: the planner (budget and schedule), the packing (building each pass's inputs), the exchange (the
step's samples handed to the passes: cross-rank balancing's moves, none on one process) and the metrics (each pass's
sums and the step's publication). Goal: the plugin's steady step within 1.1x stock's under every rule.

Usage::

    python benchmarks/host_time.py                 # writes benchmarks/results/host_time.md and .json
    python benchmarks/host_time.py --gradient-accumulation-steps 1 --name host_time_one_pass
    python benchmarks/host_time.py --quick --out-dir /tmp/host_time
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine_description  # noqa: E402

from hf_dynbsz.testing import completion_lengths, prompt_lengths  # noqa: E402

MIX = "long_tailed"
MAX_COMPLETION = 24
WARM_UP = 3  # steps left out of the steady median (the first step holds the self-check)
GOAL = 1.1
PARTS = ("planner", "packing", "exchange", "metrics")
#: The trainers a run compares: stock, then the plugin under each sharing rule (its ``share_prompt_prefix``).
TRAINERS = {"stock": None, "tree": "tree", "groups": "groups"}


class PartTimer:
    """Seconds per part of the plugin's work, per optimizer step (wrapping its executor's methods)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def end_step(self) -> None:
        self.steps.append(dict(self.seconds))
        self.seconds.clear()


@contextlib.contextmanager
def timed_parts(timer: PartTimer):
    """The plugin's methods wrapped by ``timer`` inside the context (restored after)."""
    from hf_dynbsz.execution import executor, metrics

    saved = []
    targets = [
        (executor.PassExecutor, "_planned", "planner"),  # the budget and the plan (StepPlanning)
        (executor.PassExecutor, "microbatch", "packing"),
        (executor.PassExecutor, "_start_training", "exchange"),
        (executor.PassExecutor, "_start_no_grad", "exchange"),
        (metrics.StepMetrics, "add_pass", "metrics"),
        (metrics.StepMetrics, "publish", "metrics"),
    ]
    for owner, name, part in targets:
        saved.append((owner, name, getattr(owner, name)))
        timer.wrap(owner, name, part)
    try:
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)


def step_clock(timer: PartTimer | None):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Each step's wall time and this process's CPU time in it (``seconds``, ``cpu``): on a shared machine the
        CPU time of a one-thread step is its work, whatever else runs."""

        def __init__(self):
            self.seconds: list[float] = []
            self.cpu: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin, self.begin_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.begin)
            self.cpu.append(time.process_time() - self.begin_cpu)
            if timer is not None:
                timer.end_step()

    return StepClock()


def train(trainer_name: str, steps: int, workdir: str, accumulation: int = 4) -> dict:
    """One run of ``trainer_name`` (:data:`TRAINERS`): its steps' wall and CPU seconds and, for the plugin, the parts
    of each step."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import (
        RecordingReward,
        ScriptedRollout,
        base_config_kwargs,
        build_char_tokenizer,
        build_tiny_causal_lm,
    )

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        tokenizer, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, seed=0,
    )  # fmt: skip
    rollout = ScriptedRollout(
        lambda rng, n, rank: completion_lengths(MIX, n, MAX_COMPLETION, rng),
        lambda rng: prompt_lengths(MIX, 1, rng)[0],
        max_completion_length=MAX_COMPLETION, seed=0, token_low=3, token_high=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
    )  # fmt: skip
    kwargs = base_config_kwargs(
        os.path.join(workdir, trainer_name), per_device_train_batch_size=8, gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_COMPLETION, max_steps=steps, learning_rate=1e-3,
    )  # fmt: skip
    ours = TRAINERS[trainer_name] is not None
    if ours:
        kwargs["share_prompt_prefix"] = TRAINERS[trainer_name]
    args = DynamicBatchGRPOConfig(**kwargs) if ours else GRPOConfig(**kwargs)
    timer = PartTimer() if ours else None
    trainer = (DynamicBatchGRPOTrainer if ours else GRPOTrainer)(
        model=model, reward_funcs=RecordingReward(), args=args, processing_class=tokenizer, rollout_func=rollout,
        train_dataset=Dataset.from_dict({"prompt": [f"prompt-{i:05d}" for i in range(512)]}),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    clock = step_clock(timer)
    trainer.add_callback(clock)
    with timed_parts(timer) if ours else contextlib.nullcontext():
        trainer.train()
    return {"wall": clock.seconds, "cpu": clock.cpu, "parts": timer.steps if timer else []}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per clock (wall, CPU): steady-step medians per repeat, their medians, each plugin rule's ratio to stock (of the
    medians, and per repeat: each plugin run against the stock run of its repeat); the plugin's parts in ms per
    steady step."""
    plugin = [name for name in runs if TRAINERS[name] is not None]
    summary = {"parts_ms": {
        name: {part: statistics.mean(step.get(part, 0.0) for run in runs[name] for step in run["parts"][WARM_UP:]) * 1e3
               for part in PARTS}
        for name in plugin
    }}  # fmt: skip
    for clock in ("wall", "cpu"):
        steady = {name: [statistics.median(run[clock][WARM_UP:]) for run in results] for name, results in runs.items()}
        median = {name: statistics.median(values) for name, values in steady.items()}
        summary[clock] = {
            "steady_s": steady,
            "median_s": median,
            "ratio": {name: median[name] / median["stock"] for name in plugin},
            "paired_ratios": {name: [a / b for a, b in zip(steady[name], steady["stock"])] for name in plugin},
        }
    return summary


def step_rows(figures: dict, clock: str) -> list[str]:
    """The table of one clock's steady steps: stock, then each rule."""
    steady, median, ratios = figures["steady_s"], figures["median_s"], figures["ratio"]
    rows = [
        f"| trainer | steady step, {clock} (median of repeats) | per repeat | vs stock | per repeat vs stock |",
        "|---|---:|---|---:|---|",
        f"| stock GRPOTrainer | {median['stock'] * 1e3:.1f} ms | "
        f"{', '.join(f'{s * 1e3:.1f}' for s in steady['stock'])} ms | 1.00x | |",
    ]
    return rows + [
        f"| dynamic, share_prompt_prefix={TRAINERS[name]!r} | {median[name] * 1e3:.1f} ms | "
        f"{', '.join(f'{s * 1e3:.1f}' for s in steady[name])} ms | {ratios[name]:.2f}x | "
        f"{', '.join(f'{r:.2f}' for r in figures['paired_ratios'][name])} |"
        for name in ratios
    ]


def render(summary: dict, args, elapsed: float) -> str:
    plugin, parts = list(summary["wall"]["ratio"]), summary["parts_ms"]
    part_rows = ["| plugin part (wall ms per steady step) | " + " | ".join(plugin) + " |",
                 "|---|" + "---:|" * len(plugin)]  # fmt: skip
    part_rows += [f"| {part} | " + " | ".join(f"{parts[name][part]:.2f}" for name in plugin) + " |" for part in PARTS]
    part_rows.append(
        "| the four together | " + " | ".join(f"{sum(parts[name].values()):.2f}" for name in plugin) + " |"
    )
    verdicts = "; ".join(
        f"with {TRAINERS[name]!r} **{summary['wall']['ratio'][name]:.2f}x** wall, "
        f"**{summary['cpu']['ratio'][name]:.2f}x** CPU "
        f"({'within' if max(summary[c]['ratio'][name] for c in ('wall', 'cpu')) <= GOAL else 'OVER'})"
        for name in plugin
    )
    return "\n".join(
        [
            "# Host-side time: the plugin's Python work against stock's",
            "",
            f"Command: `python benchmarks/host_time.py {' '.join(sys.argv[1:])}`; {elapsed:.0f} s. "
            f"{machine_description()}; 1-minute load average {args.load} over the runs (2 cores, shared with other "
            "jobs).",
            "",
            f"A Qwen2-style model of hidden 16 and one layer, completions of at most {MAX_COMPLETION} tokens "
            f"({MIX} mix), 8 x {args.gradient_accumulation_steps} samples a step, fp32, one thread; {args.steps} steps "
            f"a run, {args.repeats} runs each, interleaved; steady step: the median after the first {WARM_UP}. Wall "
            "time, and the process's CPU time in the step (its work, whatever else runs on the machine).",
            "",
            *step_rows(summary["wall"], "wall"),
            "",
            *step_rows(summary["cpu"], "CPU"),
            "",
            f"The plugin's steady step against stock's: {verdicts}; the goal is {GOAL}x.",
            "",
            *part_rows,
            "",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per trainer, interleaved")
    parser.add_argument("--quick", action="store_true", help="8 steps, 2 repeats")
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=4, help="stock slices of 8 samples per optimizer step"
    )
    parser.add_argument("--trainers", nargs="+", choices=list(TRAINERS)[1:], default=list(TRAINERS)[1:],
                        help="the plugin's sharing rules to run beside stock")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="host_time", help="the results' file name, without .md / .json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    started = time.monotonic()
    runs: dict[str, list] = {name: [] for name in ["stock", *args.trainers]}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for name in runs if repeat % 2 == 0 else reversed(runs):
                runs[name].append(train(name, args.steps, workdir, args.gradient_accumulation_steps))
                print(f"[host_time] repeat {repeat} {name}: steps {[round(s, 4) for s in runs[name][-1]['wall']]}",
                      file=sys.stderr, flush=True)  # fmt: skip
                loads.append(os.getloadavg()[0])
    args.load = f"{min(loads):.1f} to {max(loads):.1f}"
    summary = summarise(runs)
    summary["load"] = args.load
    text = render(summary, args, time.monotonic() - started)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.md").write_text(text)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
