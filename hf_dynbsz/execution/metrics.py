"""The metrics of one optimizer step: token-weighted sums over its passes, reduced once (torch layer).

Stock TRL logs, per fixed micro-batch, a global mean of each loss metric (``entropy``, ``kl``, clip ratios) and
the Trainer averages those means over the accumulation steps. With token-budget passes that average would
weight passes, not tokens, so :class:`StepMetrics` adds up value x token sums over every pass of the step and
reduces them across processes once, at the end: the logged value is the exact token-weighted mean over the
optimizer step. It also carries the ``dynbsz/*`` figures of the step (passes, budget, padding, time by phase,
throughput, peak memory, MFU), all named here; :class:`StepClock` and :class:`PeakMemory` measure them.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict

import torch
from trl.trainer.utils import nanmax, nanmin

from hf_dynbsz.execution.device_memory import release_cached_memory, reset_peak_rss, status_mib
from hf_dynbsz.execution.loss import CLIPPED_LOSSES
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.parallel.collectives import gather_values, reduce_sum
from hf_dynbsz.planning.cost import ModelFlops
from hf_dynbsz.planning.schedule import RankGroup, StepSchedule

__all__ = ["PeakMemory", "StepClock", "StepMeters", "StepMetrics", "device_peak_tflops"]

#: Peak dense bf16/fp16 tensor TFLOP/s of datacenter GPUs (vendor data sheets, without sparsity), by a part of the
#: name torch reports; the first match wins (PCIe/NVL variants before the SXM default).
_PEAK_TFLOPS_16BIT = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def device_peak_tflops(device: torch.device, mixed_precision: str, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device for ``dynbsz/mfu``: ``configured`` (``peak_tflops_per_device``) if set, else the
    table's value for a known GPU training in bf16/fp16, else None (no MFU is logged)."""
    if configured is not None:
        return configured
    if device.type != "cuda" or mixed_precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for part, tflops in _PEAK_TFLOPS_16BIT if part in name), None)


class StepClock:
    """Seconds of one optimizer step by phase, on this process. Phases nest and each second counts once, in the
    innermost phase: ``generation`` (TRL's rollout: generation, reward scoring, its bookkeeping), ``logprob``
    (no-grad log-prob passes: old policy, reference, entropy mask) and ``train`` (the forward/backward passes and
    their scheduling)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed
            if self._open:  # the enclosing phase did not spend this time itself
                self.seconds[self._open[-1]] -= elapsed


class PeakMemory:
    """Peak memory of this process since :meth:`reset`, in MiB: the accelerator's peak allocated memory on GPU,
    the process's peak resident set (VmHWM, reset through ``/proc/self/clear_refs``) on CPU.

    :meth:`held` measures what the process holds before a pass and restarts the peak there (:meth:`pass_peak`
    reads it after the pass); the highest peak before such a restart is carried, so :meth:`mib` stays the peak
    since :meth:`reset`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.carried = 0.0

    def reset(self) -> None:
        self.carried = 0.0
        self._restart()

    def held(self) -> float:
        """MiB the process holds now, after giving freed memory back (CUDA: allocated; CPU: resident set)."""
        self.carried = max(self.carried, self.pass_peak())
        if self.device.type != "cuda":  # CUDA's allocated memory is exact without emptying its cache (which is slow)
            release_cached_memory(self.device)
        self._restart()
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return status_mib("VmRSS") or 0.0

    def pass_peak(self) -> float:
        """The peak since the last :meth:`held` (or :meth:`reset`)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = status_mib("VmHWM")
        if peak is not None:
            return peak
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024

    def mib(self) -> float:
        return max(self.carried, self.pass_peak())

    def _restart(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        reset_peak_rss()  # (not Linux, or not allowed: the peak then counts from process start)


# Loss metrics averaged over loss tokens (or over sequences when a value is per sequence).
_TOKEN_MEAN_METRICS = ("kl", "vespo/phi_seq_mean", "cispo_clip_ratio")


class StepMeters:
    """What the trainer measures over each optimizer step besides the loss: time by phase, peak memory, and the
    model's FLOPs and the device's peak for MFU. :meth:`start` at the first training call of each step."""

    def __init__(
        self, flops: ModelFlops | None, device: torch.device, mixed_precision: str, peak_tflops_per_device: float | None
    ) -> None:
        self.clock, self.memory = StepClock(), PeakMemory(device)
        self.flops = flops  # the model's (hf_dynbsz.planning.model_support); None when its config gives none: no MFU
        self.peak_tflops = device_peak_tflops(device, mixed_precision, peak_tflops_per_device)
        self.predicted_peak_mib: float | None = None  # with a memory limit: the highest predicted pass peak
        self.oom_retries = 0  # the step's passes re-planned after running out of memory

    def start(self) -> None:
        self.clock = StepClock()
        self.memory.reset()
        self.predicted_peak_mib = None
        self.oom_retries = 0

    def predicted(self, mib: float) -> None:
        """A pass's predicted whole-process peak (:mod:`hf_dynbsz.planning.memory`)."""
        self.predicted_peak_mib = max(self.predicted_peak_mib or 0.0, mib)


