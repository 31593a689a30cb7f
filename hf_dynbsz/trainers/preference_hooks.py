"""The hooks of the trainers whose micro-batches arrive collated (DPO, reward models, KTO), over the shared ones
(:mod:`hf_dynbsz.trainers.hooks`).

TRL hooks overridden here, and why:

* ``training_step``: stock's ``(*args, **kwargs)``, read by name; the window loop inside stock's activation-offloading
  context (stock's ``training_step`` with dynamic batching off).
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers import Trainer

from hf_dynbsz.trainers.hooks import TokenBudgetHooks

logger = logging.getLogger("hf_dynbsz")

#: the arguments a preference trainer's training_step(*args, **kwargs) passes on to transformers' Trainer
TRAINER_TRAINING_STEP = inspect.signature(Trainer.training_step)


class PreferenceHooks(TokenBudgetHooks):
    """The hooks of a trainer whose micro-batches arrive collated (DPO, reward models, KTO: nothing is generated, a
    dataset of any size trains): ``training_step`` takes stock's ``(*args, **kwargs)`` (the arguments of transformers'
    ``Trainer.training_step``, read by name) and runs the window loop inside stock's activation-offloading context;
    a call's inputs are stock's collated micro-batch, on the device. At start, a loss's ``blocker`` (what its passes
    do not repack) turns the run to stock's micro-batches with one logged reason; at the first step, so does a
    collator that adds model inputs (:meth:`_dynbsz_added_inputs`)."""

    _dynbsz_refuses_small_datasets = False
    #: the keys of stock's collated micro-batches that the passes read; None: not checked (a custom collator is the
    #: loss's blocker already)
    _dynbsz_collated_keys: frozenset[str] | None = None

    def _dynbsz_start(self) -> None:
        super()._dynbsz_start()
        executor = self._dynbsz
        self._dynbsz_inputs_checked = self._dynbsz_collated_keys is None  # (read at the first step)
        if executor.enabled and executor.loss.blocker is not None:
            executor.enabled = False
            logger.warning("hf_dynbsz: %s: %s.", self._dynbsz_stock_math, executor.loss.blocker)

    @property
    def _dynbsz_stock_math(self) -> str:
        stock = next(base for base in type(self).__mro__ if not issubclass(base, TokenBudgetHooks))
        return f"dynamic batching is off, stock {stock.__name__} math runs"

    def training_step(self, *args, **kwargs):
        # Override: collect the optimizer step's micro-batches; run the step's passes on its last call.
        if not self._dynbsz.enabled:
            with self._dynbsz.tiles():
                return super(TokenBudgetHooks, self).training_step(*args, **kwargs)  # TRL's trainer's
        arguments = TRAINER_TRAINING_STEP.bind(self, *args, **kwargs).arguments
        with self.maybe_activation_offload_context:
            return self._dynbsz_window_call(arguments["model"], arguments["inputs"])

    def _dynbsz_collect(self, inputs) -> dict:
        return self._prepare_inputs(inputs)

    def _dynbsz_added_inputs(self, model, window: list[dict]) -> torch.Tensor | None:
        """At the first step: a collator that adds model inputs (keys beyond :attr:`_dynbsz_collated_keys`, on any
        process: a subclass of stock's collator) turns the run to stock's micro-batches from this step on, with one
        logged reason; returns this step's loss then, else None."""
        if self._dynbsz_inputs_checked:
            return None
        self._dynbsz_inputs_checked = True
        executor = self._dynbsz
        extra = sorted({key for inputs in window for key in inputs} - self._dynbsz_collated_keys)
        if not executor.world.all_reduce_max([int(bool(extra))])[0]:  # every process decides alike
            return None
        executor.enabled = False  # the next steps: stock's training_step
        collator = type(self.data_collator).__name__
        return executor.train_step_stock(model, window, (
            f"{self._dynbsz_stock_math}: the data collator ({collator}) adds model inputs the passes do not read "
            f"({', '.join(extra) or 'on another process'}), which stock passes to the model"
        ))  # fmt: skip
