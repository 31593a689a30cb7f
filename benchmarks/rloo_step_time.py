"""Training-step time, RLOO: stock ``trl.RLOOTrainer`` vs ``hf_dynbsz.DynamicBatchRLOOTrainer``, with the GRPO pair
measured in the same run (``benchmarks/step_time.py``'s long-tailed row, same workload).

What it runs
------------
``benchmarks/step_time.py``'s default long-tailed workload (a Qwen2-style model, hidden 128, 3 layers, vocabulary
4096, fp32, sdpa, random weights; 8 samples per optimizer step: per_device_train_batch_size 4, gradient accumulation
2; steps_per_generation 4; 4 completions per prompt; prompts 32-96 tokens, completions lognormal up to 1024 tokens),
trained by four trainers with every plugin setting at its default (padding-free rows with shared prompts, the
"auto" budget):

* ``grpo_stock``, ``grpo_dynamic``: ``GRPOTrainer`` and ``DynamicBatchGRPOTrainer``, the completions from
  ``step_time.py``'s scripted ``rollout_func``;
* ``rloo_stock``, ``rloo_dynamic``: ``RLOOTrainer`` and ``DynamicBatchRLOOTrainer``. RLOO takes no ``rollout_func``:
  the same scripted rollout stands in for its tokenization and generation (``_tokenize_prompts`` and
  ``_generate_single_turn`` overridden by the harness's ``build_trainer``, for both), so all four trainers see the
  same prompts and completions (the driver checks the rounds' length fingerprints).

``beta`` is 0 for all four (RLOO's default 0.05 would load a reference model from the model's path; GRPO's default
is 0). Both algorithms compute the old-policy log-probs in a no-grad pass per round (RLOO always does).

What it measures: ``step_time.py``'s ``Probe`` (training phase of each optimizer step: the step's wall time minus the
time inside ``_generate_and_score_completions``; the round's no-grad log-prob pass apart). The first step is
warm-up; per step index the median over repeats, then the mean over the measured steps. One fresh process per
configuration and repeat, interleaved (the order reversed every other repeat), one torch thread per process.

Usage (from the repository root)::

    python benchmarks/rloo_step_time.py            # 3 repeats (about 5 minutes on 2 idle cores)
    python benchmarks/rloo_step_time.py --quick    # a short model and completions, one repeat

Writes ``benchmarks/results/rloo_step_time.md`` and the raw per-step data ``rloo_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402
from step_time import (  # noqa: E402
    PRESETS,
    SPEC_KEYS,
    Probe,
    _mean,
    _per_index,
    code_fingerprint,
    git_state,
    num_prompts,
    reward_by_content,
    schedule_fields,
)

from hf_dynbsz.testing import longest_prompt  # noqa: E402

MIX = "long_tailed"
CONFIGS = {
    "grpo_stock": "stock GRPOTrainer",
    "grpo_dynamic": "DynamicBatchGRPOTrainer",
    "rloo_stock": "stock RLOOTrainer",
    "rloo_dynamic": "DynamicBatchRLOOTrainer",
}


# --------------------------------------------------------------------------------------------------- worker
def worker_tokenizer():
    """A step-time worker's start (this benchmark's and ``distill_step_time.py``'s): one thread and one inter-op
    thread, the warnings quiet; returns the character tokenizer."""
    import torch

    from hf_dynbsz.testing import build_char_tokenizer, quiet_worker

    quiet_worker(threads=1)
    torch.set_num_interop_threads(1)
    return build_char_tokenizer()


def run_worker(spec: dict) -> dict:
    from hf_dynbsz.testing import ModelShape, build_trainer, mix_rollout, numbered_prompts, run_config

    tokenizer = worker_tokenizer()
    max_len = spec["max_completion_length"]
    shape = ModelShape(spec["hidden_size"], spec["num_layers"], vocab_size=spec["vocab_size"])
    model = shape.build(tokenizer, max_positions=longest_prompt(MIX) + max_len + 64)
    rollout = mix_rollout(MIX, tokenizer, max_len, spec["seed"])
    args = run_config(spec["config"], spec["output_dir"], **schedule_fields(spec), beta=0.0)
    dataset = numbered_prompts(num_prompts(spec), width=5)
    trainer = build_trainer(args, model, tokenizer, dataset=dataset, reward=reward_by_content, rollout=rollout)
    probe = Probe(trainer, rollout)
    trainer.train()
    executor = getattr(trainer, "_dynbsz", None)
    return {
        "spec": spec,
        "code": code_fingerprint(),
        "steps": probe.steps,
        "rounds": probe.generation_rounds,
        "layout": executor.scheduler.describe() if executor is not None and executor.enabled else "stock",
    }


# --------------------------------------------------------------------------------------------------- driver
def run_one(spec: dict, timeout: float, script: str = __file__, prefix: str = "dynbsz-rloo-bench-") -> dict:
    """One worker of ``script`` (this benchmark's, or ``distill_step_time.py``'s with its ``prefix``) on ``spec``."""
    from hf_dynbsz.testing import run_script_worker

    return run_script_worker(script, spec, timeout, f"worker for {spec['config']}", prefix=prefix)


def summarise(results: list[dict]) -> list[dict]:
    """One row per configuration: training-phase seconds per step (per index the median over repeats, then the
    mean over the measured steps, the first left out), its speed-up against its algorithm's stock trainer."""
    rows = {}
    for config in CONFIGS:
        runs = [result for result in results if result["spec"]["config"] == config]
        train_tokens = _mean(_per_index(runs, "steps", "train_tokens", 1))
        rows[config] = {
            "config": config,
            "train_s": _mean(_per_index(runs, "steps", "train_s", 1)),
            "train_cpu_s": _mean(_per_index(runs, "steps", "train_cpu_s", 1)),
            "logprob_s": _mean(_per_index(runs, "rounds", "logprob_s", 1)),
            "train_tokens": train_tokens,
            "passes": _mean(_per_index(runs, "steps", "train_passes", 1)),
            "steps": min(len(run["steps"]) for run in runs) - 1,
            "repeats": len(runs),
            "layout": runs[0]["layout"],
        }
    for config, row in rows.items():
        stock = rows[config.split("_")[0] + "_stock"]
        row["speedup"] = stock["train_s"] / row["train_s"]
        row["speedup_cpu"] = stock["train_cpu_s"] / row["train_cpu_s"]
        row["logprob_speedup"] = stock["logprob_s"] / row["logprob_s"]
        row["token_limit"] = stock["train_tokens"] / row["train_tokens"]
    return list(rows.values())


