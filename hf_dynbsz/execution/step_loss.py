"""The loss the pass executor trains with: the protocol every trainer's loss follows (torch layer).

Everything the executor does (the budget, the layouts, shared prompts, balancing, sequence parallelism, the memory
budget, out-of-memory recovery, the router aux loss) is the same for every trainer; what differs is each sample's
loss and weight, what a training pass computes, what the step needs before its passes, and the loss metrics stock
logs. :class:`StepLoss` is that part, and the executor holds one. Each trainer's loss lives with the rest of that
trainer's loss code:

* ``GRPOLoss`` in :mod:`hf_dynbsz.execution.loss`;
* ``RLOOLoss`` in :mod:`hf_dynbsz.execution.rloo_loss`;
* ``AsyncGRPOLoss`` in :mod:`hf_dynbsz.execution.async_loss`;
* ``DistillationLoss`` in :mod:`hf_dynbsz.execution.distillation_loss` (its teacher in
  :mod:`hf_dynbsz.execution.teacher`);
* ``DPOLoss`` in :mod:`hf_dynbsz.execution.dpo_loss` (its reference in :mod:`hf_dynbsz.execution.reference`).

:class:`LogProbLoss` is what the losses over the policy's completion log-probs share (GRPO's, RLOO's and the
asynchronous GRPO's). The trainer class names its loss (``_dynbsz_loss_class``);
:func:`hf_dynbsz.execution.setup.build_executor` builds it from the trainer after TRL's constructor.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.metrics import StepMetrics

__all__ = ["LogProbLoss", "StepLoss"]


class StepLoss(Protocol):
    """What the executor asks of a trainer's loss, per optimizer step (``state``: what one training attempt of the
    step carries from pass to pass, e.g. the entropy bonus's sums; None when the loss needs none)."""

    #: the loss has an entropy term (sequence parallelism does not run it)
    entropy_bonus: bool
    #: the step's weights need its per-token entropies, from one no-grad pass before the first training pass
    needs_step_entropies: bool
    #: the phases of a step's time the metrics publish (``dynbsz/<phase>_seconds``)
    phases: tuple[str, ...]

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        """Set ``batch``'s per-sample weights (and masks) to stock's, in place."""

    def prepare(self, executor, model, batch: StepBatch, *, gradient_accumulation_steps: int) -> None:
        """What the step's training passes need that other passes compute first (a distillation teacher's hidden
        states), into ``batch``."""

    def attempt(self, batch: StepBatch):
        """The state of one training attempt over ``batch`` (the samples this process runs)."""

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        """MiB the step's training passes over ``batch`` (this process's, ``rank`` in the scheduler's group) will hold
        that the process does not hold when they are planned (``schedule`` None before there is one): the memory
        model keeps room for it (:meth:`~hf_dynbsz.execution.executor.PassExecutor.run`'s ``reserve``)."""

    def metrics(self, batch: StepBatch) -> StepMetrics:
        """The metrics of one training attempt over ``batch``: stock's loss metrics, per stock slice, from the tensors
        :meth:`pass_loss` gives."""

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        """One training pass's forward over micro-batch ``mb`` (the samples ``rows`` of ``batch``): ``(values,
        entropies, router logits or None)``, the first two completion-aligned ``(rows, width)``: what
        :meth:`pass_loss` weighs (log-probs; a distillation's per-token divergence)."""

    def pass_loss(
        self, state, per_token_values: torch.Tensor, entropies: torch.Tensor, rows: SampleRows
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One pass's loss (with gradient) and the tensors its metrics read."""

    def finish(self, state, gradient_accumulation_steps: int) -> None:
        """Stock's bookkeeping at the optimizer-step boundary."""

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        """Stock's ``compute_loss`` of one slice as the Trainer backpropagates it (for steps that keep stock's
        slices)."""

    def checked_models(self, model) -> list[tuple[object, bool]]:
        """The models the self-check compares each layout on, each with whether its gradients are compared (the
        trained model; a distillation's teacher too, log-probs only)."""

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        """A lockstep training pass that runs what a real pass runs (under ZeRO-3 the same parameter gathers) and
        learns nothing (:meth:`~hf_dynbsz.execution.device_pass.DevicePass.dummy_pass`'s contract)."""

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        """The MoE router aux loss's divisor and per-position weights of ``batch``'s samples
        (:class:`~hf_dynbsz.execution.router_loss.RouterAuxLoss`: None counts a position once per sample holding
        it)."""


class LogProbLoss:
    """A loss over the policy's completion log-probs (GRPO's, RLOO's, async GRPO's): a training pass is the model's
    fused LM head over the pass's row, nothing precedes the passes, the self-check checks the policy; by default no
    entropy term, no state from pass to pass and stock's metrics of :attr:`metric_keys` per stock slice."""

    phases = ("train", "logprob", "generation")
    entropy_bonus = False
    needs_step_entropies = False
    #: the per-token tensors of a pass that stock's logged metrics read, besides the entropy
    metric_keys: tuple[str, ...] = ()

    def __init__(self, trainer) -> None:
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes

    def attempt(self, batch: StepBatch):
        return None  # no state carried from pass to pass

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device, self.metric_keys)

    def finish(self, state, gradient_accumulation_steps: int) -> None:
        return None  # no bookkeeping at the optimizer-step boundary

    def prepare(self, executor, model, batch: StepBatch, *, gradient_accumulation_steps: int) -> None:
        return None

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # what moved samples bring is a few values per token

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        return executor.forward(model, mb, True, router=router)

    def checked_models(self, model) -> list[tuple[object, bool]]:
        return [(model, True)]

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        executor.dummy_pass(model, last)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        return gradient_accumulation_steps, None  # stock's slices: a shared prompt counts for each of its samples
