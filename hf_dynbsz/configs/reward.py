"""``DynamicBatchRewardConfig``: TRL's ``RewardConfig`` plus the plugin's settings, and what a reward model's run
refuses (:func:`refuse_reward_settings`). A reward model's run has no generation round and no reference: after the
``DIFFU_*`` environment only TRL's own ``RewardConfig.__post_init__`` and the plugin's fields apply
(``max_tokens_per_microbatch_logprob`` has nothing to size)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from hf_dynbsz.configs.shared import (
    DynamicBatchFields,
    config_doc,
    refuse_model_parallelism,
    refuse_sequence_parallelism,
)

__all__ = ["DynamicBatchRewardConfig", "refuse_reward_settings"]


@dataclass
class DynamicBatchRewardConfig(DynamicBatchFields, RewardConfig):
    __doc__ = config_doc("Reward")

    def _dynbsz_before_stock(self) -> None:
        refuse_reward_settings(self)


def refuse_reward_settings(args) -> None:
    """What ``DynamicBatchRewardTrainer`` does not run, refused before any work: ``sequence_parallel_size`` > 1 (a
    pair's loss is computed in one pass of whole rows) and a ``parallelism_config`` with context, sequence or tensor
    parallelism (:func:`~hf_dynbsz.configs.shared.refuse_model_parallelism`)."""
    refuse_sequence_parallelism(
        args, "DynamicBatchRewardTrainer", "a pair's loss is computed from whole rows in one pass"
    )
    refuse_model_parallelism(args, "DynamicBatchRewardTrainer")
