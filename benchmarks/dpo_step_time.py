"""Training-step time and peak memory, DPO: stock ``trl.DPOTrainer`` vs ``hf_dynbsz.DynamicBatchDPOTrainer``, in
one run, on three mixes of preference pairs.

What it runs
------------
A Qwen2-style model (hidden 128, 2 layers, vocabulary 4096, fp32, sdpa, random weights) trained with DPO (sigmoid
loss, ``beta`` 0.1, AdamW at 1e-5), its reference a copy of it, on 8 pairs per optimizer step
(per_device_train_batch_size 4, gradient accumulation 2), ``max_length`` unset (nothing truncated); every other
setting TRL's (gradient checkpointing on) and, for the plugin, its defaults (padding-free rows through segment
attention with a prefix tree, the automatic training budget: stock's own micro-batch of 8 padded rows; the reference's
passes twice that). The mixes (tokens; one character-level token per character):

* ``long_tailed``: prompts 20-1,000 tokens and each response 10-2,000, log-uniform (as chat-model preference sets
  have: most short, a long tail);
* ``long_context``: each pair its own 1,500-token document as prompt, responses 50-400;
* ``system_prompt``: a 600-token system prompt common to every pair, then a question of 10-50 tokens, responses
  10-100.

What it measures
----------------
Per optimizer step (a callback's ``on_step_begin`` to ``on_step_end``: the reference's passes, the policy's, the
optimizer), wall and CPU time and the process's peak resident set less what it held before training; the first step is
warm-up (and carries the plugin's self-check). Per step index the median over repeats, then the mean over the measured
steps. One fresh process per trainer, mix and repeat, interleaved, one torch thread each. *token limit* = stock's
computed positions (its padded rows, policy and reference alike) / the plugin's unique tokens (each pair's prompt once,
the shared system prompt once per pass): the speed-up computing only those tokens would give; the plugin logs both
(``dynbsz/stock_computed_tokens``, ``dynbsz/computed_tokens``). The final parameters of the two trainers are compared
(relative difference). The goals of issue 61: at least 2.5x stock's step on the long-tailed mix, 1.7x on the
long-context mix, 3x on the system-prompt mix, each within 80% of its token limit; peak memory at most 0.6x stock's;
parameters equal.

Usage (from the repository root; run it alone on the machine, under ``flock /work/cpu.lock`` where it is shared)::

    python benchmarks/dpo_step_time.py            # 3 repeats of 4 steps per mix
    python benchmarks/dpo_step_time.py --quick    # shorter pairs, one repeat

Writes ``benchmarks/results/dpo_step_time.md`` and the raw per-step data ``dpo_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402
from step_time import _mean, _per_index, code_fingerprint, git_state  # noqa: E402

CONFIGS = {"stock": "stock DPOTrainer", "dynamic": "DynamicBatchDPOTrainer"}
#: Per mix: prompt and response lengths (tokens) as ``(low, high, "log" | "uniform")``, the shared block's length.
MIXES = {
    "long_tailed": dict(prompt=(20, 1000, "log"), response=(10, 2000, "log"), system=0),
    "long_context": dict(prompt=(1500, 1501, "uniform"), response=(50, 400, "uniform"), system=0),
    "system_prompt": dict(prompt=(10, 50, "uniform"), response=(10, 100, "uniform"), system=600),
}
#: Issue 61's speed goal per mix.
GOALS = {"long_tailed": 2.5, "long_context": 1.7, "system_prompt": 3.0}
PRESETS = {
    "quick": dict(steps=3, scale=0.25, repeats=1),
    "default": dict(steps=4, scale=1.0, repeats=3),
}
SCHEDULE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, beta=0.1)
MODEL = dict(hidden_size=128, num_layers=2, vocab_size=4096)


# --------------------------------------------------------------------------------------------------- workload
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def mix_lengths(mix: str, scale: float) -> dict:
    """The mix's length draws, times ``scale``: ``prompt`` and ``response`` each a function ``(rng, n) -> lengths``
    (as :func:`~hf_dynbsz.testing.preference_pairs` and :func:`~hf_dynbsz.testing.kto.unpaired_samples` take them),
    ``system`` the shared block's length."""
    import numpy as np

    spec = MIXES[mix]

    def draw(bounds):
        low, high, kind = bounds
        low = max(1, round(low * scale))
        high = max(low + 1, round(high * scale))

        def lengths(rng, n):
            if kind == "log":
                return np.exp(rng.uniform(math.log(low), math.log(high), n)).astype(int)
            return rng.integers(low, high, n)

        return lengths

    return dict(prompt=draw(spec["prompt"]), response=draw(spec["response"]), system=round(spec["system"] * scale))


