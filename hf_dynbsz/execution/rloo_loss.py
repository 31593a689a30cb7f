"""RLOO's loss per sample with stock's weights, and its metrics per stock slice (torch layer, no trainer state).

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
Trainer averages the entries of a logging step; :class:`SliceMetrics` keeps per stock slice the sums those figures
are made of and reduces them once per optimizer step, so the logged values are stock's whatever the passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_dynbsz.execution.batch import SampleRows
from hf_dynbsz.execution.metrics import SliceSums

__all__ = ["RLOOSettings", "SliceMetrics", "rloo_pass_loss", "rloo_sample_weights"]

#: per stock slice, what stock's logged figures are made of: sequences, low-clipped, high-clipped, entropy x mask,
#: mask tokens
_SLICE_COLUMNS = 5


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
    clipped loss times its weight; and the ``(rows,)`` tensors :class:`SliceMetrics` reads."""
    logps = (per_token_logps * rows.mask).sum(1)
    coef_1 = torch.exp(logps - rows.per_token["old_logps"].squeeze(1))
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    advantages = rows.advantages
    per_sequence_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss = (per_sequence_loss * rows.policy_weights.to(per_sequence_loss.dtype)).sum()
    metrics = {
        "clip_ratio/low": ((coef_1 < 1 - settings.epsilon_low) & (advantages < 0)).float(),
        "clip_ratio/high": ((coef_1 > 1 + settings.epsilon_high) & (advantages > 0)).float(),
        "slice_ids": rows.slice_ids,
    }
    return loss, metrics


class SliceMetrics(SliceSums):
    """:class:`~hf_dynbsz.execution.metrics.StepMetrics` (passes, tokens, time, memory) with stock RLOOTrainer's loss
    metrics, per stock slice (:class:`~hf_dynbsz.execution.metrics.SliceSums`).

    Per slice ``k`` (over every process) it logs ``entropy`` (entropy x mask over mask tokens),
    ``clip_ratio/low_mean``, ``high_mean`` and ``region_mean`` (clipped sequences over sequences),
    ``clip_ratio/low_min`` and ``high_max`` (the extremes of the sequences' 0/1 flags: 1 when every, or any, sequence
    was clipped).
    """

    columns = _SLICE_COLUMNS

    def add_pass(
        self,
        real_tokens: int,
        computed_tokens: int,
        loss_metrics: dict[str, torch.Tensor],
        entropies: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """One real pass: its token counts, and its samples' figures into their stock slices (no host sync)."""
        self.count_pass(real_tokens, computed_tokens)
        mask = mask.to(entropies.dtype)
        low, high = loss_metrics["clip_ratio/low"], loss_metrics["clip_ratio/high"]
        figures = torch.stack([torch.ones_like(low), low, high, (entropies * mask).sum(1), mask.sum(1)], dim=1)
        self.add_to_slices(loss_metrics["slice_ids"], figures)

    def slice_entries(self, store: dict[str, list], figures: list[float]) -> None:
        sequences, low, high, entropy, tokens = figures
        sequences = max(sequences, 1.0)
        store["entropy"].append(entropy / max(tokens, 1.0))
        store["clip_ratio/low_mean"].append(low / sequences)
        store["clip_ratio/low_min"].append(float(low == sequences))
        store["clip_ratio/high_mean"].append(high / sequences)
        store["clip_ratio/high_max"].append(float(high > 0))
        store["clip_ratio/region_mean"].append((low + high) / sequences)
