"""The self-check on the run's own passes, and the layout timing it leads to (torch layer).

:mod:`hf_dynbsz.execution.self_check` decides (layouts fastest first against every sample computed alone); this
module runs it for a :class:`~hf_dynbsz.execution.executor.PassExecutor`: :class:`CheckPasses` gives the check its
passes through the executor's own collator, segments and forward; :func:`check_layouts` runs the check once per run
and sets what the executor keeps (its layout, or stock math; the summary and time it logs); :func:`layout_timing`
gives the run its :class:`~hf_dynbsz.execution.layout_timing.LayoutTiming` (on CUDA with ``packing_layout="auto"``,
the layouts of the other families that pass the check too) or :data:`~hf_dynbsz.execution.layout_timing.
NO_LAYOUT_TIMING`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
from accelerate.utils import DistributedType
from torch.profiler import record_function

from hf_dynbsz.execution.device_memory import injected_fault, release_cached_memory
from hf_dynbsz.execution.layout_timing import (
    MEASURED_DEVICE_TYPES,
    NO_LAYOUT_TIMING,
    Candidate,
    LayoutTiming,
    family,
    pass_clock,
)
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.rope import stock_rope
from hf_dynbsz.execution.self_check import (
    GRADIENT_COMPLETION,
    CheckResult,
    Probe,
    alone_microbatch,
    check_loss,
    checked_parameters,
    gradient_table,
    gradient_tolerance,
    gradients_of,
    run_self_check,
    tolerance,
    tree_probe,
)
from hf_dynbsz.execution.sequence_parallel import NoSequenceParallel
from hf_dynbsz.planning.model_support import Layout
from hf_dynbsz.planning.schedule import Scheduler

logger = logging.getLogger("hf_dynbsz")

__all__ = ["CheckPasses", "check_layouts", "compute_dtype", "layout_timing"]


def compute_dtype(accelerator, model) -> torch.dtype:
    """The precision the self-check's forwards compute in: the weights', or the autocast dtype of mixed precision
    (accelerate runs a prepared model's forward under autocast whatever the caller's context)."""
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
    return mixed or next(accelerator.unwrap_model(model).parameters()).dtype


def check_layouts(executor, model, table: SequenceTable) -> None:
    """The self-check of ``executor``'s run on ``table``'s samples: keep the fastest layout whose log-probs and
    gradients equal each sample's own, on every model the loss checks (a distillation's teacher too, log-probs only);
    when none does, stock math runs (``executor.enabled`` False). The check's passes are unsharded, whatever the run's
    sequence parallelism; a prefix tree is probed on three levels (:func:`~hf_dynbsz.execution.self_check.tree_probe`,
    which may add cut copies of a sample, or say that it could not); the run's layout timing follows from its result.

    A pass of the check that runs out of memory (here or on another process) is recovered as a training pass's is
    (:meth:`~hf_dynbsz.execution.recovery.OutOfMemoryRecovery.recovers_in_check`): the cached memory is freed and the
    check runs again on smaller probes, every completion cut to its first
    :data:`~hf_dynbsz.execution.self_check.GRADIENT_COMPLETION` tokens; when that runs out of memory too, stock math
    runs. Either way the log's one line says so."""
    layouts = executor.capabilities.layouts
    schedulers = {
        layout: dataclasses.replace(
            Scheduler.from_args(executor.args, executor.capabilities.support, executor.scheduler.group, layout=layout),
            teacher_scale=executor.scheduler.teacher_scale,
        )
        for layout in layouts
    }
    memory: list[str] = []  # each try's out-of-memory error
    started = time.perf_counter()
    for probe in (table, gradient_table(table)):  # after running out of memory: smaller probes
        result, summary, passes, probe = _attempt(executor, model, probe, layouts, schedulers)
        if not result.out_of_memory:
            break
        memory.append(result.out_of_memory)
        release_cached_memory(executor.accelerator.device)
    executor.self_check_seconds = time.perf_counter() - started
    executor.self_check_summary = _with_memory(summary, memory, result)
    logger.log(
        logging.WARNING if result.chosen or memory else logging.INFO,
        "hf_dynbsz: %s It took %.2f s.",
        executor.self_check_summary,
        executor.self_check_seconds,
    )
    if result.chosen:
        executor.parallel.refuse_inexact(executor.self_check_summary)
    executor.enabled = result.chosen < len(layouts)
    if executor.enabled and result.chosen:
        executor.scheduler = schedulers[layouts[result.chosen]]
    if len(passes) == 1:  # a distillation's passes keep the pair's layout (both models' passes are not timed)
        executor.layout_timing = layout_timing(executor, model, probe, layouts, schedulers, result.chosen, passes[0])


