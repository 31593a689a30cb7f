"""``DynamicBatchDistillationConfig``: TRL's ``DistillationConfig`` plus the plugin's settings and the teacher's
budget (``max_tokens_per_microbatch_teacher``)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DistillationConfig

from hf_dynbsz.configs.shared import DynamicBatchFields, config_doc, plugin_field, refuse_sequence_parallelism

__all__ = ["DynamicBatchDistillationConfig", "refuse_distillation_sequence_parallelism"]


@dataclass
class DynamicBatchDistillationConfig(DynamicBatchFields, DistillationConfig):
    __doc__ = config_doc("Distillation")

    max_tokens_per_microbatch_teacher: int | None = plugin_field("max_tokens_per_microbatch_teacher")

    def _dynbsz_before_stock(self) -> None:
        # No generation round to derive (one completion per prompt, generated once per optimizer step) and no GRPO
        # settings: after the environment only TRL's own DistillationConfig.__post_init__ and the plugin's fields.
        refuse_distillation_sequence_parallelism(self)


def refuse_distillation_sequence_parallelism(args) -> None:
    """``sequence_parallel_size`` > 1 on a distillation: refused before any work (the teacher's passes are not
    sharded); stock's own ``parallelism_config`` check (TRL's ``__post_init__``) refuses ``sp_size``."""
    refuse_sequence_parallelism(
        args,
        "DynamicBatchDistillationTrainer",
        "the teacher's passes are not sharded, and stock DistillationTrainer refuses sequence parallelism too",
    )
