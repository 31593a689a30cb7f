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

Run as DPO's benchmark is (its command line, ``dpo_step_time.main``: from the repository root, alone on the machine,
under ``flock /work/cpu.lock`` where it is shared): ``python benchmarks/reward_step_time.py`` runs 3 repeats of 4 steps
per mix, ``--quick`` shorter pairs and one repeat. Writes ``benchmarks/results/reward_step_time.md`` and the raw
per-step data ``reward_step_time.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpo_step_time as dpo  # noqa: E402

CONFIGS = {"stock": "stock RewardTrainer", "dynamic": "DynamicBatchRewardTrainer"}
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
    from trl import RewardTrainer

    from hf_dynbsz import DynamicBatchRewardTrainer
    from hf_dynbsz.testing.reward import reward_config

    tokenizer, dataset, plugin, args = dpo.worker_run(spec, SCHEDULE, reward_config)
    trainer = (DynamicBatchRewardTrainer if plugin else RewardTrainer)(
        model=reward_classifier(tokenizer, spec["seed"]), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    return dpo.timed_training(trainer, spec, dpo.FIGURES, SCHEDULE["gradient_accumulation_steps"])


def run_one(spec: dict, timeout: float, keep: Path) -> dict:
    return dpo.run_one(spec, timeout, keep, script=__file__, prefix="dynbsz-reward-bench-")


def report(args, spec: dict, results: list[dict], rows: list[dict], loads: list[str], minutes: float) -> str:
    title = "Training-step time and memory, reward models: stock RewardTrainer vs DynamicBatchRewardTrainer"
    return "\n\n".join(
        [
            *dpo.report_opening(title, "benchmarks/reward_step_time.py", args, minutes),
            f"Workload: {json.dumps(dpo.MIXES)} (tokens, times {spec['scale']}), settings {json.dumps(SCHEDULE)}, "
            f"model {json.dumps(dpo.MODEL)} as a sequence classifier of one label "
            f"({results[0]['parameters'] / 1e6:.2f} M parameters); every other setting TRL's or the plugin's default. "
            f"{args.repeats} fresh process(es) per trainer and mix, {rows[0]['steps']} measured optimizer steps each "
            "(the first left out).",
            *dpo.report_machine(loads, results, dpo.SHARED_MACHINE),
            dpo.render_table(rows, CONFIGS),
            "*step s*: wall time of an optimizer step (forwards, backwards, the optimizer), per step the median over "
            "repeats, then the mean over the measured steps; *speed-up*: stock / this, in the same run; *token "
            "limit*: stock's computed positions (padded rows, each pair's prompt twice) / the plugin's unique tokens "
            "(each prompt once, a shared prefix once per pass, each sequence through its read token); *of the "
            "limit*: speed-up / token limit; *peak memory*: the highest resident set over a step less what the "
            "process held before training; *parameters vs stock*: relative difference of the final parameters.",
        ]
    )


def main() -> None:
    dpo.main("reward_step_time", __doc__, CONFIGS, run_worker, run_one, report, after=lambda rows: None)


if __name__ == "__main__":
    main()
