"""Asynchronous GRPO: stock ``AsyncGRPOTrainer`` against ``DynamicBatchAsyncGRPOTrainer``, and where training sets the
pace, the asynchronous plugin against synchronous GRPO.

What it runs
------------
One small Qwen2-style model (random weights, fp32, sdpa, hidden 128, 3 layers, vocabulary 4096; ``--quick``: smaller)
on the long-tailed mix (prompts of 32-96 tokens, completions lognormal up to ``max_completion_length``), the same
samples for every trainer: a :class:`~hf_dynbsz.testing.RolloutScript` (groups of 4) feeds the asynchronous trainers
through the stand-in rollout worker and the synchronous ones through a ``rollout_func`` over the same script
(:class:`~hf_dynbsz.testing.ScriptRolloutFunc`). An optimizer step is 16 samples. Stock's tree attention runs through
its FA3 kernel written in plain torch (:func:`~hf_dynbsz.testing.async_grpo_on_cpu`), the only way it runs here.

1. **Training phase** (``perf/fwd_bwd_s`` + ``perf/optimizer_s``, both trainers log them), per 16 samples:

   * ``stock, default budget``: stock's token-budget mode at its default, the server's ``max_model_len`` (here the
     longest prompt + ``max_completion_length``), one micro-batch per optimizer step (its step is as many samples as
     fit the budget: the time is per 16 samples trained);
   * ``stock, fixed count``: stock's fixed-count mode, 16 x 1 (the plugin's exactness reference);
   * ``plugin``: ``DynamicBatchAsyncGRPOTrainer`` 16 x 1, every setting at its default (the automatic budget: stock's
     fixed-count row).

2. **Wall clock per optimizer step** with generation taking time: ``generation_seconds`` per sample, chosen so that a
   step's generation (16 samples) takes about the plugin's training phase measured in 1:

   * ``sync stock``: ``GRPOTrainer`` (4 x 4, a generation round per optimizer step), generation then training;
   * ``sync plugin``: ``DynamicBatchGRPOTrainer``, the same;
   * ``async plugin``: ``DynamicBatchAsyncGRPOTrainer`` 16 x 1, the stand-in worker's thread producing a sample every
     ``generation_seconds`` while the trainer trains (a queue of at most one step's samples).

   Goals: the asynchronous plugin's step at most 0.6x the synchronous plugin's (generation hidden behind training),
   at least 4x faster than synchronous stock's.

Each configuration runs in a fresh process with one torch thread. The first step is warm-up (the asynchronous wall
clock's first four: its queue fills while they train), then per run the mean over the measured steps (6), per
configuration the median over repeats. Part 2 reads part 1's plugin time in the same run.

Usage (from the repository root)::

    python benchmarks/async_step_time.py            # 3 repeats (about 15 minutes on 2 idle cores)
    python benchmarks/async_step_time.py --quick    # a smaller model and completions, one repeat

Writes ``benchmarks/results/async_step_time.md`` and the raw data ``async_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average, machine_description, markdown_table, median  # noqa: E402

from hf_dynbsz.testing import PROMPT_RANGE, run_script_worker  # noqa: E402

SAMPLES_PER_STEP = 16
#: The asynchronous wall clock's warm-up steps: the queue (one step's samples at most) fills while the first steps
#: train and check; after these the step's time is the pace of generation or of training, whichever is slower.
ASYNC_WARM_UP = 4
PRESETS = {
    "quick": dict(max_completion_length=256, hidden_size=64, num_layers=2, vocab_size=1024, steps=4, repeats=1),
    "default": dict(max_completion_length=512, hidden_size=128, num_layers=3, vocab_size=4096, steps=6, repeats=3),
}
TRAINING = {
    "stock_budget": "stock AsyncGRPOTrainer, default budget (max_model_len)",
    "stock_fixed": "stock AsyncGRPOTrainer, fixed count 16 x 1",
    "plugin": "DynamicBatchAsyncGRPOTrainer 16 x 1, defaults",
}
WALL = {
    "sync_stock": "synchronous GRPOTrainer",
    "sync_plugin": "synchronous DynamicBatchGRPOTrainer",
    "async_plugin": "DynamicBatchAsyncGRPOTrainer",
}


# --------------------------------------------------------------------------------------------------- worker
def script_of(spec: dict):
    from hf_dynbsz.testing import RolloutScript

    return RolloutScript(
        mix="long_tailed",
        max_completion_length=spec["max_completion_length"],
        prompt_lengths=PROMPT_RANGE,
        seed=spec["seed"],
    )


def model_directory(spec: dict, root: str) -> str:
    from hf_dynbsz.testing import TEST_ALPHABET, ModelShape, build_char_tokenizer

    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    shape = ModelShape(spec["hidden_size"], spec["num_layers"], vocab_size=spec["vocab_size"])
    model = shape.build(tokenizer, max_positions=PROMPT_RANGE[1] + spec["max_completion_length"] + 8)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def steps_of(history: list[dict], key: str) -> list[dict]:
    return [entry for entry in history if key in entry]


def run_async(spec: dict, model_dir: str, output_dir: str) -> dict:
    """An asynchronous run: per optimizer step its training phase, samples and wall time (stock's logs)."""
    from hf_dynbsz.testing import async_grpo_run

    fields = dict(max_steps=spec["max_steps"], learning_rate=1e-6, max_completion_length=spec["max_completion_length"])
    fields.update(per_device_train_batch_size=SAMPLES_PER_STEP, gradient_accumulation_steps=1)
    if spec["run"] == "stock_budget":
        fields.update(token_budget=PROMPT_RANGE[1] + spec["max_completion_length"])
    trainer = "async_grpo_stock" if spec["run"].startswith("stock") else "async_grpo_dynamic"
    run = async_grpo_run(
        trainer,
        model_dir,
        output_dir,
        script_of(spec),
        generation_seconds=spec.get("generation_seconds", 0.0),
        queue_steps=1,
        **fields,
    )
    steps = steps_of(run.history, "perf/fwd_bwd_s")
    return {
        "train_seconds": [step["perf/fwd_bwd_s"] + step["perf/optimizer_s"] for step in steps],
        "samples": [step["batch/samples_per_step"] for step in steps],
        "step_seconds": [step.get("perf/step_s") for step in steps],
    }


def run_sync(spec: dict, model_dir: str, output_dir: str) -> dict:
    """A synchronous GRPO run on the same samples: each optimizer step's wall time (generation and training)."""
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing import ScriptRolloutFunc, build_trainer, load_tokenizer, numbered_prompts, run_config
    from hf_dynbsz.testing import step_clock as make_clock

    name = "grpo_stock" if spec["run"] == "sync_stock" else "grpo_dynamic"
    args = run_config(
        name,
        output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=spec["max_completion_length"],
        max_steps=spec["max_steps"],
        learning_rate=1e-6,
        seed=spec["seed"],
    )
    rollout = ScriptRolloutFunc(script_of(spec), spec["generation_seconds"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = numbered_prompts(SAMPLES_PER_STEP // 4 * (spec["max_steps"] + 1))
    trainer = build_trainer(args, model, load_tokenizer(model_dir), dataset=prompts, rollout=rollout)
    clock = make_clock()
    trainer.add_callback(clock)
    trainer.train()
    return {"step_seconds": clock.seconds}


def run_worker(spec: dict) -> dict:
    import torch

    from hf_dynbsz.testing import quiet_worker

    quiet_worker()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="async-step-") as root:
        model_dir = model_directory(spec, str(Path(root) / "model"))
        output_dir = str(Path(root) / "out")
        if spec["run"].startswith("sync"):
            return run_sync(spec, model_dir, output_dir)
        return run_async(spec, model_dir, output_dir)


# --------------------------------------------------------------------------------------------------- driver
def measure(spec: dict, timeout: float) -> dict:
    return run_script_worker(__file__, spec, timeout, f"{spec['run']} run", prefix="async-step-")


def per_sixteen(result: dict, skip: int = 1) -> float:
    """The training phase per 16 samples, over the steps after ``skip``."""
    seconds, samples = result["train_seconds"][skip:], result["samples"][skip:]
    return sum(seconds) / max(sum(samples), 1.0) * SAMPLES_PER_STEP


def training_phase(settings: dict, repeats: int, timeout: float) -> dict[str, list[float]]:
    """Part 1: per configuration, each repeat's training phase per 16 samples."""
    times = {name: [] for name in TRAINING}
    for repeat in range(repeats):
        order = list(TRAINING) if repeat % 2 == 0 else list(reversed(TRAINING))
        for name in order:
            steps = settings["steps"] * (4 if name == "stock_budget" else 1)  # (a budget's step is a few samples)
            result = measure({**settings, "run": name, "max_steps": steps, "seed": repeat}, timeout)
            times[name].append(per_sixteen(result))
    return times


def wall_clock(settings: dict, generation_seconds: float, repeats: int, timeout: float) -> dict[str, list[float]]:
    """Part 2: per configuration, each repeat's median optimizer step (wall clock)."""
    times = {name: [] for name in WALL}
    for repeat in range(repeats):
        order = list(WALL) if repeat % 2 == 0 else list(reversed(WALL))
        for name in order:
            skip = ASYNC_WARM_UP if name == "async_plugin" else 1
            spec = {**settings, "run": name, "max_steps": settings["steps"] + skip, "seed": repeat}
            result = measure({**spec, "generation_seconds": generation_seconds}, timeout)
            seconds = [s for s in result["step_seconds"][skip:] if s is not None]
            times[name].append(sum(seconds) / len(seconds))
    return times


def render(settings: dict, training: dict, wall: dict, generation_seconds: float) -> str:
    plugin = median(training["plugin"])
    rows = [
        [TRAINING[name], f"{median(values):.3f}", f"{median(values) / plugin:.2f}x"]
        for name, values in training.items()
    ]
    first = markdown_table(["trainer", "training phase per 16 samples (s)", "vs the plugin"], rows)
    asynchronous = median(wall["async_plugin"])
    rows = [
        [WALL[name], f"{median(values):.3f}", f"{median(values) / asynchronous:.2f}x"] for name, values in wall.items()
    ]
    second = markdown_table(["trainer", "wall clock per step (s)", "vs the async plugin"], rows)
    ratio = asynchronous / median(wall["sync_plugin"])
    speedup = median(wall["sync_stock"]) / asynchronous
    goals = (
        f"async plugin / sync plugin = {ratio:.2f} (goal <= 0.6: {'met' if ratio <= 0.6 else 'not met'}); "
        f"sync stock / async plugin = {speedup:.2f}x (goal >= 4: {'met' if speedup >= 4 else 'not met'})"
    )
    return (
        f"## Training phase\n\n{first}\n\n## Wall clock, generation {generation_seconds * SAMPLES_PER_STEP:.3f} s "
        f"per step ({generation_seconds * 1000:.1f} ms per sample)\n\n{second}\n\n{goals}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and completions, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_worker(json.loads(args.worker))
        Path(args.worker_out).write_text(json.dumps(result))
        return
    settings = dict(PRESETS["quick" if args.quick else "default"])
    repeats = args.repeats or settings.pop("repeats")
    settings.pop("repeats", None)
    started, loads = time.time(), [load_average()]
    training = training_phase(settings, repeats, args.timeout)
    generation_seconds = median(training["plugin"]) / SAMPLES_PER_STEP
    loads.append(load_average())
    wall = wall_clock(settings, generation_seconds, repeats, args.timeout)
    loads.append(load_average())
    report = render(settings, training, wall, generation_seconds)
    header = (
        f"# Asynchronous GRPO step time\n\n{machine_description()}\n\nSettings: {settings}, {repeats} repeat(s), "
        f"load averages {' / '.join(loads)}, {time.time() - started:.0f} s.\n\n"
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_step_time.md").write_text(header + report)
    raw = {"settings": settings, "training": training, "wall": wall, "generation_seconds": generation_seconds}
    (out / "async_step_time.json").write_text(json.dumps(raw, indent=1))
    print(header + report)


if __name__ == "__main__":
    main()
