"""``DynamicBatchRewardTrainer``: TRL's ``RewardTrainer`` with token-budget passes over each optimizer step's preference
pairs (a pair's chosen and rejected in one padding-free pass under one copy of their prompt, each sequence's reward
read at its own last token) and stock's Bradley-Terry loss per pair (:class:`~hf_dynbsz.execution.reward_loss.
RewardLoss`).

Hooks: those of :class:`~hf_dynbsz.trainers.preference_hooks.PreferenceHooks`
(``__init__``, ``store_flos``, ``training_step``:
the window loop over stock's collated micro-batches, stock's ``training_step`` with dynamic batching off) and
``_train_window``.

The run's self-check is the reward model's own (the log-prob check does not apply): at the first step, a few pairs'
rewards from a pass in the run's layout against each sequence alone
(:func:`~hf_dynbsz.execution.reward_loss.check_rewards`); where they differ stock's micro-batches run, with one logged
reason. Evaluation (``prediction_step``) is stock's.
"""

from __future__ import annotations

import logging

import torch
from trl import RewardTrainer

from hf_dynbsz.configs.reward import DynamicBatchRewardConfig
from hf_dynbsz.execution.reward_loss import RewardLoss, check_rewards, reward_step_batch
from hf_dynbsz.trainers.preference_hooks import PreferenceHooks

logger = logging.getLogger("hf_dynbsz")


class DynamicBatchRewardTrainer(
    PreferenceHooks, RewardTrainer, config=DynamicBatchRewardConfig, loss=RewardLoss, algorithm="Reward"
):
    """Drop-in replacement for :class:`trl.RewardTrainer` with token-budget passes over each optimizer step's pairs.

    Takes exactly stock's constructor arguments. Accepts a :class:`~hf_dynbsz.DynamicBatchRewardConfig` or a plain
    ``RewardConfig`` (the new fields then take their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    def _dynbsz_start(self) -> None:
        super()._dynbsz_start()
        self._dynbsz.checked = not self.args.self_check  # the check is the reward model's own (check_rewards)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its micro-batches: the pairs repacked (stock's micro-batches if the self-check of
        the first step fails)."""
        executor, accelerator = self._dynbsz, self.accelerator
        long_rope = executor.capabilities.support.long_rope
        pad_token_id = self.processing_class.pad_token_id
        rank, processes = accelerator.process_index, accelerator.num_processes
        batch = reward_step_batch(window, pad_token_id, rank, processes, long_rope)
        if not executor.checked:
            executor.checked = True
            failure = check_rewards(executor, model, batch)
            if failure is not None:
                executor.enabled = False
                reason = f"{self._dynbsz_stock_math}: {failure}"
                return executor.train_step_stock(model, window, reason)
        return executor.train_step(model, batch).loss
