"""``AsyncGRPOTrainer``'s loss, per sample, over an optimizer step's stock slices (torch layer).

TRL 1.16's ``AsyncGRPOTrainer.compute_loss`` takes, per trained token, the clipped PPO term
``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`` with ``r = exp(log p - log p_old)`` (the generator's log-probs;
no KL term, no reference model), sums it over a micro-batch and divides by the micro-batch's global trained tokens per
process and by the accumulation steps: each process's loss is its tokens' sum times ``processes / N_m / GA``
(``N_m`` the micro-batch's trained tokens over all processes), which the data-parallel gradient average turns into
``sum / N_m / GA``. A token's weight depends only on its micro-batch (its stock *slice*), not on the process. That is
GRPO's ``dapo`` normalisation with ``N_m`` as ``num_items_in_batch`` and one accumulation step per generation round,
so the per-token loss and each sample's weight are GRPO's (:func:`~hf_dynbsz.execution.loss.per_token_policy_loss`,
:func:`~hf_dynbsz.execution.loss.sample_weights`): the sum over any partition of the step's samples into passes, on
any processes, is stock's loss. Stock's step (``async_step="stock"``): each micro-batch a slice. The samples-defined
step (``"samples"``): the whole optimizer step one slice, ``GA`` 1 (stock's fixed-count mode with the step in one
micro-batch per process, whatever the budget and however the step is written: ``16 x 1`` or ``8 x 2``).

Stock's metrics of each micro-batch (``ratio``, ``kl``: the ``(r - 1) - log r`` estimate, ``entropy``, the clip
ratios' means, ``clip_ratio/low_min`` and ``clip_ratio/high_max`` over the samples) are each slice's token means and
sample extremes: :class:`~hf_dynbsz.execution.metrics.StepMetrics` over the step's slices.

An MoE model's router aux loss is stock's over its packed row, where a position its samples share (a prompt, a tool
block, a forked history) routes once: over the step's samples on a process, each position weighs its share of the
prefix-trie node holding it (:func:`position_shares`), so the aux loss of the plugin's passes is that of the process's
step as one packed row, stock's fixed-count step exactly where the process's row is stock's (one process, or one
accumulation step).
"""

from __future__ import annotations

import torch

from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.loss import LossSettings, microbatch_loss, sample_weights
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.step_loss import LogProbLoss

__all__ = [
    "AsyncGRPOLoss",
    "METRIC_KEYS",
    "async_loss_settings",
    "async_pass_loss",
    "async_sample_weights",
    "position_shares",
]

#: The per-token tensors of a pass that stock's logged metrics read, besides the entropy (see the module).
METRIC_KEYS = ("ratio", "kl", "clip_ratio/low", "clip_ratio/high")


def async_loss_settings(trainer) -> LossSettings:
    """The async trainer's loss as GRPO's ``dapo`` loss: its clipping epsilons, no KL term, token-level ratios, no
    importance-sampling correction or off-policy mask."""
    return LossSettings(
        loss_type="dapo",
        beta=0.0,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=None,
        importance_sampling_level="token",
        off_policy_mask_threshold=None,
        use_bias_correction_kl=False,
        vllm_importance_sampling=False,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.0,
        vespo=(1.0, 1.0, 1.0, 1.0),
        max_completion_length=trainer.args.max_completion_length,
    )


def async_sample_weights(
    settings: LossSettings, batch: StepBatch, num_processes: int, gradient_accumulation_steps: int = 1
) -> torch.Tensor:
    """``(samples,)`` float64: every sample's weight, ``processes / N / gradient_accumulation_steps`` with ``N`` the
    trained tokens over all processes of its stock slice (``batch.num_items``: its micro-batch's for stock's step,
    the step's for the samples-defined step, with ``gradient_accumulation_steps`` 1), whatever pass or process it
    trains in. As stock, ``N / processes`` counts as at least 1 (its ``tokens_per_rank.clamp(min=1.0)``)."""
    policy, _ = sample_weights(
        settings,
        batch.loss_tokens,
        batch.slice_ids,
        batch.slice_rows,
        batch.num_items.double().clamp(min=float(num_processes)),
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=1,
        num_processes=num_processes,
    )
    return policy