def pairs(mix: str, count: int, scale: float, seed: int):
    """The mix's preference pairs (a ``datasets.Dataset``), lengths times ``scale``."""
    from hf_dynbsz.testing import preference_pairs

    return preference_pairs(count, seed=seed, alphabet=ALPHABET, **mix_lengths(mix, scale))


# --------------------------------------------------------------------------------------------------- worker
def worker_run(spec: dict, schedule: dict, config, data=pairs):
    """A worker's start (one torch thread, the character tokenizer), its samples (``data(mix, count, scale, seed)``:
    :func:`pairs` by default; ``spec``'s mix, enough for its steps at ``schedule``'s batch) and its run's config
    (``config``: ``dpo_config``, ``reward_config``, ``kto_config``; AdamW at 1e-5, ``max_length`` unset); returns
    ``(tokenizer, dataset, plugin, args)``."""
    import torch

    from hf_dynbsz.testing import build_char_tokenizer, quiet_worker

    quiet_worker(threads=1)
    torch.set_num_interop_threads(1)
    tokenizer = build_char_tokenizer(ALPHABET)
    samples = schedule["per_device_train_batch_size"] * schedule["gradient_accumulation_steps"]
    dataset = data(spec["mix"], samples * spec["steps"], spec["scale"], spec["seed"])
    plugin = spec["config"] == "dynamic"
    args = config(
        spec["output_dir"], plugin=plugin, **schedule, max_steps=spec["steps"], learning_rate=1e-5, optim="adamw_torch",
        max_grad_norm=1.0, max_length=None, seed=spec["seed"],
    )  # fmt: skip
    return tokenizer, dataset, plugin, args


#: What a worker reads of the plugin's log per step (step key -> logged name), besides ``num_tokens`` and the passes.
FIGURES = {"computed": "dynbsz/computed_tokens", "stock_computed": "dynbsz/stock_computed_tokens"}


def timed_training(trainer, spec: dict, figures: dict, accumulation: int) -> dict:
    """Train ``trainer``, timing each optimizer step (wall, CPU, peak resident set) and reading what the plugin logged
    of it (``figures``: step key -> logged name, besides ``num_tokens`` and the passes, ``accumulation`` for stock);
    saves the final parameters; returns the worker's result."""
    import torch
    from transformers import TrainerCallback

    from hf_dynbsz.execution.device_memory import reset_peak_rss, status_mib

    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            reset_peak_rss()
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(
                {
                    "train_s": time.perf_counter() - self.start,
                    "train_cpu_s": time.process_time() - self.cpu,
                    "peak_mb": status_mib("VmHWM"),
                }
            )

    trainer.add_callback(Clock())
    baseline = status_mib("VmRSS")
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    for step, entry in zip(steps, logged):
        step["num_tokens"] = entry["num_tokens"]
        for key, name in figures.items():
            step[key] = entry.get(name)
        step["passes"] = entry.get("dynbsz/microbatches", float(accumulation))
    torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, spec["output_dir"] + ".params.pt")
    executor = getattr(trainer, "_dynbsz", None)
    return {
        "spec": spec,
        "code": code_fingerprint(),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "baseline_mb": baseline,
        "steps": steps,
        "layout": executor.scheduler.describe() if executor is not None and executor.enabled else "stock",
        "params_path": spec["output_dir"] + ".params.pt",
    }


