"""``DynamicBatchDistillationConfig``: TRL's ``DistillationConfig`` plus the plugin's settings and the teacher's
budget (:class:`DistillationFields`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DistillationConfig

from hf_dynbsz.configs.shared import DynamicBatchFields, config_doc, plugin_field, refuse_sequence_parallelism

__all__ = ["DistillationFields", "DynamicBatchDistillationConfig", "refuse_distillation_sequence_parallelism"]


@dataclass
class DistillationFields(DynamicBatchFields):
    """The plugin's fields of a distillation (:class:`~hf_dynbsz.configs.shared.DynamicBatchFields` and the teacher's
    budget) and their checks: a distillation has no generation round to derive (one completion per prompt, generated
    once per optimizer step) and no GRPO settings, so after the environment only TRL's own
    ``DistillationConfig.__post_init__`` and the plugin's fields apply."""

    max_tokens_per_microbatch_teacher: int | None = plugin_field("max_tokens_per_microbatch_teacher")

    def _dynbsz_before_stock(self) -> None:
        refuse_distillation_sequence_parallelism(self)


@dataclass
class DynamicBatchDistillationConfig(DistillationFields, DistillationConfig):
    pass


DynamicBatchDistillationConfig.__doc__ = config_doc("Distillation")


def refuse_distillation_sequence_parallelism(args) -> None:
    """``sequence_parallel_size`` > 1 on a distillation: refused before any work (the teacher's passes are not
    sharded); stock's own ``parallelism_config`` check (TRL's ``__post_init__``) refuses ``sp_size``."""
    refuse_sequence_parallelism(
        args,
        "DynamicBatchDistillationTrainer",
        "the teacher's passes are not sharded, and stock DistillationTrainer refuses sequence parallelism too",
    )