class StepMetrics:
    """Accumulates one optimizer step's metrics on this process; :meth:`publish` reduces and logs them."""

    def __init__(self) -> None:
        # metric -> sum over tokens (or sequences), and tokens (or sequences): 0-d float64 tensors on the passes'
        # device, added to without reading them on the host (read once, in publish)
        self.sums: dict[str, torch.Tensor | float] = defaultdict(float)
        self.counts: dict[str, torch.Tensor | float] = defaultdict(float)
        self.sequence_low: list[torch.Tensor] = []  # per-sequence low-clip ratios, for clip_ratio/low_min
        self.sequence_high: list[torch.Tensor] = []
        self.pass_real_tokens: list[int] = []  # real tokens of each real pass
        self.computed_tokens = 0  # token positions computed by the real passes, padding included

    def count_pass(self, real_tokens: int, computed_tokens: int) -> None:
        """One real pass's tokens: its real ones, and the positions it computed (padding included)."""
        self.pass_real_tokens.append(real_tokens)
        self.computed_tokens += computed_tokens

    def add_pass(
        self,
        real_tokens: int,
        computed_tokens: int,
        loss_metrics: dict[str, torch.Tensor],
        entropies: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """One real pass: its token counts and the per-token tensors of
        :func:`hf_dynbsz.execution.loss.per_token_policy_loss`. Sums stay on the device (no host read in a pass)."""
        self.count_pass(real_tokens, computed_tokens)
        mask = mask.float()
        tokens = mask.sum().double()

        def add(name: str, values: torch.Tensor) -> None:
            values = values.detach().float()
            if values.size(1) == 1:  # one value per sequence (importance_sampling_level="sequence", vespo phi)
                self.sums[name] = self.sums[name] + values.sum().double()
                self.counts[name] = self.counts[name] + float(values.size(0))
            else:
                self.sums[name] = self.sums[name] + (values * mask).sum().double()
                self.counts[name] = self.counts[name] + tokens

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

    def publish(
        self,
        store: dict[str, list],
        accelerator,
        *,
        loss_type: str,
        schedule: StepSchedule,
        stock_computed_tokens: int,
        group: RankGroup,
        meters: StepMeters,
        table: SequenceTable,
        replicas: int = 1,
        sharing: str | None = None,
    ) -> None:
        """Reduce over processes (one reduce, and two gathers for the clip extremes) and append to ``store``.

        ``store`` is TRL's ``trainer._metrics["train"]`` (name -> values, averaged by TRL at logging time). ``dynbsz/*``
        figures: ``microbatches`` real passes of this process, ``microbatches_needed`` passes it alone needed,
        ``microbatches_max_over_ranks`` passes every process ran, ``dummy_passes``, tokens per pass (mean, max),
        ``budget_tokens`` and ``budget_utilization`` (real tokens / (passes x budget)), and over all processes
        ``padding_fraction``, ``computed_tokens`` and ``stock_computed_tokens`` (what stock's fixed slices compute for
        the same samples), ``prompt_tokens_saved`` (tokens sharing did not compute: shared prompts, and with a prefix
        tree every shared prefix) and with ``sharing`` "tree" ``tree_tokens_saved`` (of those, the tokens the prefix
        tree saved beyond prompt groups in the same passes); with cross-rank balancing ``rank_imbalance_before`` and
        ``rank_imbalance_after`` (largest per-process cost over the mean, without and with it) and ``samples_moved``.
        Time and memory, the maximum over processes (the step waits for the slowest): ``train_seconds``,
        ``logprob_seconds`` and ``generation_seconds`` (see :class:`StepClock`) and ``peak_memory_mib``
        (:class:`PeakMemory`) of ``meters``, with a memory limit ``predicted_peak_memory_mib``
        (:mod:`hf_dynbsz.planning.memory`), and ``oom_retries`` (the step's re-plans after running out of memory);
        ``tokens_per_second``, the prompt + completion tokens of the samples all processes trained (shared prompts
        counted for each of their samples, as stock computes them) over ``train_seconds``; ``mfu``, the model FLOPs of
        the passes over the samples of ``table`` (the ones this process ran, see
        :meth:`hf_dynbsz.planning.cost.ModelFlops.training_flops`), summed over processes, over ``train_seconds`` x
        processes x the device's peak, logged only when that peak is known. ``replicas``: processes that ran the same
        samples (the sequence-parallel group size), counted once.
        """
        real = sum(self.pass_real_tokens)
        saved = int(table.lengths.sum()) - real  # each sample's tokens, less what its passes computed
        flops = (
            meters.flops.training_flops(table.prompt_lengths.tolist(), table.completion_lengths.tolist(), saved)
            if meters.flops is not None
            else 0.0
        )
        names = sorted(self.sums)
        device = accelerator.device
        sums = [
            torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())
            for name in names
            for value in (self.sums[name], self.counts[name])
        ]
        tree_saved = _tree_tokens_saved(table, schedule, real) if sharing == "tree" else 0
        host = [real, self.computed_tokens, stock_computed_tokens, saved, tree_saved]
        local = torch.cat([torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device),
                           torch.tensor([*host, flops], dtype=torch.float64, device=device)])  # fmt: skip
        local = local / replicas  # each sample counted once (sequence parallelism: per group)
        totals = reduce_sum(local).tolist()
        for position, name in enumerate(names):
            store[name].append(totals[2 * position] / max(totals[2 * position + 1], 1.0))
        if self.sequence_low or loss_type in CLIPPED_LOSSES:  # stock logs clip_ratio/low_min, high_max
            self._publish_clip_extremes(store, accelerator)
        real_all, computed_all, stock_all, saved_all, tree_all, flops_all = totals[-6:]
        _publish_time_and_memory(store, accelerator, group, meters, trained=real_all + saved_all, flops=flops_all)
        self._publish_passes(store, schedule)
        store["dynbsz/padding_fraction"].append((computed_all - real_all) / max(computed_all, 1.0))
        store["dynbsz/computed_tokens"].append(computed_all)
        store["dynbsz/stock_computed_tokens"].append(stock_all)
        store["dynbsz/prompt_tokens_saved"].append(saved_all)
        if sharing == "tree":
            store["dynbsz/tree_tokens_saved"].append(tree_all)
        if schedule.balance is not None:  # cross-rank balancing ran (the same figures on every process)
            store["dynbsz/rank_imbalance_before"].append(schedule.balance.imbalance_before)
            store["dynbsz/rank_imbalance_after"].append(schedule.balance.imbalance_after)
            store["dynbsz/samples_moved"].append(float(schedule.samples_moved))

    def _publish_clip_extremes(self, store: dict[str, list], accelerator) -> None:
        """Stock's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: the extremes of the per-sequence means over
        every process (two gathers each: lengths, values)."""
        for name, values, pick in (
            ("clip_ratio/low_min", self.sequence_low, nanmin),
            ("clip_ratio/high_max", self.sequence_high, nanmax),
        ):
            local_values = torch.cat(values) if values else torch.zeros(0, device=accelerator.device)
            gathered = torch.cat(gather_values(local_values.float()))
            store[name].append(pick(gathered).item() if gathered.numel() else float("nan"))

    def _publish_passes(self, store: dict[str, list], schedule: StepSchedule) -> None:
        """This process's passes: their count, the schedule's counts, tokens per pass and the budget's use."""
        used = self.pass_real_tokens
        store["dynbsz/microbatches"].append(float(len(used)))
        store["dynbsz/microbatches_needed"].append(float(schedule.passes_needed))
        store["dynbsz/microbatches_max_over_ranks"].append(float(schedule.passes))
        store["dynbsz/dummy_passes"].append(float(schedule.dummy_passes))
        store["dynbsz/tokens_per_microbatch_mean"].append(sum(used) / max(len(used), 1))
        store["dynbsz/tokens_per_microbatch_max"].append(float(max(used, default=0)))
        store["dynbsz/budget_tokens"].append(float(schedule.budget))
        store["dynbsz/budget_utilization"].append(sum(used) / max(len(used) * schedule.budget, 1))


