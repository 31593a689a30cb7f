"""``DynamicBatchDPOTrainer``: TRL's ``DPOTrainer`` with token-budget passes over each optimizer step's preference
pairs (a pair's chosen and rejected in one pass under one copy of their prompt), the reference's no-grad passes with
a budget of their own, and stock's losses per pair (:class:`~hf_dynbsz.execution.dpo_loss.DPOLoss`).

Hooks: those of :class:`~hf_dynbsz.trainers.preference_hooks.PreferenceHooks`
(``__init__``, ``store_flos``, ``training_step``:
the window loop over stock's collated micro-batches, stock's ``training_step`` with dynamic batching off) and:

* ``__init__``: refuses, before any work, ``aot`` / ``aot_unpaired`` on a model that drops out
  (:func:`refuse_sorted_loss_with_dropout`; the config's refusals: :func:`hf_dynbsz.configs.dpo.refuse_dpo_settings`).
* ``_train_window``: the pairs, or stock's micro-batches for a collator that adds model inputs.

A DPO run generates nothing, so there is no generation to chunk. Evaluation (``prediction_step``) is stock's.
"""

from __future__ import annotations

import logging

import torch
from trl import DPOTrainer

from hf_dynbsz.configs.dpo import DynamicBatchDPOConfig
from hf_dynbsz.execution.dpo_loss import DPOLoss, dpo_step_batch
from hf_dynbsz.trainers.preference_hooks import PreferenceHooks

logger = logging.getLogger("hf_dynbsz")


#: The keys of ``DataCollatorForPreference``'s micro-batches, all read by the passes (every other key stock passes to
#: the model as an input).
COLLATED_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


class DynamicBatchDPOTrainer(PreferenceHooks, DPOTrainer, config=DynamicBatchDPOConfig, loss=DPOLoss, algorithm="DPO"):
    """Drop-in replacement for :class:`trl.DPOTrainer` with token-budget passes over each optimizer step's pairs."""

    _dynbsz_collated_keys = COLLATED_KEYS

    def _dynbsz_start(self) -> None:
        super()._dynbsz_start()
        if self._dynbsz.enabled and self._dynbsz.loss.settings.coupled:
            refuse_sorted_loss_with_dropout(self.model, self.args)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its micro-batches: the pairs repacked (stock's slices if the self-check keeps no
        layout, or at the first step for a collator that adds model inputs)."""
        executor, accelerator = self._dynbsz, self.accelerator
        stock_loss = self._dynbsz_added_inputs(model, window)
        if stock_loss is not None:
            return stock_loss
        long_rope = executor.capabilities.support.long_rope
        batch = dpo_step_batch(window, accelerator.process_index, accelerator.num_processes, long_rope)
        if executor.self_check(model, batch.table):
            return executor.train_step(model, batch).loss
        return executor.train_step_stock(model, window)


#: torch's dropout modules (``p``: the probability of dropping an element), the ones TRL's ``disable_dropout`` zeroes
#: among them (``torch.nn.Dropout``).
DROPOUT_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)  # fmt: skip


def refuse_sorted_loss_with_dropout(model, args) -> None:
    """``aot`` / ``aot_unpaired`` on a model that drops out in training: refused before any work. The plugin sorts a
    micro-batch's pairs by log-ratios from a no-grad policy pass before the training passes, exact only when that pass
    repeats the training forward; dropout draws other masks in each. Dropout modules with ``p > 0`` (left by
    ``disable_dropout=False``) and attention dropout in the text config (``attention_dropout``, which transformers
    applies in the attention function and ``disable_dropout`` does not zero)."""
    loss_types = list(args.loss_type)
    modules = [
        f"{name} (p={module.p})"
        for name, module in model.named_modules()
        if isinstance(module, DROPOUT_MODULES) and module.p > 0
    ]
    if modules:
        fix = "Set disable_dropout=True" if not args.disable_dropout else "Set those modules' p to 0"  # (Dropout2d)
        raise ValueError(
            f"loss_type={loss_types} with disable_dropout={args.disable_dropout}: DynamicBatchDPOTrainer sorts a "
            "micro-batch's pairs by log-ratios from a separate no-grad pass, exact only when that pass repeats the "
            f"training forward, and this model drops out ({', '.join(modules[:3])}"
            f"{f' and {len(modules) - 3} more' if len(modules) > 3 else ''}). {fix}, or dynamic_batching=False for "
            "stock's passes."
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dropout = getattr(config, "attention_dropout", 0.0)
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        raise ValueError(
            f"loss_type={loss_types} with attention_dropout={dropout} in the model's config: DynamicBatchDPOTrainer "
            "sorts a micro-batch's pairs by log-ratios from a separate no-grad pass, exact only when that pass repeats "
            "the training forward, and this model's attention drops out in training (disable_dropout does not zero "
            "attention_dropout). Set the model config's attention_dropout=0, or dynamic_batching=False for stock's "
            "passes."
        )