def async_pass_loss(
    settings: LossSettings, per_token_logps: torch.Tensor, entropies: torch.Tensor, rows: SampleRows
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One pass's loss (with gradient) and the per-token tensors of :data:`METRIC_KEYS` (``(rows, width)``)."""
    loss, metrics = microbatch_loss(settings, per_token_logps, entropies, rows)
    log_ratio = (per_token_logps - rows.per_token["old_per_token_logps"]).detach()
    ratio = torch.exp(log_ratio)
    metrics["ratio"] = ratio
    metrics["kl"] = (ratio - 1) - log_ratio
    return loss, metrics


def position_shares(table: SequenceTable, slice_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per sample of ``table``, each position's share of its node in the prefix trie (keyed as stock's ``TreeRow``:
    a token and the next) of the samples of its stock slice (``slice_ids``; None: all of ``table``'s samples are one
    slice): 1 / the samples holding it (float64, one per token)."""
    if slice_ids is None:
        return _trie_shares(table)
    shares: list[torch.Tensor | None] = [None] * len(table)
    for slice_id in slice_ids.unique().tolist():
        members = (slice_ids == slice_id).nonzero().flatten().tolist()
        part = SequenceTable(
            tokens=[table.tokens[i] for i in members],
            prompt_lengths=table.prompt_lengths[members],
            completion_lengths=table.completion_lengths[members],
        )
        for i, share in zip(members, _trie_shares(part)):
            shares[i] = share
    return shares


def _trie_shares(table: SequenceTable) -> list[torch.Tensor]:
    tree = table.prefix_tree("tree")
    paths = tree.paths()
    holders = [0] * tree.nodes
    for path in paths:
        for node in path:
            holders[node] += 1
    return [
        torch.cat([torch.full((tree.length[node],), 1.0 / holders[node], dtype=torch.float64) for node in path])
        for path in paths
    ]


class AsyncGRPOLoss(LogProbLoss):
    """``AsyncGRPOTrainer``'s loss: the clipped token loss against the generator's log-probs, every sample weighted
    ``processes / N / GA`` with ``N`` the trained tokens of its stock slice (:mod:`hf_dynbsz.execution.async_loss`):
    for stock's step (``async_step="stock"``) each micro-batch is a slice, normalised by its own tokens and ``GA``, as
    stock; for the samples-defined step the optimizer step is one slice (``GA`` 1). Its metrics (ratio, kl, entropy,
    clip ratios) logged once per slice, as stock logs them per micro-batch. No entropy term, no reference model."""

    phases = ("train", "logprob", "generation")  # generation: waiting for the rollout queue
    metric_keys = METRIC_KEYS

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.settings = async_loss_settings(trainer)
        self.stock_slices = getattr(trainer.args, "async_step", "stock") != "samples"

    def _accumulation(self, gradient_accumulation_steps: int) -> int:
        return gradient_accumulation_steps if self.stock_slices else 1

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        ga = self._accumulation(gradient_accumulation_steps)
        batch.policy_weights = async_sample_weights(self.settings, batch, self.num_processes, ga)
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def pass_loss(self, state: None, per_token_logps, entropies, rows: SampleRows):
        return async_pass_loss(self.settings, per_token_logps, entropies, rows)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss  # AsyncGRPOTrainer scales its loss for gradient accumulation itself (loss_is_scaled_for_ga)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        # each slice is one packed row per process (stock's TreeRow): a position its samples share counts once
        slices = batch.slice_ids if self.stock_slices else None
        return self._accumulation(gradient_accumulation_steps), position_shares(batch.table, slices)