def _tree_tokens_saved(table: SequenceTable, schedule: StepSchedule, tree_tokens: int) -> int:
    """The tokens a prefix tree saved beyond prompt groups: what the passes of ``schedule`` (over ``table``'s samples)
    compute under the prompt-group rule, less ``tree_tokens``, what they computed as prefix trees."""
    groups = table.prefix_tree("groups")
    return sum(groups.tokens(samples) for samples in schedule.microbatches if samples) - tree_tokens


def _publish_time_and_memory(
    store: dict[str, list], accelerator, group: RankGroup, meters: StepMeters, *, trained: float, flops: float
) -> None:
    """The step's time, memory and throughput figures, the maximum over processes (one all-reduce): ``trained`` is
    the samples' tokens over all processes, ``flops`` the model FLOPs of their passes."""
    phases = ("train", "logprob", "generation")
    *microseconds, peak_kib, predicted_kib, retries = group.all_reduce_max(
        [round(max(meters.clock.seconds[p], 0.0) * 1e6) for p in phases]
        + [round(meters.memory.mib() * 1024), round((meters.predicted_peak_mib or -1) * 1024), meters.oom_retries]
    )
    seconds = dict(zip(phases, (value / 1e6 for value in microseconds)))
    for phase in phases:
        store[f"dynbsz/{phase}_seconds"].append(seconds[phase])
    # the samples' tokens: a shared prompt counts for each of its samples
    store["dynbsz/tokens_per_second"].append(trained / seconds["train"] if seconds["train"] else 0.0)
    store["dynbsz/peak_memory_mib"].append(peak_kib / 1024)
    if predicted_kib > 0:
        store["dynbsz/predicted_peak_memory_mib"].append(predicted_kib / 1024)
    store["dynbsz/oom_retries"].append(float(retries))
    if meters.peak_tflops and meters.flops is not None and seconds["train"]:
        devices = accelerator.num_processes  # every device (a sequence-parallel group's too)
        store["dynbsz/mfu"].append(flops / (seconds["train"] * devices * meters.peak_tflops * 1e12))
