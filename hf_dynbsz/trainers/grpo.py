"""``DynamicBatchGRPOTrainer``: TRL's ``GRPOTrainer`` with token-budget micro-batches and the same math.

Hooks: those of :class:`~hf_dynbsz.trainers.logprob_hooks.LogProbHooks` (``__init__``, ``training_step``, the no-grad
log-prob passes, ``store_flos``) and ``_generate_single_turn``, to generate a device's samples in chunks of
``per_device_generation_batch_size``.
"""

from __future__ import annotations

from trl import GRPOTrainer

from hf_dynbsz.configs.grpo import DynamicBatchGRPOConfig
from hf_dynbsz.execution.loss import GRPOLoss
from hf_dynbsz.trainers.logprob_hooks import LogProbHooks


class DynamicBatchGRPOTrainer(
    LogProbHooks, GRPOTrainer, config=DynamicBatchGRPOConfig, loss=GRPOLoss, algorithm="GRPO"
):
    """Drop-in replacement for :class:`trl.GRPOTrainer`: token-budget micro-batches, stock's loss for each loss type."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Override: bound generation memory by generating this device's samples in chunks.
        chunks = self._generation_chunks(prompt_ids, images, multimodal_fields)
        if chunks is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        completion_ids = []
        for chunk in chunks:
            chunk_ids, _ = super()._generate_single_turn(
                chunk, None, multimodal_fields, num_generations, has_tool_images
            )
            completion_ids.extend(chunk_ids)
        return completion_ids, None
