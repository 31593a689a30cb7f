"""The metrics of one optimizer step: token-weighted sums over its passes, reduced once (torch layer).

Stock TRL logs, per fixed micro-batch, a global mean of each loss metric (``entropy``, ``kl``, clip ratios) and
the Trainer averages those means over the accumulation steps. With token-budget passes that average would
weight passes, not tokens, so :class:`StepMetrics` adds up value x token sums over every pass of the step and
reduces them across processes once, at the end: the logged value is the exact token-weighted mean over the
optimizer step. It also carries the ``dynbsz/*`` figures of the step (passes, budget, padding), all named here.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl.trainer.utils import nanmax, nanmin

from .schedule import StepSchedule

__all__ = ["StepMetrics"]

# Loss metrics averaged over loss tokens (or over sequences when a value is per sequence).
_TOKEN_MEAN_METRICS = ("kl", "vespo/phi_seq_mean", "cispo_clip_ratio")
# Loss types for which stock logs clip_ratio/low_min and clip_ratio/high_max.
_SEQUENCE_CLIP_METRIC_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class StepMetrics:
    """Accumulates one optimizer step's metrics on this process; :meth:`publish` reduces and logs them."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)  # metric -> sum over tokens (or sequences)
        self.counts: dict[str, float] = defaultdict(float)  # metric -> tokens (or sequences)
        self.sequence_low: list[torch.Tensor] = []  # per-sequence low-clip ratios, for clip_ratio/low_min
        self.sequence_high: list[torch.Tensor] = []
        self.pass_real_tokens: list[int] = []  # real tokens of each real pass
        self.computed_tokens = 0  # token positions computed by the real passes, padding included

    def add_pass(self, real_tokens: int, computed_tokens: int, loss_metrics: dict[str, torch.Tensor],
                 entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """One real pass: its token counts and the per-token tensors of :func:`hf_dynbsz.loss.per_token_policy_loss`."""
        self.pass_real_tokens.append(real_tokens)
        self.computed_tokens += computed_tokens
        mask = mask.float()
        tokens = mask.sum().item()

        def add(name: str, values: torch.Tensor) -> None:
            values = values.detach().float()
            if values.size(1) == 1:  # one value per sequence (importance_sampling_level="sequence", vespo phi)
                self.sums[name] += values.sum().item()
                self.counts[name] += float(values.size(0))
            else:
                self.sums[name] += (values * mask).sum().item()
                self.counts[name] += tokens

        add("entropy", entropies)
        for name in _TOKEN_MEAN_METRICS:
            if name in loss_metrics:
                add(name, loss_metrics[name])
        if "clip_ratio/low" in loss_metrics:
            low, high = loss_metrics["clip_ratio/low"], loss_metrics["clip_ratio/high"]
            add("clip_ratio/low_mean", low)
            add("clip_ratio/high_mean", high)
            add("clip_ratio/region_mean", torch.maximum(low, high))

            def sequence_mean(x: torch.Tensor) -> torch.Tensor:
                return x.squeeze(1) if x.size(1) == 1 else (x * mask).sum(-1) / mask.sum(-1)

            self.sequence_low.append(sequence_mean(low))
            self.sequence_high.append(sequence_mean(high))

    def publish(self, store: dict[str, list], accelerator, *, loss_type: str, schedule: StepSchedule,
                stock_computed_tokens: int) -> None:
        """Reduce over processes (one reduce, and two gathers for the clip extremes) and append to ``store``.

        ``store`` is TRL's ``trainer._metrics["train"]`` (name -> values, averaged by TRL at logging time).
        ``dynbsz/*`` figures: ``microbatches`` real passes of this process, ``microbatches_needed`` passes it
        alone needed, ``microbatches_max_over_ranks`` passes every process ran, ``dummy_passes``, tokens per
        pass (mean, max), ``budget_tokens`` and ``budget_utilization`` (real tokens / (passes x budget)), and over
        all processes ``padding_fraction``, ``computed_tokens`` and ``stock_computed_tokens`` (what stock's fixed
        slices compute for the same samples) and ``prompt_tokens_saved`` (prompt tokens shared prompts did not
        compute); with cross-rank balancing ``rank_imbalance_before`` and
        ``rank_imbalance_after`` (largest per-process cost over the mean, without and with it) and
        ``samples_moved``.
        """
        names = sorted(self.sums)
        local = [value for name in names for value in (self.sums[name], self.counts[name])]
        local += [sum(self.pass_real_tokens), self.computed_tokens, stock_computed_tokens, schedule.prompt_tokens_saved]
        device = accelerator.device
        totals = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=device), reduction="sum")
        totals = totals.tolist()
        for position, name in enumerate(names):
            store[name].append(totals[2 * position] / max(totals[2 * position + 1], 1.0))
        if self.sequence_low or loss_type in _SEQUENCE_CLIP_METRIC_LOSSES:
            for name, values, pick in (("clip_ratio/low_min", self.sequence_low, nanmin),
                                       ("clip_ratio/high_max", self.sequence_high, nanmax)):
                local_values = torch.cat(values) if values else torch.zeros(0, device=device)
                padded = accelerator.pad_across_processes(local_values.float(), dim=0, pad_index=float("nan"))
                gathered = accelerator.gather(padded)
                store[name].append(pick(gathered).item() if gathered.numel() else float("nan"))
        real_all, computed_all, stock_all, saved_all = totals[-4:]
        used = self.pass_real_tokens
        store["dynbsz/microbatches"].append(float(len(used)))
        store["dynbsz/microbatches_needed"].append(float(schedule.passes_needed))
        store["dynbsz/microbatches_max_over_ranks"].append(float(schedule.passes))
        store["dynbsz/dummy_passes"].append(float(schedule.dummy_passes))
        store["dynbsz/tokens_per_microbatch_mean"].append(sum(used) / max(len(used), 1))
        store["dynbsz/tokens_per_microbatch_max"].append(float(max(used, default=0)))
        store["dynbsz/budget_tokens"].append(float(schedule.budget))
        store["dynbsz/budget_utilization"].append(sum(used) / max(len(used) * schedule.budget, 1))
        store["dynbsz/padding_fraction"].append((computed_all - real_all) / max(computed_all, 1.0))
        store["dynbsz/computed_tokens"].append(computed_all)
        store["dynbsz/stock_computed_tokens"].append(stock_all)
        store["dynbsz/prompt_tokens_saved"].append(saved_all)
        if schedule.balance is not None:  # cross-rank balancing ran (the same figures on every process)
            store["dynbsz/rank_imbalance_before"].append(schedule.balance.imbalance_before)
            store["dynbsz/rank_imbalance_after"].append(schedule.balance.imbalance_after)
            store["dynbsz/samples_moved"].append(float(schedule.samples_moved))
