"""RLOO's loss per sample with stock's weights, and what its logged metrics read (torch layer, no trainer state).

TRL 1.16's ``RLOOTrainer._compute_loss`` scores each fixed slice of ``B`` samples by a clipped ratio of *summed*
log-probs, one per sequence:

====================  ==========================================================================================
quantity              stock, per slice
====================  ==========================================================================================
sequence log-prob     logps_i = sum_t logp_it m_it   (m: the completion mask)
ratio                 r_i = exp(logps_i - old_logps_i)   (old_logps_i: summed in TRL's no-grad pass at generation)
sequence loss         l_i = -min(r_i A_i, clip(r_i, 1 - epsilon, 1 + epsilon_high) A_i)
slice loss            mean_i l_i + coef aux(slice), divided by GA by the Trainer (``loss_is_scaled_for_ga`` False)
weight of sample i    1 / (B GA)
====================  ==========================================================================================

B = rows of the slice, GA = ``current_gradient_accumulation_steps``. The weight depends on the slice alone, so any
repacking of an optimizer step's samples sums to stock's loss and gradient; the router aux term (the same
``coef aux / GA`` as GRPO's) is :mod:`hf_dynbsz.execution.router_loss`'s. ``tests/test_rloo_loss.py`` evaluates the
weight row of this table against :func:`rloo_sample_weights` and the loss against stock's ``_compute_loss``.

Stock logs ``entropy`` and the clip ratios once per slice, over that slice of every process (its gathers), and the
Trainer averages the entries of a logging step; :class:`hf_dynbsz.execution.metrics.StepMetrics` keeps per stock
slice the sums those figures are made of (GRPO's the same way) and reduces them once per optimizer step, so the
logged values are stock's whatever the passes. Each sequence's clip flags are one value per sequence
(:data:`METRIC_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.step_loss import LogProbLoss

__all__ = ["METRIC_KEYS", "RLOOLoss", "RLOOSettings", "rloo_pass_loss", "rloo_sample_weights"]

#: The tensors :func:`rloo_pass_loss` gives for stock's logged metrics, besides the entropy: each sequence's clip flags.
METRIC_KEYS = ("clip_ratio/low", "clip_ratio/high")


@dataclass(frozen=True)
class RLOOSettings:
    """The clipping bounds an ``RLOOTrainer`` holds (``epsilon``, ``epsilon_high`` or ``epsilon``), read once."""

    epsilon_low: float
    epsilon_high: float

    @classmethod
    def from_trainer(cls, trainer) -> RLOOSettings:
        return cls(epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high)


def rloo_sample_weights(
    slice_ids: torch.Tensor, slice_rows: torch.Tensor, *, gradient_accumulation_steps: int
) -> torch.Tensor:
    """``(N,)`` float64 weights ``1 / (B GA)``: ``slice_ids`` (N,) the stock slice of each sample, ``slice_rows`` (S,)
    the rows of each slice."""
    return 1.0 / (slice_rows.double()[slice_ids] * float(gradient_accumulation_steps))


def rloo_pass_loss(
    settings: RLOOSettings, per_token_logps: torch.Tensor, rows: SampleRows
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one pass's samples (``per_token_logps``: completion-aligned ``(rows, width)``), each sequence's
    clipped loss times its weight; and the ``(rows,)`` clip flags stock logs (:data:`METRIC_KEYS`)."""
    logps = (per_token_logps * rows.mask).sum(1)
    coef_1 = torch.exp(logps - rows.per_token["old_logps"].squeeze(1))
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    advantages = rows.advantages
    per_sequence_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss = (per_sequence_loss * rows.policy_weights.to(per_sequence_loss.dtype)).sum()
    metrics = {
        "clip_ratio/low": ((coef_1 < 1 - settings.epsilon_low) & (advantages < 0)).float(),
        "clip_ratio/high": ((coef_1 > 1 + settings.epsilon_high) & (advantages > 0)).float(),
    }
    return loss, metrics


class RLOOLoss(LogProbLoss):
    """``RLOOTrainer``'s loss: each sequence's clipped ratio of summed log-probs, weight ``1 / (B GA)``
    (:mod:`hf_dynbsz.execution.rloo_loss`); its entropy and clip ratios logged per stock slice, as GRPO's loss
    metrics (:class:`~hf_dynbsz.execution.metrics.StepMetrics`). No entropy term."""

    metric_keys = METRIC_KEYS

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.settings = RLOOSettings.from_trainer(trainer)

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        batch.policy_weights = rloo_sample_weights(
            batch.slice_ids, batch.slice_rows, gradient_accumulation_steps=gradient_accumulation_steps
        )
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def pass_loss(self, state: None, per_token_logps, entropies, rows: SampleRows):
        return rloo_pass_loss(self.settings, per_token_logps, rows)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss / gradient_accumulation_steps  # the Trainer divides RLOO's loss (loss_is_scaled_for_ga False)