def _attempt(executor, model, table: SequenceTable, layouts, schedulers):
    """One try of the check on ``table``'s samples: ``(result, its summary, the passes, the samples probed)``."""
    table, probe_note = tree_probe(table, layouts)
    checked = executor.loss.checked_models(model)
    no_gradients = CheckPasses.gradients_skipped(executor, model)
    passes = [
        CheckPasses(executor, one, table, schedulers, NoSequenceParallel(), gradients=grad and no_gradients is None)
        for one, grad in checked
    ]
    dtype = compute_dtype(executor.accelerator, model)
    with executor.tiles(), record_function("dynbsz/self_check"):
        if len(passes) == 1:
            result, note = _check(executor, layouts, table, passes[0], passes[0].alone, dtype), ""
        else:
            result, note = _check_models(executor, layouts, table, passes, dtype)
    summary = result.summary(layouts) + note + probe_note
    if no_gradients is not None:
        summary += f" Gradients not compared: {no_gradients}."
    return result, summary, passes, table


def _with_memory(summary: str, memory: list[str], result: CheckResult) -> str:
    """The check's summary, with what ran out of memory (``memory``: each try's error) and what followed."""
    if not memory:
        return summary
    cut = f"every completion cut to its first {GRADIENT_COMPLETION} tokens"
    if result.out_of_memory:
        return (
            f"self-check: its passes ran out of memory ({memory[0]}), and again on smaller probes ({cut}: "
            f"{memory[-1]}): no layout was checked, stock TRL math runs (stock's micro-batches)."
        )
    return (
        f"{summary} Its first try ran out of memory ({memory[0]}): the cached memory was freed and the check ran "
        f"again on smaller probes ({cut}; log-probs beyond them not compared)."
    )


def _check_models(executor, layouts, table: SequenceTable, passes: list[CheckPasses], dtype) -> tuple[CheckResult, str]:
    """:func:`_check` of several models (a distillation's student, then its teacher): the fastest layout every model
    passes. Each model is checked from the layout the others reached, until all pass the same one (every process
    makes the same checks: each step of each is agreed); the result is the first model's, with every model's reasons
    and the layout they all passed, and a sentence on the others' log-probs for the log."""
    alone = [functools.cache(one.alone) for one in passes]
    other = getattr(executor.loss, "checked_model_name", "teacher")  # the second model's name in the log
    start, passed, reasons, results = 0, set(), [], {}
    while start < len(layouts) and len(passed) < len(passes):
        index = min(set(range(len(passes))) - passed)
        result = _check(executor, layouts[start:], table, passes[index], alone[index], dtype)
        reasons += [f"{f'{other}: ' if index else ''}{reason}" for reason in result.reasons]
        if result.out_of_memory:  # every process stopped: the caller tries again smaller
            return result, ""
        passed = {index} if result.chosen else passed | {index}
        start += result.chosen
        results[index] = result
    if start >= len(layouts):
        return CheckResult(len(layouts), [], reasons), ""
    others = max(result.errors[-1] for index, result in results.items() if index)
    note = f" The {other}'s log-probs in that layout differ from each sample's own by {others:.1e} at most."
    return dataclasses.replace(results[0], chosen=start, reasons=reasons), note


def _check(executor, layouts, table: SequenceTable, passes: CheckPasses, alone, dtype: torch.dtype):
    """:func:`~hf_dynbsz.execution.self_check.run_self_check` of ``layouts`` through ``passes`` (``alone``: its
    samples alone, cached or not), at ``dtype``'s tolerances, every process agreeing through one all-reduce per layout
    tried (a pass out of memory on any process stops it everywhere: the result's ``out_of_memory``); gradients where
    ``passes`` computes them."""
    return run_self_check(
        layouts, table, passes.layout, alone, tolerance(dtype),
        agree=lambda vote: int(executor.world.all_reduce_max([vote])[0]),
        gradient_limit=gradient_tolerance(dtype), gradients=bool(passes.parameters),
        recovers=executor.recovery.recovers_in_check,
    )  # fmt: skip


def layout_timing(executor, model, table, layouts, schedulers, chosen: int, passes: CheckPasses):
    """The run's layout timing (:mod:`hf_dynbsz.execution.layout_timing`), from the self-check's result: on a
    device of :data:`~hf_dynbsz.execution.layout_timing.MEASURED_DEVICE_TYPES` with ``packing_layout="auto"``
    (no sequence parallelism, no memory limit: the memory model learns each pass's peak in the run's layout), the
    ``chosen`` layout (its index in ``layouts``) and the first layout of each other family below it that the
    self-check passes too (the same check through ``passes``, log-probs and gradients, the samples alone computed
    once, one all-reduce per layout tried); :data:`NO_LAYOUT_TIMING` (nothing measured) otherwise. ``schedulers``:
    one per layout."""
    device = executor.accelerator.device.type
    if not executor.enabled or executor.args.packing_layout != "auto" or executor.parallel.size > 1:
        return NO_LAYOUT_TIMING
    if executor.memory.limit_mib is not None:  # the memory model learns each pass's peak in the run's own layout
        return NO_LAYOUT_TIMING
    if device not in MEASURED_DEVICE_TYPES:
        return NO_LAYOUT_TIMING
    candidates = [Candidate(family(layouts[chosen]), schedulers[layouts[chosen]])]
    alone = functools.cache(passes.alone)
    dtype = compute_dtype(executor.accelerator, model)
    for index in range(chosen + 1, len(layouts)):
        name = family(layouts[index])
        if name in {candidate.name for candidate in candidates}:
            continue
        with executor.tiles():
            result = _check(executor, [layouts[index]], table, passes, alone, dtype)
        if result.chosen == 0:
            candidates.append(Candidate(name, schedulers[layouts[index]]))
    if len(candidates) == 1:
        return NO_LAYOUT_TIMING
    logger.info("hf_dynbsz: layout timing: %s pass the self-check.", ", ".join(c.name for c in candidates))
    return LayoutTiming(candidates, pass_clock(device), executor.world.all_gather)


