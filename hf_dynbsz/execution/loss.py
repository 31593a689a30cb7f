"""GRPO per-token loss with partition-invariant normalisation (torch layer, no trainer state).

Stock TRL 1.16 computes the loss of each fixed micro-batch ("slice") of ``per_device_train_batch_size``
samples and normalises it in a way that, for most loss types, depends on which samples share the slice.
Here every sample carries the weight it had in stock's fixed split, so any repacking of the same samples
into token-budget micro-batches sums to the same loss, and the same gradient. This module decides those
weights (:func:`sample_weights`); ``tests/test_loss.py`` evaluates the weight column of this table and checks
it against the code, and the code against stock's ``_compute_loss``:

================  ======================================================  =====================================
loss_type         stock slice loss                                        weight of sample i
================  ======================================================  =====================================
grpo, sapo        mean_i( sum_t l*m / max(1, n_i) ) / GA                  1 / (B * GA * max(1, n_i))
bnpo              sum_{i,t} l*m / max(1, sum_slice m) / GA                1 / (GA * max(1, n_slice))
dr_grpo           sum l*m / (B * max_completion_length) / GA              1 / (B * max_completion_length * GA)
dapo, cispo,      sum l*m / (N_items / P * GA / spg)                      P * spg / (max(1, N_items) * GA)
vespo
luspo             mean_i( sum_t l*m ) / GA                                1 / (B * GA)
entropy bonus     coef * sum_{i,t} H*e / max(1, sum_slice e) / GA         1 / (GA * max(1, e_slice))
================  ======================================================  =====================================

B = rows of the slice, GA = ``current_gradient_accumulation_steps``, n_i = loss tokens of sample i, n_slice =
loss tokens of its slice, N_items = loss tokens of the whole generation round over all P processes, spg =
``steps_per_generation``; the entropy bonus acts on the tokens e of ``effective_mask`` (loss mask x
``top_entropy_quantile``'s high-entropy mask), e_slice of them in the slice, for every loss type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOTrainer

from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.step_loss import LogProbLoss
from hf_dynbsz.parallel.collectives import reduce_sum

SEQUENCE_MEAN_LOSSES = ("grpo", "sapo")
GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")
#: Loss types with a clipped ratio (stock also logs clip_ratio/low_min and clip_ratio/high_max for them).
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclass(frozen=True)
class LossSettings:
    """The loss hyper-parameters a GRPOTrainer holds, read once."""

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    off_policy_mask_threshold: float | None
    use_bias_correction_kl: bool
    vllm_importance_sampling: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo: tuple[float, float, float, float]
    max_completion_length: int

    @classmethod
    def from_trainer(cls, trainer) -> LossSettings:
        args = trainer.args
        return cls(
            loss_type=trainer.loss_type,
            beta=trainer.beta,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            delta=args.delta,
            importance_sampling_level=trainer.importance_sampling_level,
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            use_bias_correction_kl=bool(args.use_bias_correction_kl),
            vllm_importance_sampling=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            max_completion_length=trainer.max_completion_length,
        )


def sample_weights(
    settings: LossSettings,
    loss_tokens: torch.Tensor,
    slice_ids: torch.Tensor,
    slice_rows: torch.Tensor,
    num_items_in_batch: torch.Tensor,
    *,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    num_processes: int,
    entropy_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample weights (policy term, entropy-bonus term) reproducing stock's per-slice normalisers.

    ``loss_tokens`` (N,): loss-mask tokens per sample; ``slice_ids`` (N,): index of the stock slice each
    sample came from; ``slice_rows`` (S,): rows per slice; ``num_items_in_batch`` (N,): the generation
    round's global loss-token count seen by each sample; ``entropy_tokens`` (N,): tokens the entropy bonus
    acts on (loss mask x high-entropy mask; default ``loss_tokens``). Returns two (N,) float64 tensors.
    """
    ga = float(gradient_accumulation_steps)
    loss_tokens = loss_tokens.double()

    def per_slice(tokens: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(len(slice_rows), dtype=torch.float64).index_add_(0, slice_ids, tokens.double())
        return totals[slice_ids].clamp(min=1.0)

    per_slice_tokens = per_slice(loss_tokens)
    rows = slice_rows.double()[slice_ids]
    kind = settings.loss_type
    if kind in SEQUENCE_MEAN_LOSSES:
        policy = 1.0 / (rows * ga * loss_tokens.clamp(min=1.0))
    elif kind == "bnpo":
        policy = 1.0 / (ga * per_slice_tokens)
    elif kind == "dr_grpo":
        policy = 1.0 / (rows * settings.max_completion_length * ga)
    elif kind in GLOBAL_TOKEN_LOSSES:
        items = num_items_in_batch.double().clamp(min=1.0)
        policy = 1.0 / (items / num_processes * ga / steps_per_generation)
    elif kind == "luspo":
        policy = 1.0 / (rows * ga)
    else:
        raise ValueError(f"Unknown loss type: {kind}")
    entropy = 1.0 / (ga * per_slice(loss_tokens if entropy_tokens is None else entropy_tokens))
    return policy, entropy


def per_token_policy_loss(
    settings: LossSettings,
    per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    ref_per_token_logps: torch.Tensor | None,
    sampling_per_token_logps: torch.Tensor | None,
    importance_sampling_ratio: torch.Tensor | None,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL 1.16 ``_compute_loss``'s per-token loss, before aggregation, for one micro-batch.

    All tensors are completion-aligned ``(rows, width)``; ``advantages`` is ``(rows,)`` or ``(rows, width)``;
    ``entropy_mask`` is the high-entropy token mask of ``top_entropy_quantile`` (None when off).
    Returns the per-token loss (broadcastable to ``(rows, width)``) and the tensors stock logs, named by
    :func:`metric_keys`: ``(rows, width)`` per token, ``(rows,)`` where stock's is one value per sequence.
    """
    # stock's clip flags are (B, 1), one per sequence, with sequence-level ratios and (B,) advantages
    per_sequence = settings.importance_sampling_level == "sequence" and advantages.dim() == 1
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()

    if settings.off_policy_mask_threshold is not None:
        if sampling_per_token_logps is None:
            sampling_per_token_logps = old_per_token_logps
        off_policy_mask = GRPOTrainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=sampling_per_token_logps,
            mask=mask,
            off_policy_threshold=settings.off_policy_mask_threshold,
        )

    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(_log_importance_weights(settings, log_ratio, mask))

    metrics: dict[str, torch.Tensor] = {}
    if settings.beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        metrics["kl"] = per_token_kl

    per_token_loss, coef_1 = _unmasked_policy_loss(
        settings, coef_1, advantages, per_token_logps, log_ratio, mask, importance_sampling_ratio, metrics
    )
    if settings.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if settings.vllm_importance_sampling and settings.loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if settings.beta != 0.0:
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    _clip_metrics(settings, coef_1, advantages, metrics, per_sequence)
    return per_token_loss, metrics


def _log_importance_weights(settings: LossSettings, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log importance weights per token (``"token"``) or one per sequence (``"sequence"``: the masked mean)."""
    if settings.importance_sampling_level == "token":
        return log_ratio
    if settings.importance_sampling_level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"Unknown importance sampling level: {settings.importance_sampling_level}")


def _unmasked_policy_loss(
    settings: LossSettings,
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    metrics: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss type's per-token policy loss, before the masks and the KL term, and ``coef_1`` as the clip-ratio
    metrics read it (clipped by ``delta`` for the clipped losses). Adds ``vespo/phi_seq_mean`` to ``metrics``."""
    kind = settings.loss_type
    if kind == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=settings.epsilon_high).detach()
        return -clamped_ratios * advantages * per_token_logps, coef_1
    if kind in CLIPPED_LOSSES:
        coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
        if settings.delta is not None:
            coef_1 = torch.clamp(coef_1, max=settings.delta)
        return -torch.min(coef_1 * advantages, coef_2 * advantages), coef_1
    if kind == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        return -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages, coef_1
    if kind == "vespo":
        k_pos, lambda_pos, k_neg, lambda_neg = settings.vespo
        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=importance_sampling_ratio,
            k_pos=k_pos,
            lambda_pos=lambda_pos,
            k_neg=k_neg,
            lambda_neg=lambda_neg,
        )
        metrics["vespo/phi_seq_mean"] = phi_seq.squeeze(1)  # (rows,): one value per sequence
        return -phi_seq * advantages * per_token_logps, coef_1
    raise ValueError(f"Unknown loss type: {kind}")


def metric_keys(settings: LossSettings) -> tuple[str, ...]:
    """The tensors :func:`per_token_policy_loss` gives for stock's logged metrics, besides the entropy (the per-slice
    values are :class:`hf_dynbsz.execution.metrics.StepMetrics`'): ``kl`` with ``beta``, the clip flags of the
    clipped losses, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``."""
    keys = ("kl",) if settings.beta != 0.0 else ()
    if settings.loss_type in CLIPPED_LOSSES:
        return (*keys, "clip_ratio/low", "clip_ratio/high")
    return (*keys, *{"cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",)}.get(settings.loss_type, ()))


def _clip_metrics(
    settings: LossSettings,
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    per_sequence: bool,
) -> None:
    """Stock's clip-ratio metrics, from ``coef_1`` as clipped (after ``delta``), exactly what stock's metrics read;
    ``(rows,)`` when ``per_sequence``."""
    kind = settings.loss_type
    flags = {}
    if kind in CLIPPED_LOSSES:
        flags["clip_ratio/low"] = (coef_1 < 1 - settings.epsilon_low) & (advantages < 0)
        flags["clip_ratio/high"] = (coef_1 > 1 + settings.epsilon_high) & (advantages > 0)
    elif kind == "cispo":
        flags["cispo_clip_ratio"] = (coef_1 > settings.epsilon_high) & (advantages > 0)
    metrics.update({key: (flag.squeeze(1) if per_sequence else flag).float() for key, flag in flags.items()})


def microbatch_loss(
    settings: LossSettings,
    per_token_logps: torch.Tensor,
    entropies: torch.Tensor,
    rows: SampleRows,
    bonus: EntropyBonus | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one pass: each sample's masked token sum times its weight, minus the entropy bonus.

    ``per_token_logps`` and ``entropies`` are ``(rows, width)`` for the samples of ``rows``. Summed over any
    partition of an optimizer step's samples, this is stock's loss of the step. Returns the loss and the
    per-token tensors the metrics read.
    """
    per_token_loss, metrics = per_token_policy_loss(
        settings,
        per_token_logps,
        rows.mask,
        rows.advantages,
        rows.per_token.get("old_per_token_logps"),
        rows.per_token.get("ref_per_token_logps"),
        rows.per_token.get("sampling_per_token_logps"),
        rows.per_token.get("importance_sampling_ratio"),
        entropy_mask=rows.entropy_mask,
    )
    per_sample_loss = (per_token_loss * rows.mask).sum(dim=1) * rows.policy_weights.to(per_token_logps.dtype)
    loss = per_sample_loss.sum()
    if bonus is not None:
        loss = bonus.apply(loss, entropies, rows, per_sample_loss)
    return loss, metrics


class EntropyBonus:
    """Stock's entropy bonus (``entropy_coef``, ``use_adaptive_entropy``) over one optimizer step.

    Stock subtracts ``coef x`` the token-mean entropy of each slice (over ``effective_mask``, the loss mask times
    the high-entropy mask), with the coefficient fixed at the end of the previous optimizer step, logs each
    slice's policy loss, and at the step boundary moves the adaptive coefficient by the world's token-weighted
    entropy of the window. Here the bonus is applied per sample with its slice weight, and the per-slice figures
    are summed over the passes, so the result is the same whatever the passes.
    """

    def __init__(self, trainer, num_slices: int, device) -> None:
        """``num_slices``: the stock slices of the optimizer step over all processes."""
        adaptive_off = trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target
        self.coef = 0.0 if adaptive_off else trainer.entropy_coef
        self.slice_policy_loss = torch.zeros(num_slices, device=device, dtype=torch.float64)
        self.entropy_stats = torch.zeros(2, device=device, dtype=torch.float64)  # sum of entropy, tokens

    def apply(
        self, loss: torch.Tensor, entropies: torch.Tensor, rows: SampleRows, per_sample_loss: torch.Tensor
    ) -> torch.Tensor:
        bonus = rows.bonus_mask.to(entropies.dtype)
        self.entropy_stats += torch.stack([(entropies.detach() * bonus).sum(), bonus.sum()]).double()
        self.slice_policy_loss.index_add_(0, rows.slice_ids, per_sample_loss.detach().double())
        if self.coef:
            weights = rows.entropy_weights.to(entropies.dtype).unsqueeze(1)
            loss = loss - self.coef * (entropies * bonus * weights).sum()
        return loss

    def finish(self, trainer, gradient_accumulation_steps: int) -> None:
        """Stock's bookkeeping at the optimizer-step boundary: ``policy_loss`` per slice, the adaptive controller."""
        metrics, args = trainer._metrics["train"], trainer.args
        # stock logs, per slice, its policy loss (before the /GA of the sequence-normalised types), averaged over ranks
        # Slices are numbered across processes (a balanced sample may run elsewhere): one sum gives every process's.
        scale = 1.0 if trainer.loss_type in GLOBAL_TOKEN_LOSSES else float(gradient_accumulation_steps)
        totals = reduce_sum(self.slice_policy_loss * scale)
        for value in totals.float().view(trainer.accelerator.num_processes, -1).nanmean(0):
            metrics["policy_loss"].append(value.item())
        if trainer.use_adaptive_entropy:
            totals = reduce_sum(self.entropy_stats)
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
        metrics["entropy_coef"].append(trainer.entropy_coef)


class GRPOLoss(LogProbLoss):
    """``GRPOTrainer``'s loss: :func:`~hf_dynbsz.execution.loss.sample_weights` for every loss type, the entropy bonus
    (:class:`~hf_dynbsz.execution.loss.EntropyBonus`) and ``top_entropy_quantile``'s per-slice mask."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.trainer = trainer
        self.settings = LossSettings.from_trainer(trainer)
        self.entropy_bonus = bool(trainer._entropy_bonus_enabled)
        self.needs_step_entropies = trainer.top_entropy_quantile < 1.0

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        if self.needs_step_entropies:
            batch.high_entropy = self._high_entropy_mask(batch, entropies)
        batch.policy_weights, batch.entropy_weights = sample_weights(
            self.settings,
            batch.loss_tokens,
            batch.slice_ids,
            batch.slice_rows,
            batch.num_items,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=self.trainer.args.steps_per_generation,
            num_processes=self.trainer.accelerator.num_processes,
            entropy_tokens=batch.bonus_mask.sum(dim=1).cpu(),
        )

    def _high_entropy_mask(self, batch: StepBatch, entropies: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``: stock's per-slice high-entropy mask, from the entropies of one no-grad pass.

        Stock takes the entropy quantile over each fixed slice (gathered across ranks) before its backward, so the
        mask must be known before the first pass: TRL's own ``get_high_entropy_mask`` is applied slice by slice to
        the entropies of a no-grad pass over the step (the same gathers on every rank: one per slice).
        """
        high_entropy = torch.zeros_like(batch.loss_mask)
        slice_ids = batch.slice_ids.to(batch.loss_mask.device)
        quantile = 1 - self.trainer.top_entropy_quantile
        for slice_id in batch.slice_rows.nonzero().flatten().tolist():  # this process's slices
            rows = (slice_ids == slice_id).nonzero().flatten()
            selected = self.trainer.get_high_entropy_mask(entropies[rows], batch.loss_mask[rows], quantile)
            high_entropy[rows] = selected.to(batch.loss_mask.dtype)
        return high_entropy

    def attempt(self, batch: StepBatch) -> EntropyBonus | None:
        if not self.entropy_bonus:
            return None
        return EntropyBonus(self.trainer, len(batch.slice_rows), self.trainer.accelerator.device)

    def metrics(self, batch: StepBatch) -> StepMetrics:
        slices = len(batch.slice_rows) // self.trainer.accelerator.num_processes
        return StepMetrics(slices, self.trainer.accelerator.device, metric_keys(self.settings))

    def pass_loss(self, state: EntropyBonus | None, per_token_logps, entropies, rows: SampleRows):
        return microbatch_loss(self.settings, per_token_logps, entropies, rows, state)

    def finish(self, state: EntropyBonus | None, gradient_accumulation_steps: int) -> None:
        if state is not None:
            state.finish(self.trainer, gradient_accumulation_steps)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss  # GRPOTrainer scales its loss for gradient accumulation itself (loss_is_scaled_for_ga)
