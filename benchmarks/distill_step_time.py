"""Training-step time and peak memory, on-policy distillation: stock ``trl.DistillationTrainer`` vs
``hf_dynbsz.DynamicBatchDistillationTrainer``, in one run.

What it runs
------------
A Qwen2-style student (hidden 128, 3 layers, vocabulary 4096, fp32, sdpa, random weights: 1.6 M parameters) and a
teacher of the same vocabulary 2.7x its size (hidden 256, 3 layers: 4.5 M), on ``benchmarks/step_time.py``'s
long-tailed mix (prompts 32-96 tokens, completions lognormal up to 1024 tokens, median about 146): 8 samples per
optimizer step (per_device_train_batch_size 4, gradient accumulation 2), one completion per prompt, generated once per
optimizer step as stock does; ``beta`` 0.5 (the JSD, whose kernel does both models' statistics and a second pass).
Every other setting is TRL's (gradient checkpointing on) and, for the plugin, its default (padding-free rows through
segment attention, the automatic training budget, the teacher's budget from the two models' sizes, tiles of 1024
tokens x 8192 columns). A scripted generation stands in for the student's (the same completions for both trainers,
checked by the rounds' length fingerprints).

What it measures
----------------
``step_time.py``'s ``Probe``: the training phase of each optimizer step (the step's wall time minus the time inside
``_generate_and_score_completions``: the student's and the teacher's passes and the divergence, and the optimizer),
the positions the student's training passes compute and how many of them are real tokens (pad ids are padding: the
rollout never emits one), and the process's peak resident set over the training phase, minus what it held before
training. The first step is warm-up (and carries the plugin's self-check); per step index the median over repeats,
then the mean over the measured steps. One fresh process per trainer and repeat, interleaved, one torch thread each.

*token limit* = stock's computed positions / the step's real tokens: the speed-up that removing every padding position
alone would give (the teacher's passes and the divergence are padded the same way in stock). The goals of issue 53:
a steady step at least 3x stock's, or 80% of the token limit where it is below 3.75x; peak memory at most 0.6x
stock's.

Usage (from the repository root; run it alone on the machine, under ``flock /work/cpu.lock`` where it is shared)::

    python benchmarks/distill_step_time.py            # 3 repeats of 5 steps (about 6 minutes on 2 idle cores)
    python benchmarks/distill_step_time.py --quick    # a short model and completions, one repeat

Writes ``benchmarks/results/distill_step_time.md`` and the raw per-step data ``distill_step_time.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import rloo_step_time  # noqa: E402
from common import machine_description, markdown_table  # noqa: E402
from step_time import Probe, _mean, _per_index, code_fingerprint, git_state  # noqa: E402

from hf_dynbsz.testing import longest_prompt  # noqa: E402

MIX = "long_tailed"
CONFIGS = {"distillation_stock": "stock DistillationTrainer", "distillation_dynamic": "DynamicBatchDistillationTrainer"}
PRESETS = {
    "quick": dict(steps=3, max_completion_length=256, hidden_size=64, teacher_hidden_size=128, num_layers=2,
                  vocab_size=1024, repeats=1),
    "default": dict(steps=5, max_completion_length=1024, hidden_size=128, teacher_hidden_size=256, num_layers=3,
                    vocab_size=4096, repeats=3),
}  # fmt: skip
SCHEDULE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, beta=0.5)


# --------------------------------------------------------------------------------------------------- worker
def run_worker(spec: dict) -> dict:
    from hf_dynbsz.execution.device_memory import status_mib
    from hf_dynbsz.testing import ModelShape, build_trainer, mix_rollout, numbered_prompts, run_config

    tokenizer = rloo_step_time.worker_tokenizer()
    max_len, positions = spec["max_completion_length"], longest_prompt(MIX) + spec["max_completion_length"] + 64
    student = ModelShape(spec["hidden_size"], spec["num_layers"], vocab_size=spec["vocab_size"])
    teacher = ModelShape(spec["teacher_hidden_size"], spec["num_layers"], vocab_size=spec["vocab_size"])
    samples = SCHEDULE["per_device_train_batch_size"] * SCHEDULE["gradient_accumulation_steps"]
    args = run_config(
        spec["config"], spec["output_dir"], **SCHEDULE, max_completion_length=max_len, max_steps=spec["steps"],
        learning_rate=1e-5, lr_scheduler_type="constant", seed=spec["seed"],
    )  # fmt: skip
    trainer = build_trainer(
        args, student.build(tokenizer, max_positions=positions), tokenizer,
        dataset=numbered_prompts(samples * spec["steps"] + 8, width=5),
        rollout=mix_rollout(MIX, tokenizer, max_len, spec["seed"]),
        teacher_model=teacher.build(tokenizer, max_positions=positions, seed=1),
    )  # fmt: skip
    probe = Probe(trainer, trainer.rollout, counted=trainer.model.base_model)
    baseline = status_mib("VmRSS")
    trainer.train()
    executor = getattr(trainer, "_dynbsz", None)
    return {
        "spec": spec,
        "code": code_fingerprint(),
        "parameters": [sum(p.numel() for p in model.parameters()) for model in (trainer.model, trainer.teacher_model)],
        "baseline_mb": baseline,
        "steps": probe.steps,
        "rounds": probe.generation_rounds,
        "layout": executor.scheduler.describe() if executor is not None and executor.enabled else "stock",
        "budgets": [
            [entry.get("dynbsz/budget_tokens"), entry.get("dynbsz/teacher_seconds")]
            for entry in trainer.state.log_history
            if "dynbsz/budget_tokens" in entry
        ],
    }


# --------------------------------------------------------------------------------------------------- driver
def run_one(spec: dict, timeout: float) -> dict:
    return rloo_step_time.run_one(spec, timeout, script=__file__, prefix="dynbsz-distill-bench-")


def summarise(results: list[dict]) -> list[dict]:
    """One row per trainer: training-phase seconds per step (per index the median over repeats, then the mean over
    the measured steps, the first left out), the peak memory over training (the median of the runs' highest step
    peak, less what the process held before training), and their ratios against stock."""
    rows = {}
    for config in CONFIGS:
        runs = [result for result in results if result["spec"]["config"] == config]
        peaks = [max(step["peak_kb"] for step in run["steps"]) / 1024 - run["baseline_mb"] for run in runs]
        rows[config] = {
            "config": config,
            "train_s": _mean(_per_index(runs, "steps", "train_s", 1)),
            "train_cpu_s": _mean(_per_index(runs, "steps", "train_cpu_s", 1)),
            "train_tokens": _mean(_per_index(runs, "steps", "train_tokens", 1)),
            "real_tokens": _mean(_per_index(runs, "steps", "train_real_tokens", 1)),
            "passes": _mean(_per_index(runs, "steps", "train_passes", 1)),
            "peak_mb": statistics.median(peaks),
            "steps": min(len(run["steps"]) for run in runs) - 1,
            "repeats": len(runs),
            "layout": runs[0]["layout"],
            "parameters": runs[0]["parameters"],
        }
    stock = rows["distillation_stock"]
    limit = stock["train_tokens"] / stock["real_tokens"]
    common.add_speedups(rows.values(), stock, limit)
    return list(rows.values())


def render_table(rows: list[dict]) -> str:
    header = ["trainer", "layout", "train s/step", "speed-up", "token limit", "of the limit"]
    header += ["train CPU s/step (speed-up)", "student positions/step (real)", "student passes/step"]
    header += ["peak memory MiB (vs stock)"]
    body = [
        [
            CONFIGS[row["config"]],
            row["layout"],
            *common.speed_cells(row),
            f"{row['train_tokens']:.0f} ({row['real_tokens']:.0f})",
            f"{row['passes']:.1f}",
            f"{row['peak_mb']:.0f} ({row['memory_ratio']:.2f}x)",
        ]
        for row in rows
    ]
    return markdown_table(header, body)


#: The per-step figures kept in the raw-data file.
STEP_FIELDS = ("train_s", "train_cpu_s", "train_tokens", "train_real_tokens", "train_passes", "peak_kb")


def compact_run(result: dict) -> dict:
    """One worker's raw data as the tables use it: its trainer, layout, baseline, and per step the figures of
    ``STEP_FIELDS`` (4 significant digits)."""
    return {
        "config": result["spec"]["config"],
        "layout": result["layout"],
        "baseline_mb": round(result["baseline_mb"], 1),
        "steps": [[float(f"{step[k]:.4g}") for k in STEP_FIELDS] for step in result["steps"]],
        "budgets": result["budgets"],
    }


def goals(rows: list[dict]) -> str:
    """The issue's goals against the plugin's row."""
    ours = next(row for row in rows if row["config"] == "distillation_dynamic")
    speed = ours["speedup"] >= 3.0 or (ours["token_limit"] < 3.75 and ours["of_limit"] >= 0.8)
    return (
        f"Goals (issue 53): a steady step >= 3x stock's, or >= 80% of the token limit where it is below 3.75x: "
        f"{ours['speedup']:.2f}x, {ours['of_limit']:.0%} of a {ours['token_limit']:.2f}x limit, "
        f"{'met' if speed else 'missed'}; peak memory <= 0.6x stock's: {ours['memory_ratio']:.2f}x, "
        f"{'met' if ours['memory_ratio'] <= 0.6 else 'missed'}."
    )


def report(args, spec: dict, results: list[dict], rows: list[dict], loads: list[str], minutes: float) -> str:
    student, teacher = rows[0]["parameters"]
    return "\n\n".join(
        [
            "# Training-step time and memory, distillation: stock DistillationTrainer vs "
            "DynamicBatchDistillationTrainer",
            f"Generated by `python benchmarks/distill_step_time.py{' --quick' if args.quick else ''}` in "
            f"{minutes:.1f} min.",
            f"Workload: step_time.py's long-tailed mix, settings {json.dumps(spec)}, {json.dumps(SCHEDULE)}; a "
            f"student of {student / 1e6:.2f} M parameters and a teacher of {teacher / 1e6:.2f} M "
            f"({teacher / student:.1f}x), the same vocabulary; every other setting TRL's or the plugin's default. "
            f"{args.repeats} fresh process(es) per trainer, {rows[0]['steps']} measured optimizer steps each (the "
            "first left out).",
            f"Machine: {machine_description()}. Load average (1/5/15 min) before and after each repeat: "
            f"{' | '.join(loads)} (a shared machine: other jobs ran during the measurement).",
            f"Code: {git_state()}; hf_dynbsz source hash {results[0]['code']}.",
            render_table(rows),
            "*train s/step*: wall time of the training phase of an optimizer step (the student's and the teacher's "
            "passes, the divergence, the optimizer; no generation), per step the median over repeats, then the mean "
            "over the measured steps; *speed-up*: stock / this, measured in the same run; *token limit*: stock's "
            "computed positions / the real tokens of the step (the student's training passes; the teacher's are "
            "padded alike in stock); *of the limit*: speed-up / token limit; *peak memory*: the highest resident set "
            "over a training phase less what the process held before training, the median over repeats.",
            goals(rows),
        ]
    )


def main() -> None:
    args = rloo_step_time.arguments(__doc__, "a short model and completions, one repeat", run_worker)
    if args is None:
        return
    preset = dict(PRESETS["quick" if args.quick else "default"])
    args.repeats = args.repeats or preset.pop("repeats")
    preset.pop("repeats", None)
    spec = dict(preset, seed=0)
    results, loads, started = rloo_step_time.run_repeats(spec, CONFIGS, args.repeats, one=run_one)
    rows = summarise(results)
    text = report(args, spec, results, rows, loads, (time.perf_counter() - started) / 60)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "distill_step_time_quick" if args.quick else "distill_step_time"
    (args.out_dir / f"{name}.md").write_text(text + "\n")
    raw = {"rows": rows, "runs": [compact_run(result) for result in results]}
    (args.out_dir / f"{name}.json").write_text(json.dumps(raw) + "\n")
    print(render_table(rows))
    print(goals(rows))


if __name__ == "__main__":
    main()