class CheckPasses:
    """The check's passes for one run, through the executor's own collator, segments and forward (torch layer).

    ``executor``: the run's :class:`~hf_dynbsz.execution.executor.PassExecutor`; ``model``: the prepared model;
    ``schedulers``: one per layout (the layout's collator and segment settings); ``unsharded``: sequence parallelism
    of size 1 (the check's passes are unsharded, whatever the run's); ``gradients``: whether the passes compute
    gradients (see :meth:`gradients_skipped`). A pass runs the unwrapped model: the check's gradients go through
    ``torch.autograd.grad`` and reach neither the parameters' ``.grad`` nor DDP's or DeepSpeed's hooks.
    """

    def __init__(self, executor, model, table: SequenceTable, schedulers: dict, unsharded, gradients: bool) -> None:
        self.executor, self.schedulers, self.unsharded = executor, schedulers, unsharded
        self.tables = {False: table, True: gradient_table(table)}  # by whether a pass computes gradients
        self.model = executor.accelerator.unwrap_model(model)
        self.parameters = checked_parameters(self.model) if gradients else []

    @staticmethod
    def gradients_skipped(executor, model) -> str | None:
        """Why the check compares log-probs only, or None: under ZeRO-3 and FSDP a process holds a shard of each
        parameter (``torch.autograd.grad`` cannot give a parameter's whole gradient; under FSDP it would answer
        zeros, as the forward computes with gathered copies), and reentrant gradient checkpointing does
        not support ``torch.autograd.grad``."""
        plugin = getattr(executor.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and plugin.zero_stage == 3:
            return "DeepSpeed ZeRO-3 partitions the parameters"
        if executor.accelerator.distributed_type == DistributedType.FSDP:
            return "FSDP shards the parameters (a forward computes with gathered copies of them)"
        kwargs = getattr(executor.args, "gradient_checkpointing_kwargs", None) or {}
        if executor.args.gradient_checkpointing and kwargs.get("use_reentrant"):
            return "reentrant gradient checkpointing (use_reentrant=True) does not support torch.autograd.grad"
        if not any(p.requires_grad for p in model.parameters()):
            return "no trainable parameters"
        return None

    def alone(self, index: int, gradients: bool) -> Probe:
        """Sample ``index`` alone (:func:`alone_microbatch`), with its gradients when ``gradients``; a LongRoPE model
        gives it the factors of stock's micro-batch that holds it (:mod:`hf_dynbsz.execution.rope`), as passes do."""
        executor, table = self.executor, self.tables[gradients]
        mb = alone_microbatch(table, index, executor.pad_token_id, executor.accelerator.device)
        with stock_rope(self.model):
            return self._probe(mb, table, [index], gradients)

    def layout(self, layout: Layout, indices: list[int], gradients: bool) -> Probe:
        """One pass over ``indices`` in ``layout``, with gradients when ``gradients``. The check's first pass of a
        layout has none: sequence mixers decide there whether their blocks start from their prefix's states
        (:func:`~hf_dynbsz.execution.recurrence.prefix_states`), so that a pass with gradients, and gradient
        checkpointing's recomputation of it, take the path training will take."""
        executor, scheduler, table = self.executor, self.schedulers[layout], self.tables[gradients]
        mb = executor.microbatch(table, indices, scheduler)
        with executor.segments(self.model, scheduler, self.unsharded):
            return self._probe(mb, table, indices, gradients)

    def _forward(self, mb) -> torch.Tensor:
        with injected_fault(self.model, "check", self.executor.accelerator.process_index):  # (tests)
            return self.executor.forward(self.model, mb, False, autocast=False, parallel=self.unsharded)[0]

    def _probe(self, mb, table: SequenceTable, indices: list[int], gradients: bool) -> Probe:
        if not (gradients and self.parameters):
            with torch.no_grad():
                return Probe(self._forward(mb))
        with torch.enable_grad():
            logps = self._forward(mb)
            loss = check_loss(logps, indices, table.completion_lengths.tolist())
            return Probe(logps.detach(), gradients_of(loss, self.parameters))
