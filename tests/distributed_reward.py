"""Worker for the multi-process reward-model tests: ``accelerate launch --config_file <yaml> tests/distributed_reward.py
...``.

Trains stock ``RewardTrainer`` (``--trainer stock``) or ``DynamicBatchRewardTrainer`` (``--trainer dynamic``) from a
saved tiny causal LM loaded as a sequence classifier of one label (``hf_dynbsz.testing.reward.reward_model``: the same
score head on every process) on long-tailed preference pairs, once per named set of config fields of ``--scenarios``
(JSON ``{"name": {"field": value}}``; files suffixed ``.name``), and writes each rank's record (every metric it logged
but the timings, the plugin's figures apart, whether ZeRO-3 partitioned the parameters) and, from rank 0, the final
gathered parameters.
"""

from __future__ import annotations

import json
import os

from hf_dynbsz.testing import (
    gathered_parameters,
    leave_worker,
    load_tokenizer,
    logged_metrics,
    preference_pairs,
    scenario_worker_arguments,
    write_worker_results,
)
from hf_dynbsz.testing.reward import reward_config, reward_model

#: Fields only DynamicBatchRewardConfig has (left out of a stock run's config).
OURS_ONLY = ("max_tokens_per_microbatch", "balance_across_ranks")


def long_tailed(rng, n):
    """Response lengths with a long tail (1-60 tokens, most short)."""
    return [min(int(v), 60) for v in rng.geometric(0.08, n)]


def train(cli, name: str, fields: dict):
    from trl import RewardTrainer

    from hf_dynbsz import DynamicBatchRewardTrainer

    plugin = cli.trainer == "dynamic"
    fields = dict(fields)
    pairs, system, margins = fields.pop("pairs", 32), fields.pop("system", 0), fields.pop("margins", False)
    if not plugin:
        fields = {key: value for key, value in fields.items() if key not in OURS_ONLY}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        fields.setdefault("ddp_backend", "gloo")
    args = reward_config(f"{cli.out}.{name}.output", plugin=plugin, **fields)
    dataset = preference_pairs(pairs, seed=11, prompt=(3, 30), response=long_tailed, system=system)
    if margins:
        dataset = dataset.add_column("margin", [0.25 * (k % 7) - 0.5 for k in range(pairs)])
    trainer_class = DynamicBatchRewardTrainer if plugin else RewardTrainer
    trainer = trainer_class(
        model=reward_model(cli.model_dir),
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(cli.model_dir),
    )
    trainer.train()
    write_results(trainer, f"{cli.out}.{name}")
    return trainer


def write_results(trainer, out: str) -> None:
    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model_wrapped)
    parameters = list(trainer.model_wrapped.parameters())
    partitioned = all(hasattr(p, "ds_id") for p in parameters) and any(
        p.ds_tensor.numel() < p.ds_numel for p in parameters
    )
    params = gathered_parameters(unwrapped)  # ZeRO-3 partitions: every process takes part
    record = {
        "rank": accelerator.process_index,
        "metrics": [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry],
        "logged": logged_metrics(trainer.state.log_history),
        "engine": {"zero3_partitioned": partitioned},
    }
    write_worker_results(accelerator, out, record, params)


def main() -> None:
    cli = scenario_worker_arguments(["stock", "dynamic"], scenario="field")
    trainer = None
    for name, fields in json.loads(cli.scenarios).items():
        trainer = train(cli, name, fields)
    leave_worker(trainer)


if __name__ == "__main__":
    main()
