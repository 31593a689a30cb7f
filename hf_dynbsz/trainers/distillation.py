"""``DynamicBatchDistillationTrainer``: TRL's ``DistillationTrainer`` with token-budget passes for the student and
no-grad passes with a budget of their own for the teacher (its loss, :class:`~hf_dynbsz.execution.distillation_loss.
DistillationLoss`, holds the teacher), stock's divergence and normalisation.

Hooks: those of :class:`~hf_dynbsz.trainers.hooks.TokenBudgetHooks` (``__init__``, ``training_step``,
``store_flos``; a distillation has no log-prob passes) and ``_generate_single_turn``, to generate a device's samples in
chunks (a distillation's takes ``has_tool_images`` and returns the completion ids alone).
"""

from __future__ import annotations

from trl import DistillationTrainer

from hf_dynbsz.configs.distillation import DynamicBatchDistillationConfig
from hf_dynbsz.execution.distillation_loss import DistillationLoss
from hf_dynbsz.trainers.hooks import TokenBudgetHooks


class DynamicBatchDistillationTrainer(
    TokenBudgetHooks,
    DistillationTrainer,
    config=DynamicBatchDistillationConfig,
    loss=DistillationLoss,
    algorithm="Distillation",
):
    """Drop-in replacement for TRL's ``DistillationTrainer``: the student's and the teacher's passes by budgets."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        # Override: bound generation memory by generating this device's samples in chunks.
        chunks = self._generation_chunks(prompt_ids, images, multimodal_fields)
        if chunks is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        completion_ids = []
        for chunk in chunks:
            completion_ids.extend(super()._generate_single_turn(chunk, None, multimodal_fields, has_tool_images))
        return completion_ids
