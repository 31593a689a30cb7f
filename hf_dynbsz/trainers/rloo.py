"""``DynamicBatchRLOOTrainer``: TRL's ``RLOOTrainer`` with token-budget micro-batches and RLOO's own loss per sample.

Hooks: those of :class:`~hf_dynbsz.trainers.logprob_hooks.LogProbHooks` (``__init__``, ``training_step``, the no-grad
log-prob passes, ``store_flos``) and ``_generate_single_turn``, to generate a device's samples in chunks (RLOO's takes
no ``num_generations`` and returns the completion ids alone).
"""

from __future__ import annotations

from trl import RLOOTrainer

from hf_dynbsz.configs.rloo import DynamicBatchRLOOConfig
from hf_dynbsz.execution.rloo_loss import RLOOLoss
from hf_dynbsz.trainers.logprob_hooks import LogProbHooks


class DynamicBatchRLOOTrainer(
    LogProbHooks, RLOOTrainer, config=DynamicBatchRLOOConfig, loss=RLOOLoss, algorithm="RLOO"
):
    """Drop-in replacement for :class:`trl.RLOOTrainer`, its sequence-level loss in token-budget micro-batches."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        # Override: bound generation memory by generating this device's samples in chunks.
        chunks = self._generation_chunks(prompt_ids, images, multimodal_fields)
        if chunks is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        completion_ids = []
        for chunk in chunks:
            completion_ids.extend(super()._generate_single_turn(chunk, None, multimodal_fields))
        return completion_ids
