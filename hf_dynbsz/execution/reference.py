"""A DPO or KTO run's reference: each sample's reference sequence log-prob, from no-grad passes with a budget of their
own (torch layer).

Stock ``DPOTrainer`` runs the reference inside each training micro-batch, over the same padded ``[chosen ; rejected]``
rows (each pair's prompt twice), under no grad: the ``ref_model`` it holds (a DeepSpeed engine under ZeRO, FSDP's
module, or the accelerator's evaluation-mode model), or with PEFT and no ``ref_model`` the policy with its adapter
disabled (TRL's ``use_adapter``: the ``"ref"`` adapter when the model came with one). With
``precompute_ref_log_probs`` the dataset carries each pair's reference log-probs (stock computed them at start) and
no reference runs during training.

Here the reference runs before the step's training passes, over the step's samples, in the executor's no-grad
log-prob passes (:meth:`~hf_dynbsz.execution.executor.PassExecutor.no_grad_passes`, kind ``"logprob"``: the budget
``max_tokens_per_microbatch_logprob``, padding-free rows with each prompt once, balanced across processes, lockstep
dummy passes on the reference model), and each sample's sequence log-prob is summed on the process that owns it as
stock sums it (:func:`~hf_dynbsz.execution.dpo_loss.sequence_logps`, LD-DPO's weights included). A token's log-prob
depends on its own sequence alone (the self-check compares each layout with the sample alone on the reference model
too), so the values are stock's whatever the passes.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import is_peft_model

from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.metrics import count_train_tokens

__all__ = ["Reference", "ReferenceLoss", "sequence_logps"]


class Reference:
    """The reference of a ``DPOTrainer``: ``model`` the prepared reference model (None where stock has none: PEFT's
    adapter-disabled policy, or precomputed log-probs), ``precomputed`` whether the dataset carries them."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.model = trainer.ref_model
        self.precomputed = bool(trainer.precompute_ref_logps)
        self.adapter = self.model is None and is_peft_model(trainer.model)

    @contextlib.contextmanager
    def _as_reference(self, policy):
        """Around the passes of the policy as its own reference (PEFT): its adapter disabled (the ``"ref"`` adapter
        active when the model has one) and gradient checkpointing off, as stock's reference forward."""
        from trl.models.utils import disable_gradient_checkpointing
        from trl.trainer.utils import use_adapter

        unwrapped = self.trainer.accelerator.unwrap_model(policy)
        name = "ref" if "ref" in unwrapped.peft_config else None
        with use_adapter(unwrapped, adapter_name=name):
            with disable_gradient_checkpointing(self.trainer.model, self.trainer.args.gradient_checkpointing_kwargs):
                yield

    @torch.no_grad()
    def per_token(self, executor, policy, table, width: int, stock_tokens: int) -> torch.Tensor:
        """``(samples, width)``: the reference's completion log-probs of every sample of ``table`` (a
        :class:`~hf_dynbsz.execution.packing.SequenceTable` of this process's samples), from its no-grad passes
        (``stock_tokens``: the padded tokens of stock's largest micro-batch over them)."""
        model = policy if self.adapter else self.model
        context = self._as_reference(policy) if self.adapter else contextlib.nullcontext()
        with context:
            per_token, _, _ = executor.no_grad_passes(model, table, width, False, stock_tokens)
        return per_token

    @torch.no_grad()
    def logps(self, executor, policy, batch: StepBatch, ld_alpha: float | None) -> None:
        """Fill ``batch.per_token["ref_logps"]`` (samples, 1): each sample's reference sequence log-prob, from the
        reference's no-grad passes over ``batch``'s samples (this process's), or left as the dataset's precomputed
        values."""
        if self.precomputed:
            return
        per_token = self.per_token(executor, policy, batch.table, batch.width, batch.stock_microbatch_tokens)
        mask = batch.loss_mask.to(per_token.device)
        seq = sequence_logps(per_token, mask, batch.per_token["shared"].to(per_token.device), ld_alpha)
        batch.per_token["ref_logps"] = seq.float().unsqueeze(1).to(batch.per_token["ref_logps"].device)


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor, shared: torch.Tensor, ld_alpha: float | None):
    """``(rows,)`` sequence log-probs ``sum_t w_t logp_t`` of completion-aligned ``per_token`` over ``mask``: ``w_t`` 1,
    or with ``ld_alpha`` 1 over the first ``shared`` (rows, 1) tokens and ``ld_alpha`` after."""
    masked = per_token * mask.to(per_token.dtype)
    if ld_alpha is None:
        return masked.sum(1)
    positions = torch.arange(per_token.size(1), device=per_token.device).unsqueeze(0)
    inside = positions < shared.to(positions.dtype)
    return (masked * inside).sum(1) + ld_alpha * (masked * ~inside).sum(1)


class ReferenceLoss:
    """What ``DPOLoss`` (:mod:`hf_dynbsz.execution.dpo_loss`) and ``KTOLoss`` (:mod:`hf_dynbsz.execution.kto_loss`)
    share: a reference model's passes
    (:class:`~hf_dynbsz.execution.reference.Reference`), checked by the self-check beside the policy; stock's
    micro-batches' loss divided by the Trainer; ``num_tokens`` (what :meth:`attempt` counts) summed over processes once
    per step."""

    entropy_bonus = False
    needs_step_entropies = False
    phases = ("train", "logprob")
    checked_model_name = "reference"  # the self-check's log names the second model it checks

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.reference = Reference(trainer)
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes

    def finish(self, state: int, gradient_accumulation_steps: int) -> None:
        """Stock's ``num_tokens``: every process's real tokens of the step that stock counts (:meth:`attempt`: for DPO
        each pair's prompt twice, for KTO the samples, not the KL sequences), added up."""
        count_train_tokens(self.trainer, state, self.device)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        # the Trainer divides DPO's loss (loss_is_scaled_for_ga False) and KTO's (a micro-batch mean)
        return loss / gradient_accumulation_steps

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        return gradient_accumulation_steps, None  # stock's micro-batches: each sample's positions its own

    def checked_models(self, model) -> list[tuple[object, bool]]:
        reference = self.reference.model
        return [(model, True)] + (
            [(reference, False)] if reference is not None and not self.reference.precomputed else []
        )

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        executor.dummy_pass(model, last)
