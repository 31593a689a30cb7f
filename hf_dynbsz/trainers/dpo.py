"""``DynamicBatchDPOTrainer``: TRL's ``DPOTrainer`` with token-budget passes over each optimizer step's preference
pairs (a pair's chosen and rejected in one pass under one copy of their prompt), the reference's no-grad passes with
a budget of their own, and stock's losses per pair (:class:`~hf_dynbsz.execution.step_loss.DPOLoss`).

Hooks: those of :class:`~hf_dynbsz.trainers.hooks.TokenBudgetHooks` (``__init__``, ``store_flos``) and:

* ``training_step``: collect the optimizer step's micro-batches (stock's collated ``[chosen ; rejected]`` rows, moved to
  the device by the Trainer's ``_prepare_inputs``) inside stock's activation-offloading context; run the step's
  passes on its last call. With dynamic batching off (or a run the passes do not repack, logged once at start) stock's
  ``training_step`` runs.

A DPO run generates nothing, so there is no generation to chunk. Evaluation (``prediction_step``) is stock's.
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers import Trainer
from trl import DPOTrainer

from hf_dynbsz.config import DynamicBatchDPOConfig
from hf_dynbsz.execution.dpo_loss import dpo_step_batch
from hf_dynbsz.execution.step_loss import DPOLoss
from hf_dynbsz.trainers.hooks import TokenBudgetHooks, stock_constructor

logger = logging.getLogger("hf_dynbsz")
#: the arguments DPOTrainer.training_step(*args, **kwargs) passes on to transformers' Trainer
TRAINER_TRAINING_STEP = inspect.signature(Trainer.training_step)


class DynamicBatchDPOTrainer(TokenBudgetHooks, DPOTrainer):
    """Drop-in replacement for :class:`trl.DPOTrainer` with token-budget passes over each optimizer step's pairs.

    Takes exactly stock's constructor arguments. Accepts a :class:`~hf_dynbsz.DynamicBatchDPOConfig` or a plain
    ``DPOConfig`` (the new fields then take their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    _dynbsz_config_class = DynamicBatchDPOConfig
    _dynbsz_loss_class = DPOLoss
    _dynbsz_algorithm = "DPO"
    _dynbsz_refuses_small_datasets = False  # stock trains a dataset of any size (its last micro-batch smaller)

    __init__ = stock_constructor(DPOTrainer)

    def _dynbsz_start(self) -> None:
        super()._dynbsz_start()
        executor = self._dynbsz
        if executor.enabled and executor.loss.blocker is not None:
            executor.enabled = False
            logger.warning("hf_dynbsz: dynamic batching is off, stock DPOTrainer math runs: %s.", executor.loss.blocker)

    def training_step(self, *args, **kwargs):
        # Override: collect the optimizer step's micro-batches; run the step's passes on its last call. Stock's
        # signature (its arguments are transformers' Trainer.training_step's, read by name from that signature).
        executor = self._dynbsz
        if not executor.enabled:
            with executor.tiles():
                return DPOTrainer.training_step(self, *args, **kwargs)
        arguments = TRAINER_TRAINING_STEP.bind(self, *args, **kwargs).arguments
        model, inputs = arguments["model"], arguments["inputs"]
        with self.maybe_activation_offload_context:
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            if not self._dynbsz_window:
                executor.meters.start()
            self._dynbsz_window.append(self._prepare_inputs(inputs))
            if not self.accelerator.sync_gradients:
                return torch.zeros((), device=self.accelerator.device)
            window, self._dynbsz_window = self._dynbsz_window, []
            return self._train_window(model, window)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its micro-batches: the pairs repacked (stock's slices if the self-check keeps no
        layout)."""
        executor, accelerator = self._dynbsz, self.accelerator
        long_rope = executor.capabilities.support.long_rope
        batch = dpo_step_batch(window, accelerator.process_index, accelerator.num_processes, long_rope)
        if executor.self_check(model, batch.table):
            return executor.train_step(model, batch)
        return executor.train_step_stock(model, window)