def render_table(rows: list[dict]) -> str:
    header = ["trainer", "layout", "train s/step", "speed-up", "token limit", "train CPU s/step (speed-up)"]
    header += ["train tokens/step", "passes/step", "log-prob s/round (speed-up)"]
    body = [
        [
            CONFIGS[row["config"]],
            row["layout"],
            f"{row['train_s']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{row['token_limit']:.2f}x",
            f"{row['train_cpu_s']:.2f} ({row['speedup_cpu']:.2f}x)",
            f"{row['train_tokens']:.0f}",
            f"{row['passes']:.1f}",
            f"{row['logprob_s']:.2f} ({row['logprob_speedup']:.2f}x)",
        ]
        for row in rows
    ]
    return markdown_table(header, body)


#: The per-step and per-round figures kept in the raw-data file.
STEP_FIELDS = ("train_s", "train_cpu_s", "train_tokens", "train_passes")
ROUND_FIELDS = ("logprob_s", "logprob_cpu_s", "logprob_tokens")


def compact_run(result: dict) -> dict:
    """One worker's raw data as the tables use it: its configuration, and per step and per round the figures of
    ``STEP_FIELDS`` and ``ROUND_FIELDS`` (4 significant digits)."""
    return {
        "config": result["spec"]["config"],
        "layout": result["layout"],
        "steps": [[float(f"{step[k]:.4g}") for k in STEP_FIELDS] for step in result["steps"]],
        "rounds": [[float(f"{rnd[k]:.4g}") for k in ROUND_FIELDS] for rnd in result["rounds"]],
    }


