"""``DynamicBatchKTOTrainer``: TRL's ``KTOTrainer`` with token-budget passes over each optimizer step's unpaired
samples, the KL sequences and the reference in no-grad passes with a budget of their own, each stock micro-batch's KL
estimate computed as stock computes it, and stock's loss per sample (:class:`~hf_dynbsz.execution.kto_loss.KTOLoss`).

Hooks: those of :class:`~hf_dynbsz.trainers.preference_hooks.PreferenceHooks`
(``__init__``, ``store_flos``, ``training_step``:
the window loop over stock's collated micro-batches, stock's ``training_step`` with dynamic batching off; a custom
collator or vision-language samples train stock's micro-batches, with one logged reason) and ``_train_window``.

A KTO run generates nothing, so there is no generation to chunk. Evaluation (``prediction_step``) is stock's.
"""

from __future__ import annotations

import torch
from trl import KTOTrainer

from hf_dynbsz.configs.kto import DynamicBatchKTOConfig
from hf_dynbsz.execution.kto_loss import COLLATED_KEYS, KTOLoss, kto_step_batch
from hf_dynbsz.trainers.preference_hooks import PreferenceHooks


class DynamicBatchKTOTrainer(PreferenceHooks, KTOTrainer, config=DynamicBatchKTOConfig, loss=KTOLoss, algorithm="KTO"):
    """Drop-in replacement for :class:`trl.KTOTrainer` with token-budget passes over each optimizer step's samples.

    Takes exactly stock's constructor arguments. Accepts a :class:`~hf_dynbsz.DynamicBatchKTOConfig` or a plain
    ``KTOConfig`` (the new fields then take their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    _dynbsz_collated_keys = COLLATED_KEYS

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its micro-batches: the samples repacked (stock's micro-batches if the self-check
        keeps no layout, or at the first step for a collator that adds model inputs)."""
        executor, accelerator = self._dynbsz, self.accelerator
        stock_loss = self._dynbsz_added_inputs(model, window)
        if stock_loss is not None:
            return stock_loss
        long_rope = executor.capabilities.support.long_rope
        kept = stock_gathered_processes(accelerator, len(window))
        batch = kto_step_batch(window, accelerator.process_index, accelerator.num_processes, long_rope, kept)
        if executor.self_check(model, batch.table):
            return executor.train_step(model, batch).loss
        return executor.train_step_stock(model, window)


def stock_gathered_processes(accelerator, micro_batches: int) -> list[int]:
    """Per micro-batch of the step ending now, how many processes' KL estimates stock's ``gather_for_metrics`` keeps:
    all of them, but at the end of the data (the step's last micro-batch is the dataloader's last) only the first
    ``remainder`` (accelerate's ``GradientState.remainder``, the samples of the data's last batch over every process,
    truncating the gathered per-process values as if they were samples)."""
    processes = accelerator.num_processes
    state = accelerator.gradient_state
    last = processes
    if state.end_of_dataloader and state.remainder > 0:
        last = min(processes, state.remainder)
    return [processes] * (micro_batches - 1) + [last]
