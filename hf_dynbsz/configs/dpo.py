"""``DynamicBatchDPOConfig``: TRL's ``DPOConfig`` plus the plugin's settings, and what a DPO run
refuses of the settings stock accepts (:func:`refuse_dpo_settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig

from hf_dynbsz.configs.shared import (
    DynamicBatchFields,
    config_doc,
    refuse_model_parallelism,
    refuse_sequence_parallelism,
)

__all__ = ["DynamicBatchDPOConfig", "refuse_dpo_sequence_parallelism", "refuse_dpo_settings"]


@dataclass
class DynamicBatchDPOConfig(DynamicBatchFields, DPOConfig):
    __doc__ = config_doc("DPO")

    def _dynbsz_before_stock(self) -> None:
        # No generation round and no GRPO settings: after the environment, the refusals, then only TRL's own
        # DPOConfig.__post_init__ and the plugin's fields (max_tokens_per_microbatch_logprob: the reference's budget).
        refuse_dpo_settings(self)


def refuse_dpo_sequence_parallelism(args) -> None:
    """``sequence_parallel_size`` > 1 on a DPO run: refused before any work (a pair's loss is computed in one pass of
    whole rows)."""
    refuse_sequence_parallelism(args, "DynamicBatchDPOTrainer", "a pair's loss is computed from whole rows in one pass")


def refuse_dpo_settings(args) -> None:
    """What ``DynamicBatchDPOTrainer`` does not reproduce of the settings stock accepts, refused before any work:
    ``sequence_parallel_size`` > 1; a ``parallelism_config`` with context, sequence or tensor parallelism
    (:func:`~hf_dynbsz.configs.shared.refuse_model_parallelism`); ``hinge`` among
    the loss types with ``use_weighting`` (stock TRL 1.16 fails in its first backward: it scales hinge's relu output in
    place, which the relu's backward needs; stock's error, raised at start)."""
    refuse_dpo_sequence_parallelism(args)
    refuse_model_parallelism(args, "DynamicBatchDPOTrainer")
    loss_types = getattr(args, "loss_type", None) or []
    loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    if "hinge" in loss_types and getattr(args, "use_weighting", False):
        raise ValueError(
            f"loss_type={loss_types} with use_weighting=True: stock DPOTrainer (TRL 1.16) fails in its first backward "
            "on it (it scales the hinge loss by the WPO weights in place, over the relu output its backward needs), "
            "so DynamicBatchDPOTrainer refuses it before any work. Set use_weighting=False, or take 'hinge' out of "
            "loss_type."
        )
