"""Training-step time and peak memory, reward models: stock ``trl.RewardTrainer`` vs
``hf_dynbsz.DynamicBatchRewardTrainer``, in one run, on DPO's three mixes of preference pairs
(``benchmarks/dpo_step_time.py``: long-tailed pairs, long context, a system prompt common to every pair).

The model is DPO's benchmark model (a Qwen2-style model, hidden 128, 2 layers, vocabulary 4096, fp32, sdpa, random
weights from a fixed seed) as a sequence classifier of one label; 8 pairs per optimizer step
(per_device_train_batch_size 4, gradient accumulation 2), AdamW at 1e-5, ``max_length`` unset; every other setting
TRL's (gradient checkpointing on) or the plugin's default (padding-free prefix-tree rows through segment attention,
the automatic budget: stock's own micro-batch of 8 padded rows). Measured as DPO's benchmark measures (per optimizer
step wall and CPU time and peak resident set, the first step left out, one fresh process per trainer, mix and
repeat, one torch thread each); the token limit is stock's computed positions over the plugin's unique tokens.

Usage (from the repository root; run it alone on the machine, under ``flock /work/cpu.lock`` where it is shared)::

    python benchmarks/reward_step_time.py            # 3 repeats of 4 steps per mix
    python benchmarks/reward_step_time.py --quick    # shorter pairs, one repeat

Writes ``benchmarks/results/reward_step_time.md`` and the raw per-step data ``reward_step_time.json``.
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
import dpo_step_time as dpo  # noqa: E402
from common import RESULTS_DIR, load_average, machine_description  # noqa: E402
from step_time import code_fingerprint, git_state  # noqa: E402

CONFIGS = {"stock": "stock RewardTrainer", "dynamic": "DynamicBatchRewardTrainer"}
dpo.CONFIGS = CONFIGS  # (dpo.summarise and dpo.render_table read the trainers' names there)
SCHEDULE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)


def reward_classifier(tokenizer, seed: int):
    """DPO's benchmark model as a sequence classifier of one label, its weights from ``seed``."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_dynbsz.testing import ModelShape

    config = ModelShape(**dpo.MODEL).build(tokenizer, max_positions=8192).config
    config.num_labels = 1
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def run_worker(spec: dict) -> dict:
    import torch
    from transformers import TrainerCallback
    from trl import RewardTrainer

    from hf_dynbsz import DynamicBatchRewardTrainer
    from hf_dynbsz.execution.device_memory import reset_peak_rss, status_mib
    from hf_dynbsz.testing import build_char_tokenizer, quiet_worker
    from hf_dynbsz.testing.reward import reward_config

    quiet_worker(threads=1)
    torch.set_num_interop_threads(1)
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    samples = SCHEDULE["per_device_train_batch_size"] * SCHEDULE["gradient_accumulation_steps"]
    dataset = dpo.pairs(spec["mix"], samples * spec["steps"], spec["scale"], spec["seed"])
    plugin = spec["config"] == "dynamic"
    args = reward_config(
        spec["output_dir"], plugin=plugin, **SCHEDULE, max_steps=spec["steps"], learning_rate=1e-5, optim="adamw_torch",
        max_grad_norm=1.0, max_length=None, seed=spec["seed"],
    )  # fmt: skip
    trainer = (DynamicBatchRewardTrainer if plugin else RewardTrainer)(
        model=reward_classifier(tokenizer, spec["seed"]), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            reset_peak_rss()
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = {"train_s": time.perf_counter() - self.start, "train_cpu_s": time.process_time() - self.cpu}
            steps.append({**elapsed, "peak_mb": status_mib("VmHWM")})

    trainer.add_callback(Clock())
    baseline = status_mib("VmRSS")
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    for step, entry in zip(steps, logged):
        step.update(num_tokens=entry["num_tokens"], computed=entry.get("dynbsz/computed_tokens"))
        step.update(stock_computed=entry.get("dynbsz/stock_computed_tokens"))
        step["passes"] = entry.get("dynbsz/microbatches", float(SCHEDULE["gradient_accumulation_steps"]))
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


def run_one(spec: dict, timeout: float, keep: Path) -> dict:
    from hf_dynbsz.testing import run_script_worker

    label = f"worker for {spec['config']} on {spec['mix']}"
    return run_script_worker(__file__, dict(spec, keep=str(keep)), timeout, label, prefix="dynbsz-reward-bench-")


def report(args, spec: dict, results: list[dict], rows: list[dict], loads: list[str], minutes: float) -> str:
    return "\n\n".join(
        [
            "# Training-step time and memory, reward models: stock RewardTrainer vs DynamicBatchRewardTrainer",
            f"Generated by `python benchmarks/reward_step_time.py{' --quick' if args.quick else ''}` in "
            f"{minutes:.1f} min.",
            f"Workload: {json.dumps(dpo.MIXES)} (tokens, times {spec['scale']}), settings {json.dumps(SCHEDULE)}, "
            f"model {json.dumps(dpo.MODEL)} as a sequence classifier of one label "
            f"({results[0]['parameters'] / 1e6:.2f} M parameters); every other setting TRL's or the plugin's default. "
            f"{args.repeats} fresh process(es) per trainer and mix, {rows[0]['steps']} measured optimizer steps each "
            "(the first left out).",
            f"Machine: {machine_description()}. Load average (1/5/15 min) before and after each repeat: "
            f"{' | '.join(loads)} (a machine shared with other agents' jobs: the times are noisy; the ratios within "
            "one run are the figures to read).",
            f"Code: {git_state()}; hf_dynbsz source hash {results[0]['code']}.",
            dpo.render_table(rows),
            "*step s*: wall time of an optimizer step (forwards, backwards, the optimizer), per step the median over "
            "repeats, then the mean over the measured steps; *speed-up*: stock / this, in the same run; *token "
            "limit*: stock's computed positions (padded rows, each pair's prompt twice) / the plugin's unique tokens "
            "(each prompt once, a shared prefix once per pass, each sequence through its read token); *of the "
            "limit*: speed-up / token limit; *peak memory*: the highest resident set over a step less what the "
            "process held before training; *parameters vs stock*: relative difference of the final parameters.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter pairs, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--mixes", default=",".join(dpo.MIXES), help="comma-separated mixes to run")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        spec["output_dir"] = str(Path(spec["keep"]) / f"{spec['mix']}-{spec['config']}-{spec['repeat']}")
        with open(args.worker_out, "w") as handle:
            json.dump(run_worker(spec), handle)
        return
    preset = dict(dpo.PRESETS["quick" if args.quick else "default"])
    args.repeats = args.repeats or preset["repeats"]
    spec = dict(steps=preset["steps"], scale=preset["scale"], seed=0)
    keep = Path(tempfile.mkdtemp(prefix="dynbsz-reward-bench-params-"))
    started, results, loads = time.perf_counter(), [], [load_average()]
    for repeat in range(args.repeats):
        for mix in args.mixes.split(","):
            for config in list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS)):
                print(f"repeat {repeat + 1}/{args.repeats}: {config} on {mix}", flush=True)
                results.append(run_one(dict(spec, mix=mix, config=config, repeat=repeat), 3600, keep))
        loads.append(load_average())
    rows = dpo.summarise(results)
    text = report(args, spec, results, rows, loads, (time.perf_counter() - started) / 60)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "reward_step_time_quick" if args.quick else "reward_step_time"
    (args.out_dir / f"{name}.md").write_text(text + "\n")
    raw = {"rows": rows, "runs": [{"spec": r["spec"], "layout": r["layout"], "steps": r["steps"]} for r in results]}
    (args.out_dir / f"{name}.json").write_text(json.dumps(raw) + "\n")
    print(dpo.render_table(rows))


if __name__ == "__main__":
    main()