def check_same_inputs(results: list[dict]) -> None:
    """Every run saw the same rounds (length fingerprints), whatever its trainer."""
    fingerprints = {json.dumps([r["fingerprint"] for r in result["rounds"]]) for result in results}
    if len(fingerprints) != 1:
        raise RuntimeError("the configurations saw different completions: the comparison would not be fair")


def arguments(doc: str, quick_help: str, worker) -> argparse.Namespace | None:
    """A step-time benchmark's command line (this one's and ``distill_step_time.py``'s): ``--quick`` (``quick_help``),
    ``--repeats``, ``--out-dir``; a worker's (``--worker SPEC --worker-out PATH``) runs ``worker`` on its spec, writes
    the result and returns None."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with open(args.worker_out, "w") as handle:
            json.dump(worker(json.loads(args.worker)), handle)
        return None
    return args


def run_repeats(spec: dict, configs, repeats: int, one=None) -> tuple[list[dict], list[str], float]:
    """``repeats`` rounds of one fresh worker per configuration of ``configs`` (every other round in reverse order)
    on ``spec`` (``one``: the benchmark's ``run_one``, default this one's), every run's inputs checked the same:
    ``(results, load averages before and after each round, start time)``."""
    started, results, loads = time.perf_counter(), [], [load_average()]
    for repeat in range(repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            print(f"repeat {repeat + 1}/{repeats}: {config}", flush=True)
            results.append((one or run_one)(dict(spec, config=config), timeout=1800))
        loads.append(load_average())
    check_same_inputs(results)
    return results, loads, started


def main() -> None:
    args = arguments(__doc__, "step_time.py's quick preset, one repeat", run_worker)
    if args is None:
        return
    preset = PRESETS["quick" if args.quick else "default"]
    repeats = args.repeats or preset["repeats"]
    spec = {key: preset[key] for key in SPEC_KEYS}
    spec.update(mix=MIX, seed=0)
    results, loads, started = run_repeats(spec, CONFIGS, repeats)
    rows = summarise(results)
    table = render_table(rows)
    minutes = (time.perf_counter() - started) / 60
    report = "\n\n".join(
        [
            "# Training-step time, RLOO: stock RLOOTrainer vs DynamicBatchRLOOTrainer (and GRPO in the same run)",
            f"Generated by `python benchmarks/rloo_step_time.py{' --quick' if args.quick else ''}` in {minutes:.1f} "
            "min.",
            f"Workload: step_time.py's long-tailed mix, settings {json.dumps(spec)}; beta 0; every plugin setting "
            f"at its default. {repeats} fresh process(es) per trainer, {rows[0]['steps']} measured optimizer "
            "steps each (the first left out).",
            f"Machine: {machine_description()}. Load average (1/5/15 min) before and after each repeat: "
            f"{' | '.join(loads)} (a shared machine: other jobs ran during the measurement).",
            f"Code: {git_state()}; hf_dynbsz source hash {results[0]['code']}.",
            table,
            "*train s/step*: wall time of the training phase of an optimizer step (forwards, backwards, optimizer; "
            "no generation, no log-prob pass), per step the median over repeats, then the mean over the measured "
            "steps; *speed-up*: the algorithm's stock trainer / this, measured in the same run; *token limit*: stock's "
            "computed tokens / this trainer's; *log-prob*: the round's no-grad old-policy pass.",
        ]
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "rloo_step_time.md").write_text(report + "\n")
    raw = [compact_run(result) for result in results]
    (args.out_dir / "rloo_step_time.json").write_text(json.dumps({"rows": rows, "runs": raw}) + "\n")
    print(table)


if __name__ == "__main__":
    main()
