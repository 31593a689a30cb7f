"""Host-side time: the plugin's Python work per optimizer step against stock ``trl.GRPOTrainer``'s, on a model of
almost no compute, where a step is TRL's and the plugin's Python work (as on a fast GPU).

A random Qwen2-style model of hidden size 16 and one layer (a 37-token character vocabulary), completions of at most
24 tokens from a scripted rollout (the long-tailed mix of ``benchmarks/common.py``: the same samples for both
trainers), 8 x 4 samples a step, fp32 on the CPU, one thread. Stock and the plugin (default settings) train
``--steps`` optimizer steps each, ``--repeats`` times, interleaved in one process; a step's wall time comes from a
callback around it, the steady step is the median after the first ``WARM_UP`` steps. The plugin's own parts are timed
by wrapping its executor's methods: the planner (budget and schedule), the packing (building each pass's inputs),
the exchange (the step's samples handed to the passes: cross-rank balancing's moves, none on one process) and the
metrics (each pass's sums and the step's publication). Goal: the plugin's steady step within 1.1x stock's.

Usage::

    python benchmarks/host_time.py                 # writes benchmarks/results/host_time.md and .json
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
        (executor.PassExecutor, "_budget", "planner"),
        (executor.PassExecutor, "_plan", "planner"),
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
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.begin)
            if timer is not None:
                timer.end_step()

    return StepClock()


def train(trainer_name: str, steps: int, workdir: str) -> tuple[list[float], list[dict]]:
    """Step seconds (and, for the plugin, the parts of each step) of one run."""
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
        os.path.join(workdir, trainer_name), per_device_train_batch_size=8, gradient_accumulation_steps=4,
        max_completion_length=MAX_COMPLETION, max_steps=steps, learning_rate=1e-3,
    )  # fmt: skip
    ours = trainer_name == "ours"
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
    return clock.seconds, (timer.steps if timer else [])


def summarise(runs: dict[str, list[tuple[list[float], list[dict]]]]) -> dict:
    """Steady-step medians per repeat, their medians, the ratio, and the plugin's parts in ms per steady step."""
    steady = {name: [statistics.median(seconds[WARM_UP:]) for seconds, _ in results] for name, results in runs.items()}
    parts = {
        part: statistics.mean(step.get(part, 0.0) for _, steps in runs["ours"] for step in steps[WARM_UP:]) * 1e3
        for part in PARTS
    }
    stock, ours = statistics.median(steady["stock"]), statistics.median(steady["ours"])
    return {"steady_s": steady, "stock_s": stock, "ours_s": ours, "ratio": ours / stock, "parts_ms": parts}


def render(summary: dict, args, elapsed: float) -> str:
    ratio = summary["ratio"]
    parts = summary["parts_ms"]
    rows = [
        "| trainer | steady step (median of repeats) | per repeat | vs stock |",
        "|---|---:|---|---:|",
        f"| stock GRPOTrainer | {summary['stock_s'] * 1e3:.1f} ms | "
        f"{', '.join(f'{s * 1e3:.1f}' for s in summary['steady_s']['stock'])} ms | 1.00x |",
        f"| dynamic (default settings) | {summary['ours_s'] * 1e3:.1f} ms | "
        f"{', '.join(f'{s * 1e3:.1f}' for s in summary['steady_s']['ours'])} ms | {ratio:.2f}x |",
    ]
    part_rows = ["| plugin part | ms per steady step |", "|---|---:|"]
    part_rows += [f"| {part} | {parts[part]:.2f} |" for part in PARTS]
    part_rows.append(f"| the four together | {sum(parts.values()):.2f} |")
    verdict = "within" if ratio <= GOAL else "OVER"
    return "\n".join(
        [
            "# Host-side time: the plugin's Python work against stock's",
            "",
            f"Command: `python benchmarks/host_time.py {' '.join(sys.argv[1:])}`; {elapsed:.0f} s. "
            f"{machine_description()}.",
            "",
            f"A Qwen2-style model of hidden 16 and one layer, completions of at most {MAX_COMPLETION} tokens "
            f"({MIX} mix), 8 x 4 samples a step, fp32, one thread; {args.steps} steps a run, {args.repeats} runs "
            f"each, interleaved; steady step: the median after the first {WARM_UP}.",
            "",
            *rows,
            "",
            f"The plugin's steady step is **{ratio:.2f}x** stock's: {verdict} the goal of {GOAL}x.",
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
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    started = time.monotonic()
    runs: dict[str, list] = {"stock": [], "ours": []}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for name in ("stock", "ours"):
                runs[name].append(train(name, args.steps, workdir))
                print(f"[host_time] repeat {repeat} {name}: steps {[round(s, 4) for s in runs[name][-1][0]]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    summary = summarise(runs)
    text = render(summary, args, time.monotonic() - started)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "host_time.md").write_text(text)
    (args.out_dir / "host_time.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
