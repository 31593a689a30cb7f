"""Shared prompts: stock ``GRPOTrainer`` vs ``DynamicBatchGRPOTrainer`` with prompt sharing off and on, side by side.

Runs the training-step measurement of ``benchmarks/step_time.py`` (same worker, probes and aggregation: see its
docstring) on three workloads, each with its own GRPO shape, and three trainers: stock, and the dynamic trainer's
padding-free layout (segment attention on sdpa) with ``share_prompt_prefix`` off and on.

* (a) ``prompt_heavy``: prompts of 400-600 tokens, completions of median ~40 tokens (max 256), 8 generations per
  prompt; per_device_train_batch_size 8 x gradient_accumulation_steps 2 (one prompt's 8 completions per stock slice).
  Goals: sharing on >= 2.5x over sharing off and >= 3.75x over stock.
* (b) ``long_tailed``: completion-heavy (prompts 32-96, completions lognormal up to 1024), 4 generations; the
  step_time.py shape. Goal: >= 4.5x over stock with padding-free on sdpa, and >= 0.95x of sharing off.
* (c) ``uniform``: all prompts 64 and completions 512 tokens. Goal: >= 0.95x of sharing off.
Peak memory: no worse than sharing off.

Usage (from the repository root)::

    python benchmarks/shared_prompt.py           # about 12 minutes on 2 cores
    python benchmarks/shared_prompt.py --quick   # smoke run

Writes ``benchmarks/results/shared_prompt.md``, ``shared_prompt.png`` and ``shared_prompt.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402

from hf_dynbsz.testing import MIX_LABELS  # noqa: E402

CONFIGS = ("stock", "padding_free_no_share", "padding_free")
LABELS = {
    "stock": "stock GRPOTrainer",
    "padding_free_no_share": "dynamic, sharing off",
    "padding_free": "dynamic, sharing on",
}
MODEL = dict(hidden_size=128, num_layers=3, vocab_size=4096, num_iterations=1)
SHAPES = {
    "prompt_heavy": dict(
        max_completion_length=256, batch_size=8, grad_accum=2, steps_per_generation=2, num_generations=8, rounds=4
    ),
    "long_tailed": dict(
        max_completion_length=1024, batch_size=4, grad_accum=2, steps_per_generation=4, num_generations=4, rounds=3
    ),
    "uniform": dict(
        max_completion_length=1024, batch_size=4, grad_accum=2, steps_per_generation=4, num_generations=4, rounds=3
    ),
}
GOALS = {  # mix: (vs stock, vs sharing off)
    "prompt_heavy": (3.75, 2.5),
    "long_tailed": (4.5, 0.95),
    "uniform": (None, 0.95),
}


def run(repeats: int, mixes: list[str], quick: bool, timeout: float) -> list[dict]:
    results = []
    started = time.perf_counter()
    for repeat in range(repeats):
        for mix in mixes:
            shape = dict(SHAPES[mix])
            if quick:
                shape.update(rounds=2, max_completion_length=min(shape["max_completion_length"], 256))
            order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
            for config in order:
                spec = dict(MODEL, **shape, mix=mix, config=config, repeat=repeat, seed=0, threads=1)
                result = step_time.run_one(spec, timeout)
                measured = [s["train_s"] for s in result["steps"][1:]]
                print(
                    f"[{time.perf_counter() - started:6.0f}s] repeat {repeat} {mix:12s} {config:22s} "
                    f"train s/step {sum(measured) / len(measured):6.3f}  load {load_average()}",
                    flush=True,
                )
                results.append(result)
    return results


def render(rows: list[dict], minutes: float) -> str:
    by = {(row["mix"], row["config"]): row for row in rows}
    body, verdicts = [], []
    for mix in [m for m in SHAPES if any(row["mix"] == m for row in rows)]:
        stock, off = by[mix, "stock"], by[mix, "padding_free_no_share"]
        for config in CONFIGS:
            row = by[mix, config]
            body.append(
                [
                    MIX_LABELS[mix],
                    LABELS[config],
                    f"{row['train_s']:.3f}",
                    f"{stock['train_s'] / row['train_s']:.2f}x",
                    f"{off['train_s'] / row['train_s']:.2f}x",
                    f"{row['train_tokens']:.0f}",
                    f"{row['train_peak_mb']:.0f} ({row['train_peak_mb'] / stock['train_peak_mb']:.2f}x, "
                    f"{row['train_peak_mb'] / off['train_peak_mb']:.2f}x)",
                ]
            )
        on = by[mix, "padding_free"]
        vs_stock, vs_off = stock["train_s"] / on["train_s"], off["train_s"] / on["train_s"]
        goal_stock, goal_off = GOALS[mix]
        parts = []
        if goal_stock is not None:
            parts.append(
                f"{vs_stock:.2f}x over stock (goal >= {goal_stock}: {'met' if vs_stock >= goal_stock else 'missed'})"
            )
        parts.append(f"{vs_off:.2f}x of sharing off (goal >= {goal_off}: {'met' if vs_off >= goal_off else 'missed'})")
        memory = on["train_peak_mb"] / off["train_peak_mb"]
        parts.append(f"training-phase peak {memory:.2f}x of sharing off")
        verdicts.append(f"* {MIX_LABELS[mix]}, sharing on: " + "; ".join(parts) + ".")
    header = [
        "workload",
        "trainer",
        "train s/step",
        "vs stock",
        "vs sharing off",
        "train tokens/step",
        "training-phase peak MB (vs stock, vs sharing off)",
    ]
    return "\n".join(
        [
            "# Shared prompts: stock vs sharing off vs sharing on",
            "",
            f"Generated by `python benchmarks/shared_prompt.py` in {minutes:.1f} min. "
            f"Machine: {machine_description()}.",
            "",
            "Model: Qwen2-style, hidden 128, 3 layers, vocabulary 4096, fp32, sdpa (segment attention for the dynamic "
            "trainer's padding-free rows), CPU, 1 thread. Times and tokens as in `benchmarks/step_time.py` (training "
            "phase of an optimizer step; per step the median over repeats, then the mean over the measured steps).",
            "",
            markdown_table(header, body),
            "",
            *verdicts,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mixes", default=",".join(SHAPES))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    started = time.perf_counter()
    mixes = args.mixes.split(",")
    results = run(1 if args.quick else args.repeats, mixes, args.quick, args.timeout)
    for mix in mixes:
        fingerprints = {
            json.dumps([r["fingerprint"] for r in res["rounds"]]) for res in results if res["spec"]["mix"] == mix
        }
        if len(fingerprints) != 1:
            raise RuntimeError(f"configurations saw different data for mix {mix}")
    rows = step_time.summarise(results)
    name = "shared_prompt_quick" if args.quick else "shared_prompt"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(render(rows, (time.perf_counter() - started) / 60))
    (args.out_dir / f"{name}.json").write_text(json.dumps(step_time._rounded({"rows": rows}), indent=1))
    plot(rows, args.out_dir / f"{name}.png")
    print((args.out_dir / f"{name}.md").read_text())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = [m for m in SHAPES if any(row["mix"] == m for row in rows)]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"stock": "#7f7f7f", "padding_free_no_share": "#ff7f0e", "padding_free": "#1f77b4"}
    for axis, (key, title) in zip(
        axes,
        [
            ("train_s", "training phase, s / optimizer step"),
            ("train_peak_mb", "training-phase peak RSS over baseline, MB"),
        ],
    ):
        for position, config in enumerate(CONFIGS):
            values = [next(r[key] for r in rows if r["mix"] == mix and r["config"] == config) for mix in mixes]
            axis.bar(
                [i + (position - 1) * 0.27 for i in range(len(mixes))],
                values,
                0.27,
                label=LABELS[config],
                color=colours[config],
            )
        axis.set_xticks(range(len(mixes)), [MIX_LABELS[m] for m in mixes], fontsize=8)
        axis.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
