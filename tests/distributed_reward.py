"""Worker for the multi-process reward-model tests: ``accelerate launch --config_file <yaml> tests/distributed_reward.py
...``.

Trains stock ``RewardTrainer`` (``--trainer stock``) or ``DynamicBatchRewardTrainer`` (``--trainer dynamic``) from a
saved tiny causal LM loaded as a sequence classifier of one label (``hf_dynbsz.testing.reward.reward_model``: the same
score head on every process) on long-tailed preference pairs, once per named set of config fields of ``--scenarios``
(JSON ``{"name": {"field": value}}``; files suffixed ``.name``), and writes each rank's record (every metric it logged
but the timings, the plugin's figures apart, whether ZeRO-3 partitioned the parameters or FSDP2 sharded them) and, from
rank 0, the final gathered parameters.
"""

from __future__ import annotations

from hf_dynbsz.testing import fsdp_on_cpu, load_tokenizer, scenarios
from hf_dynbsz.testing.reward import reward_config, reward_model

#: Fields only DynamicBatchRewardConfig has (left out of a stock run's config).
OURS_ONLY = ("max_tokens_per_microbatch", "balance_across_ranks")


def train(cli, name: str, fields: dict):
    from trl import RewardTrainer

    from hf_dynbsz import DynamicBatchRewardTrainer

    plugin = cli.trainer == "dynamic"
    fields, own = scenarios.scenario_fields(plugin, fields, OURS_ONLY, pairs=32, system=0, margins=False)
    pairs, system, margins = own["pairs"], own["system"], own["margins"]
    args = reward_config(f"{cli.out}.{name}.output", plugin=plugin, **fields)
    dataset = scenarios.scenario_pairs(pairs, system)
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
    from torch.distributed.tensor import DTensor

    engine = {
        "zero3_partitioned": scenarios.zero3_partitioned(trainer.model_wrapped),
        "fsdp_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
    }
    scenarios.write_scenario_results(trainer, out, engine)


if __name__ == "__main__":
    fsdp_on_cpu()  # a distributed_type: FSDP launch on CPU processes runs FSDP, as on GPUs (else plain DDP)
    scenarios.run_scenarios(train)
