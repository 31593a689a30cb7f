"""``DynamicBatchKTOConfig``: TRL's ``KTOConfig`` plus the plugin's settings, and what a KTO run refuses of the
settings stock accepts (:func:`refuse_kto_settings`). A KTO run has no generation round: after the ``DIFFU_*``
environment only TRL's own ``KTOConfig.__post_init__`` and the plugin's fields apply
(``max_tokens_per_microbatch_logprob`` sizes the no-grad passes: the policy's over the KL sequences, the reference's
over both sets)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import KTOConfig

from hf_dynbsz.configs.shared import (
    DynamicBatchFields,
    config_doc,
    refuse_model_parallelism,
    refuse_sequence_parallelism,
)

__all__ = ["DynamicBatchKTOConfig", "refuse_kto_settings"]


@dataclass
class DynamicBatchKTOConfig(DynamicBatchFields, KTOConfig):
    __doc__ = config_doc("KTO")

    def _dynbsz_before_stock(self) -> None:
        refuse_kto_settings(self)


def refuse_kto_settings(args) -> None:
    """What ``DynamicBatchKTOTrainer`` does not run, refused before any work: ``sequence_parallel_size`` > 1 (a
    sequence's loss is computed from its whole row in one pass) and a ``parallelism_config`` with context, sequence or
    tensor parallelism (:func:`~hf_dynbsz.configs.shared.refuse_model_parallelism`)."""
    refuse_sequence_parallelism(
        args, "DynamicBatchKTOTrainer", "a sequence's loss is computed from its whole row in one pass"
    )
    refuse_model_parallelism(args, "DynamicBatchKTOTrainer")