def run_worker(spec: dict) -> dict:
    import copy

    from hf_dynbsz.testing import ModelShape, dpo_config

    tokenizer, dataset, plugin, args = worker_run(spec, SCHEDULE, dpo_config)
    model = ModelShape(**MODEL).build(tokenizer, max_positions=8192)
    from trl import DPOTrainer

    from hf_dynbsz import DynamicBatchDPOTrainer

    trainer = (DynamicBatchDPOTrainer if plugin else DPOTrainer)(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    figures = dict(FIGURES, tree_saved="dynbsz/tree_tokens_saved")
    return timed_training(trainer, spec, figures, SCHEDULE["gradient_accumulation_steps"])


# --------------------------------------------------------------------------------------------------- driver
def run_one(spec: dict, timeout: float, keep: Path, script: str = __file__, prefix: str = "dynbsz-dpo-bench-") -> dict:
    """One worker of ``script`` (this one, or a benchmark built on it) on ``spec``, in a fresh process."""
    from hf_dynbsz.testing import run_script_worker

    label = f"worker for {spec['config']} on {spec['mix']}"
    return run_script_worker(script, dict(spec, keep=str(keep)), timeout, label, prefix=prefix)


def parameter_difference(results: list[dict], mix: str, configs: dict = CONFIGS) -> float:
    """Relative difference of the final parameters, ours against stock, on ``mix`` (first repeat of each)."""
    import torch

    from hf_dynbsz.testing import relative_difference

    paths = {
        config: next(r["params_path"] for r in results if r["spec"]["mix"] == mix and r["spec"]["config"] == config)
        for config in configs
    }
    return relative_difference(torch.load(paths["dynamic"]), torch.load(paths["stock"]))


def summarise(results: list[dict], configs: dict = CONFIGS) -> list[dict]:
    rows = []
    for mix in MIXES:
        mix_rows = {}
        for config in configs:
            runs = [r for r in results if r["spec"]["mix"] == mix and r["spec"]["config"] == config]
            if not runs:
                continue
            peaks = [max(step["peak_mb"] for step in run["steps"][1:]) - run["baseline_mb"] for run in runs]
            mix_rows[config] = {
                "mix": mix,
                "config": config,
                "train_s": _mean(_per_index(runs, "steps", "train_s", 1)),
                "train_cpu_s": _mean(_per_index(runs, "steps", "train_cpu_s", 1)),
                "peak_mb": statistics.median(peaks),
                "computed": _mean(_per_index(runs, "steps", "computed", 1)),
                "stock_computed": _mean(_per_index(runs, "steps", "stock_computed", 1)),
                "passes": _mean(_per_index(runs, "steps", "passes", 1)),
                "steps": min(len(run["steps"]) for run in runs) - 1,
                "repeats": len(runs),
                "layout": runs[0]["layout"],
                "tokens": [step["num_tokens"] for step in runs[0]["steps"]],
            }
        if len(mix_rows) < 2:
            continue
        stock, ours = mix_rows["stock"], mix_rows["dynamic"]
        assert stock["tokens"] == ours["tokens"], f"{mix}: the trainers saw different pairs"
        limit = ours["stock_computed"] / ours["computed"]
        common.add_speedups(mix_rows.values(), stock, limit)
        for row in mix_rows.values():
            row["parameter_difference"] = parameter_difference(results, mix, configs)
        rows += list(mix_rows.values())
    return rows


def render_table(rows: list[dict], configs: dict = CONFIGS) -> str:
    header = ["mix", "trainer", "layout", "step s", "speed-up", "token limit", "of the limit", "CPU s (speed-up)"]
    header += ["computed positions/step (stock's)", "passes/step", "peak memory MiB (vs stock)", "parameters vs stock"]
    body = [
        [
            row["mix"],
            configs[row["config"]],
            row["layout"],
            *common.speed_cells(row),
            f"{row['computed']:.0f} ({row['stock_computed']:.0f})" if row["config"] == "dynamic" else "-",
            f"{row['passes']:.1f}",
            f"{row['peak_mb']:.0f} ({row['memory_ratio']:.2f}x)",
            f"{row['parameter_difference']:.1e}" if row["config"] == "dynamic" else "-",
        ]
        for row in rows
    ]
    return markdown_table(header, body)


def goals(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        if row["config"] != "dynamic":
            continue
        goal = GOALS[row["mix"]]
        met = row["speedup"] >= goal and row["of_limit"] >= 0.8
        lines.append(
            f"{row['mix']}: {row['speedup']:.2f}x (goal >= {goal}x), {row['of_limit']:.0%} of a "
            f"{row['token_limit']:.2f}x token limit (goal >= 80%): {'met' if met else 'missed'}; peak memory "
            f"{row['memory_ratio']:.2f}x stock's (goal <= 0.6x): {'met' if row['memory_ratio'] <= 0.6 else 'missed'}; "
            f"parameters {row['parameter_difference']:.1e} from stock's (goal <= 1e-5): "
            f"{'met' if row['parameter_difference'] <= 1e-5 else 'missed'}."
        )
    return "Goals (issue 61):\n\n" + "\n".join(f"- {line}" for line in lines)


def report_opening(title: str, script: str, args, minutes: float) -> list[str]:
    """A report's title and how it was generated (``script``'s command line, ``minutes`` it took)."""
    return [f"# {title}", f"Generated by `python {script}{' --quick' if args.quick else ''}` in {minutes:.1f} min."]


#: What makes the times of a run on a machine shared with other jobs noisy (``noise`` of :func:`report_machine`).
SHARED_MACHINE = (
    "a machine shared with other agents' jobs: the times are noisy; the ratios within one run are the figures to read"
)


def report_machine(loads: list[str], results: list[dict], noise: str) -> list[str]:
    """A report's machine (its load averages ``loads``, what makes the times ``noise``-prone) and code."""
    return [
        f"Machine: {machine_description()}. Load average (1/5/15 min) before and after each repeat: "
        f"{' | '.join(loads)} ({noise}).",
        f"Code: {git_state()}; hf_dynbsz source hash {results[0]['code']}.",
    ]


def report(args, spec: dict, results: list[dict], rows: list[dict], loads: list[str], minutes: float) -> str:
    title = "Training-step time and memory, DPO: stock DPOTrainer vs DynamicBatchDPOTrainer"
    noise = (
        "a machine shared with other agents' jobs during the measurement: the times are noisy; the medians over "
        "repeats and the ratios within one run are the figures to read"
    )
    return "\n\n".join(
        [
            *report_opening(title, "benchmarks/dpo_step_time.py", args, minutes),
            f"Workload: {json.dumps(MIXES)} (tokens, times {spec['scale']}), settings {json.dumps(SCHEDULE)}, "
            f"model {json.dumps(MODEL)} ({results[0]['parameters'] / 1e6:.2f} M parameters), its reference a copy; "
            f"every other setting TRL's or the plugin's default. {args.repeats} fresh process(es) per trainer and "
            f"mix, {rows[0]['steps']} measured optimizer steps each (the first left out).",
            *report_machine(loads, results, noise),
            render_table(rows),
            "*step s*: wall time of an optimizer step (the reference's forwards, the policy's forwards and backwards, "
            "the optimizer), per step the median over repeats, then the mean over the measured steps; *speed-up*: "
            "stock / this, in the same run; *token limit*: stock's computed positions (padded rows, each pair's "
            "prompt twice) / the plugin's unique tokens (each prompt once, a shared prefix once per pass), both "
            "logged by the plugin; *of the limit*: speed-up / token limit; *peak memory*: the highest resident set "
            "over a step less what the process held before training, the median over repeats; *parameters vs "
            "stock*: relative difference of the final parameters.",
            goals(rows),
        ]
    )


def main(
    name: str = "dpo_step_time", doc: str = __doc__, configs: dict = CONFIGS, worker=None, one=run_one, describe=None,
    after=None,
) -> None:  # fmt: skip
    """The benchmark's command line (DPO's, or one built on it: its ``name``, docstring, trainers' ``configs``,
    ``worker(spec)``, ``one(spec, timeout, keep)``, ``describe(args, spec, results, rows, loads, minutes)`` of the
    report, ``after(rows)``: what it prints after the table)."""
    worker, describe = worker or run_worker, describe or report
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter pairs, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated mixes to run")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        spec["output_dir"] = str(Path(spec["keep"]) / f"{spec['mix']}-{spec['config']}-{spec['repeat']}")
        with open(args.worker_out, "w") as handle:
            json.dump(worker(spec), handle)
        return
    preset = dict(PRESETS["quick" if args.quick else "default"])
    args.repeats = args.repeats or preset["repeats"]
    spec = dict(steps=preset["steps"], scale=preset["scale"], seed=0)
    import tempfile

    keep = Path(tempfile.mkdtemp(prefix=f"dynbsz-{name.split('_')[0]}-bench-params-"))
    started, results, loads = time.perf_counter(), [], [load_average()]
    for repeat in range(args.repeats):
        for mix in args.mixes.split(","):
            for config in list(configs) if repeat % 2 == 0 else list(reversed(configs)):
                print(f"repeat {repeat + 1}/{args.repeats}: {config} on {mix}", flush=True)
                results.append(one(dict(spec, mix=mix, config=config, repeat=repeat), 3600, keep))
        loads.append(load_average())
    rows = summarise(results, configs)
    text = describe(args, spec, results, rows, loads, (time.perf_counter() - started) / 60)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{name}_quick" if args.quick else name
    (args.out_dir / f"{name}.md").write_text(text + "\n")
    raw = {"rows": rows, "runs": [{"spec": r["spec"], "layout": r["layout"], "steps": r["steps"]} for r in results]}
    (args.out_dir / f"{name}.json").write_text(json.dumps(raw) + "\n")
    print(render_table(rows, configs))
    (after or (lambda rows: print(goals(rows))))(rows)


if __name__ == "__main__":
    main()
