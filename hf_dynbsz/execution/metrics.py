"""The metrics of one optimizer step: stock's loss metrics per stock slice and the ``dynbsz/*`` figures, reduced
once (torch layer).

Stock TRL logs its loss metrics (``entropy``, ``kl``, the clip ratios, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``)
once per fixed micro-batch ("slice"), each reduced over that slice of every process, and the Trainer averages those
values over its logging window. :class:`StepMetrics` keeps, per stock slice, the sums and extremes those values are
made of, whatever passes the slice's samples ran in and on whichever process, and gathers them across processes
once, at the end of the step: the logged values are stock's. It also carries the ``dynbsz/*`` figures of the step
(passes, budget, padding, time by phase, throughput, peak memory, MFU), all named here; :class:`StepClock` and
:class:`PeakMemory` measure them. Every trainer's loss uses it (:mod:`hf_dynbsz.execution.step_loss`).
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from hf_dynbsz.execution.device_memory import release_cached_memory, reset_peak_rss, status_mib
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.parallel.collectives import gather_rows, reduce_sum
from hf_dynbsz.planning.cost import ModelFlops
from hf_dynbsz.planning.schedule import RankGroup, StepSchedule
from hf_dynbsz.planning.settings import SharePrefix

__all__ = [
    "StepResult",
    "DEPRECATED_SHARED_TOKENS_SAVED",
    "PeakMemory",
    "StepClock",
    "StepMeters",
    "StepMetrics",
    "count_train_tokens",
    "device_peak_tflops",
]

#: ``dynbsz/shared_tokens_saved``'s former name, logged with the same value for one release (deprecated: it counts
#: every shared prefix, completion trunks included, not only prompts); removed in the release after the next.
DEPRECATED_SHARED_TOKENS_SAVED = "dynbsz/prompt_tokens_saved"

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


def count_train_tokens(trainer, tokens: float, device) -> None:
    """Stock's ``num_tokens`` metric of a preference trainer (DPO, reward, KTO): this process's ``tokens`` of the step
    that stock counts, summed over processes (one all-reduce), added to the trainer's running total once per TP group
    and logged as stock logs it (the running total, not a mean)."""
    total = reduce_sum(torch.tensor([float(tokens)], dtype=torch.float64, device=device))
    trainer._total_train_tokens += int(total.item()) // trainer._tp_size
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


class StepClock:
    """Seconds of one optimizer step by phase, on this process. Phases nest and each second counts once, in the
    innermost phase: ``generation`` (TRL's rollout: generation, reward scoring, its bookkeeping), ``logprob``
    (no-grad log-prob passes: old policy, reference, entropy mask), ``teacher`` (a distillation teacher's no-grad
    passes) and ``train`` (the forward/backward passes and their scheduling)."""

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


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step's passes did, as the executor hands it to the trainer: the figures the step's
    ``dynbsz/*`` metrics log, over every process, and the step's loss."""

    #: passes every process ran (the schedule's count, lockstep dummy passes included)
    passes: int
    #: token positions the passes computed over all processes, padding included
    computed_tokens: float
    #: the training phase's time of the slowest process
    train_seconds: float
    #: the highest peak memory over processes
    peak_memory_mib: float
    #: re-plans after running out of memory, the most any process made
    oom_retries: int
    #: the step's loss as the Trainer logs it (None until the executor sets it)
    loss: torch.Tensor | None = None


class StepMeters:
    """What the trainer measures over each optimizer step besides the loss: time by phase, peak memory, and the
    model's FLOPs and the device's peak for MFU. :meth:`start` at the first training call of each step."""

    def __init__(
        self,
        flops: ModelFlops | None,
        device: torch.device,
        mixed_precision: str,
        peak_tflops_per_device: float | None,
        phases: tuple[str, ...] = ("train", "logprob", "generation"),
    ) -> None:
        self.clock, self.memory = StepClock(), PeakMemory(device)
        self.phases = phases  # the phases of the step's time that are published (the same on every process)
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


#: Per-row tensors a pass's loss gives (``loss_metrics``) whose per-slice means stock logs under another name (any
#: other key is logged under its own). ``clip_ratio/region`` is computed here.
_LOGGED_AS = {
    "clip_ratio/low": "clip_ratio/low_mean",
    "clip_ratio/high": "clip_ratio/high_mean",
    "clip_ratio/region": "clip_ratio/region_mean",
}
#: The clip flags whose per-slice extremes stock logs: ``clip_ratio/low_min`` and ``clip_ratio/high_max``.
_CLIP_FLAGS = ("clip_ratio/low", "clip_ratio/high")


def _row_sums(values, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's value sum and count: a ``(rows,)`` tensor is one value per sequence (counted once), a ``(rows,
    width)`` tensor one per token (summed over ``mask``, its tokens counted), a ``(sums, counts)`` pair of ``(rows,)``
    tensors each row's own (DPO's pair metrics: a pair's values on its chosen row, counted once)."""
    if isinstance(values, tuple):
        return values[0].detach().float(), values[1].detach().float()
    values = values.detach().float()
    if values.dim() == 1:
        return values, torch.ones_like(values)
    return (values * mask).sum(1), mask.sum(1)


def _row_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Stock's ``masked_seq_mean``: each row's value, or its token mean over ``mask`` (NaN for a row without
    tokens)."""
    values = values.detach().float()
    return values if values.dim() == 1 else (values * mask).sum(1) / mask.sum(1)


class StepMetrics:
    """One optimizer step's metrics on this process, :meth:`publish` reduces and logs them: stock's loss metrics per
    stock slice, and the ``dynbsz/*`` figures.

    Stock's trainers log their loss metrics in ``_compute_loss``: its ``k``-th call, on every process at once,
    reduces slice ``k`` of every process (``accelerator.reduce`` or ``gather``) and appends one value per metric, and
    ``log`` averages the values of its window. So per slice ``k`` (a sample of process ``p``'s slice ``s`` counts in
    ``k = s``, wherever balancing ran it), this keeps the sums those values are made of, and :meth:`publish` gathers
    them once per step and appends each slice's value in slice order, as stock does. A metric given per token is
    stock's ``global_masked_mean``, its token sum over the slice's loss tokens; one given per sequence (a ``(rows,)``
    tensor: sequence-level importance sampling, ``vespo``'s phi, RLOO's clip flags) its sum over the slice's
    sequences; a count of 0 reads as 1. ``clip_ratio/low_min`` and ``clip_ratio/high_max`` are the extremes of the
    sequences' means (stock's ``masked_seq_mean``, ``nanmin``/``nanmax``: a sequence without loss tokens does not
    count; NaN when none does), ``clip_ratio/region_mean`` the mean of ``max(low, high)``.
    """

    def __init__(self, slices: int, device, keys: tuple[str, ...] = ()) -> None:
        """``slices``: stock slices per process in the step (every process has as many); ``keys``: the tensors of
        each pass's ``loss_metrics`` that stock logs, besides the entropy (``clip_ratio/low`` with
        ``clip_ratio/high``: the clip ratios)."""
        self.slices = slices
        clipped = all(flag in keys for flag in _CLIP_FLAGS)
        self.keys = ("entropy", *keys, *(["clip_ratio/region"] if clipped else []))
        # per slice: (value sum, count) of each of self.keys; with the clip ratios, -low_min and high_max as maxima.
        # Float64 on the passes' device, added to without reading them on the host (read once, in publish).
        self.sums = torch.zeros(slices, 2 * len(self.keys), dtype=torch.float64, device=device)
        self.maxima = torch.full((slices, 2 if clipped else 0), -math.inf, dtype=torch.float64, device=device)
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
        slice_ids: torch.Tensor,
    ) -> None:
        """One real pass: its token counts, and its rows' figures into their stock slices (no host read).
        ``loss_metrics``: the pass's per-row tensors (``(rows,)`` per sequence, ``(rows, width)`` per token);
        ``entropies`` and ``mask`` (the loss mask) ``(rows, width)``; ``slice_ids`` ``(rows,)``, numbered over the
        processes (:class:`~hf_dynbsz.execution.batch.StepBatch`); all on the passes' device."""
        self.count_pass(real_tokens, computed_tokens)
        mask = mask.detach().float()
        values = {"entropy": entropies, **loss_metrics}
        if self.maxima.size(1):
            low, high = (values[flag] for flag in _CLIP_FLAGS)
            values["clip_ratio/region"] = torch.maximum(low, high)
        figures = torch.stack([figure for key in self.keys for figure in _row_sums(values[key], mask)], dim=1)
        index = slice_ids % self.slices
        self.sums.index_add_(0, index, figures.double())
        if self.maxima.size(1):
            extremes = torch.stack([-_row_means(low, mask), _row_means(high, mask)], dim=1).double()
            extremes = extremes.nan_to_num(nan=-math.inf)  # stock's nanmin / nanmax leave such a sequence out
            self.maxima.scatter_reduce_(0, index.unsqueeze(1).expand_as(extremes), extremes, reduce="amax")

    def publish(
        self,
        store: dict[str, list],
        accelerator,
        *,
        schedule: StepSchedule,
        stock_computed_tokens: int,
        group: RankGroup,
        meters: StepMeters,
        table: SequenceTable,
        replicas: int = 1,
        sharing: SharePrefix = SharePrefix.NONE,
    ) -> StepResult:
        """Reduce over processes (one gather) and append to ``store``; the step's figures, returned.

        ``store`` is TRL's ``trainer._metrics["train"]`` (name -> values, averaged by TRL at logging time). The loss
        metrics: one value per stock slice, in slice order (see the class). ``dynbsz/*`` figures: ``microbatches``
        real passes of this process, ``microbatches_needed`` passes it alone needed, ``microbatches_max_over_ranks``
        passes every process ran, ``dummy_passes``, tokens per pass (mean, max), ``budget_tokens`` and
        ``budget_utilization`` (real tokens / (passes x budget)), and over all processes ``padding_fraction``,
        ``computed_tokens`` and ``stock_computed_tokens`` (what stock's fixed slices compute for the same samples),
        ``shared_tokens_saved`` (tokens sharing did not compute: shared prompts, and with a prefix tree every shared
        prefix, completion trunks included; also logged as ``prompt_tokens_saved``, its former name, for one release)
        and with ``sharing`` the tree ``tree_tokens_saved`` (of those, the tokens the prefix tree saved beyond prompt
        groups in the same passes); with cross-rank balancing ``rank_imbalance_before`` and
        ``rank_imbalance_after`` (largest per-process cost over the mean, without and with it), ``samples_moved`` and
        ``units_split`` (units, such as a subtree of samples sharing a prefix, that run on several processes).
        Time and memory, the maximum over processes (the step waits for the slowest): ``train_seconds``,
        ``logprob_seconds`` and ``generation_seconds`` (a distillation's ``teacher_seconds`` too: ``meters.phases``,
        see :class:`StepClock`) and ``peak_memory_mib`` (:class:`PeakMemory`) of ``meters``, with a memory limit
        ``predicted_peak_memory_mib``
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
        tree_saved = _tree_tokens_saved(table, schedule, real) if sharing is SharePrefix.TREE else 0
        host = [real, self.computed_tokens, stock_computed_tokens, saved, tree_saved]
        device = self.sums.device
        summed = torch.cat([self.sums.flatten(), torch.tensor([*host, flops], dtype=torch.float64, device=device)])
        gathered = gather_rows(torch.cat([summed / replicas, self.maxima.flatten()]))  # each sample counted once
        totals = gathered[:, : summed.numel()].sum(0)
        maxima = gathered[:, summed.numel() :].amax(0).view_as(self.maxima)
        self.publish_slices(store, totals[: self.sums.numel()].view_as(self.sums), maxima)
        real_all, computed_all, stock_all, saved_all, tree_all, flops_all = totals[-6:].tolist()
        seconds, peak_mib, retries = _publish_time_and_memory(
            store, accelerator, group, meters, trained=real_all + saved_all, flops=flops_all
        )
        self._publish_passes(store, schedule)
        store["dynbsz/padding_fraction"].append((computed_all - real_all) / max(computed_all, 1.0))
        store["dynbsz/computed_tokens"].append(computed_all)
        store["dynbsz/stock_computed_tokens"].append(stock_all)
        store["dynbsz/shared_tokens_saved"].append(saved_all)
        store[DEPRECATED_SHARED_TOKENS_SAVED].append(saved_all)  # its former name, for one release
        if sharing is SharePrefix.TREE:
            store["dynbsz/tree_tokens_saved"].append(tree_all)
        if schedule.balance is not None:  # cross-rank balancing ran (the same figures on every process)
            store["dynbsz/rank_imbalance_before"].append(schedule.balance.imbalance_before)
            store["dynbsz/rank_imbalance_after"].append(schedule.balance.imbalance_after)
            store["dynbsz/samples_moved"].append(float(schedule.samples_moved))
            store["dynbsz/units_split"].append(float(len(schedule.balance.shares)))
        return StepResult(schedule.passes, computed_all, seconds, peak_mib, retries)

    def publish_slices(
        self, store: dict[str, list], sums: torch.Tensor | None = None, maxima: torch.Tensor | None = None
    ) -> None:
        """Stock's loss metrics, one value per slice in slice order, from ``sums`` (per slice, value sum and count
        per key) and ``maxima`` (-low_min, high_max; -inf: no sequence counted) over every process (default: this
        process's, the whole of them on one process)."""
        sums = self.sums if sums is None else sums
        maxima = self.maxima if maxima is None else maxima
        names = [_LOGGED_AS.get(key, key) for key in self.keys]
        for slice_sums, slice_maxima in zip(sums.tolist(), maxima.tolist()):
            for position, name in enumerate(names):
                store[name].append(slice_sums[2 * position] / max(slice_sums[2 * position + 1], 1.0))
            if slice_maxima:
                low, high = (value if math.isfinite(value) else math.nan for value in slice_maxima)
                store["clip_ratio/low_min"].append(-low)
                store["clip_ratio/high_max"].append(high)

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
    groups = table.group_tree()
    return sum(groups.tokens(samples) for samples in schedule.microbatches if samples) - tree_tokens


def _publish_time_and_memory(
    store: dict[str, list], accelerator, group: RankGroup, meters: StepMeters, *, trained: float, flops: float
) -> tuple[float, float, int]:
    """The step's time, memory and throughput figures, the maximum over processes (one all-reduce): ``trained`` is
    the samples' tokens over all processes, ``flops`` the model FLOPs of their passes. Returns the training seconds,
    the peak memory (MiB) and the out-of-memory retries."""
    phases = meters.phases
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
    return seconds["train"], peak_kib / 1024, int(retries)
