"""The self-check at start: the layouts a run may use, fastest first, against every sample computed alone (torch layer).

:mod:`hf_dynbsz.planning.model_support` decides from the model which layouts can be exact; this module verifies it on
real samples before the first pass of a run (a training step, or the old-policy / reference log-prob pass before it).
It runs one no-grad pass over a few of those samples in a layout, fastest first, and compares their completion
log-probs with the *per-sample reference*: each sample alone, as one unpadded row through the model's own attention
with no position ids given (what the model computes for that sequence by itself, as generation did). The first
layout within :func:`tolerance` on every process is kept, and the slower ones are not run; when none passes, stock
math runs. A layout whose pass raises is treated as failing, so a model the decision module misjudged steps down
instead of crashing mid-step. A pass that runs out of memory (the samples alone too) is no verdict on a layout: the
check stops on every process (the processes' votes say so) and reports it (:attr:`CheckResult.out_of_memory`), for
the caller to check again on smaller probes (:func:`check_layouts`).

Every process checks its own samples with the same number of forwards (ZeRO-3 gathers parameters in each): the
same count of references, then layout by layout with one all-reduce after each (did every process pass it?), so
the processes try the same layouts and stop at the same one.

A prefix tree is checked on a tree of at least three levels (:func:`tree_samples`: a node shared by all the probe's
tree samples, one below it shared by two, and where they part), from the step's own samples when they hold one,
else from two copies of one of them cut short inside its completion (:func:`tree_probe`); when no sample has the
completion tokens for that, the log says that the tree was not probed.

This module decides, :mod:`hf_dynbsz.execution.check_passes` measures, and calls go one way, from here down to there.
:func:`check_layouts` (once per run, from the executor's :meth:`~hf_dynbsz.execution.executor.PassExecutor.self_check`)
chooses what to check: the layouts, the samples, the tolerances of the compute dtype, every model the loss checks;
:func:`run_self_check` concludes from the :class:`~hf_dynbsz.execution.check_passes.Probe` of each pass (log-probs and
gradients, no verdict) that the :class:`~hf_dynbsz.execution.check_passes.CheckPasses` it is given measure; the
processes agree here, an out-of-memory error is judged here (and the check tried again on smaller probes), and here
the run's outcome is logged and set on the executor: its layout or stock math, and the layout timing
(:func:`layout_timing`). The passes call nothing of this module back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from hf_dynbsz.execution.check_passes import GRADIENT_COMPLETION, CheckPasses, Probe, gradient_table
from hf_dynbsz.execution.device_memory import is_out_of_memory, release_cached_memory
from hf_dynbsz.execution.layout_timing import (
    MEASURED_DEVICE_TYPES,
    NO_LAYOUT_TIMING,
    Candidate,
    LayoutTiming,
    family,
    pass_clock,
)
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.sequence_parallel import NoSequenceParallel
from hf_dynbsz.planning.model_support import Layout
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.planning.settings import SharePrefix

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "FAILED",
    "OUT_OF_MEMORY",
    "PASSED",
    "CheckResult",
    "check_layouts",
    "compute_dtype",
    "gradient_error",
    "gradient_samples",
    "gradient_tolerance",
    "layout_timing",
    "pick_samples",
    "run_self_check",
    "tolerance",
    "tree_probe",
    "tree_samples",
]

#: Samples per check (and per-sample reference forwards on every process).
SAMPLES = 4

#: A process's vote on a layout in :func:`run_self_check` (the processes agree on the largest): it passed, it did
#: not, or a pass of the check ran out of memory (no verdict: the check stops everywhere).
PASSED, FAILED, OUT_OF_MEMORY = 0, 1, 2


def tolerance(dtype: torch.dtype) -> float:
    """Largest difference of a completion token's log-prob from the per-sample reference that passes.

    ``dtype``: the precision the check computes in: the parameters', or under mixed precision the autocast dtype
    (accelerate wraps a prepared model's forward in autocast, so fp32 weights trained in bf16 mixed precision are
    checked in bf16: on an H200, a 24-layer model's log-probs of 1,000-token sequences differed by 8e-3 between
    every layout and the sample alone, bf16 noise that a fp32 tolerance turned into stock math).

    Packing changes only the order of floating-point sums: at most 4e-6 in fp32 over the whole model zoo of
    ``tests/test_model_zoo.py``, a few 1e-2 in bf16/fp16. Sequences that see each other, a missing window or a wrong
    position differ by 1e-1 and more; a recurrent state leaking into the next sequence of a row by 1e-3 on a tiny
    model: visible in fp32, not in bf16 (the decision module rules those layers out from the config).
    """
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def gradient_tolerance(dtype: torch.dtype) -> float:
    """Largest :func:`gradient_error` that passes, in the precision the check computes in (see :func:`tolerance`).

    Packing changes only the order of floating-point sums. Over the 21 segment-recurrence families built from their
    defaults' layer patterns (with and without gradient checkpointing) the error was at most 1e-6 in fp32 and 2.6e-2
    under bf16 autocast (on CPU). A tiny Jamba whose blocks ignored their prefix's recurrent state gave 1.0e-2, visible
    in fp32 only; Falcon-Mamba's 0.39 and a detached prefix state are visible in bf16 too (the prefix-state decision
    itself runs in fp32: :mod:`hf_dynbsz.execution.recurrence`).
    """
    return 1e-3 if dtype in (torch.float32, torch.float64) else HALF_GRADIENT_TOLERANCE


#: :func:`gradient_tolerance` in bf16 / fp16: about 10x the noise bf16 autocast gave the families above.
HALF_GRADIENT_TOLERANCE = 0.25

#: The fraction of the largest gradient norm of any checked parameter that :func:`gradient_error` measures a
#: parameter's difference against, at the least: parameters that hardly learn from the check's samples (an expert no
#: token chose, a bias) compare against that floor instead of their own noise.
GRADIENT_FLOOR = 1e-3


def gradient_error(candidate: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest norm of a parameter's gradient difference from the reference's, relative to the norm of that
    parameter's reference gradient (at least :data:`GRADIENT_FLOOR` of the largest of any parameter), and the
    parameter's name."""
    norms = {name: float(g.float().norm()) for name, g in reference.items()}
    floor = GRADIENT_FLOOR * max(norms.values(), default=0.0)
    worst, where = 0.0, ""
    for name, expected in reference.items():
        difference = float((candidate[name].float() - expected.float()).norm())
        size = max(norms[name], floor)
        error = math.inf if math.isnan(difference) else difference / size if size else difference
        if error > worst or not where:
            worst, where = error, name
    return worst, where


def compute_dtype(accelerator, model) -> torch.dtype:
    """The precision the self-check's forwards compute in: the weights', or the autocast dtype of mixed precision
    (accelerate runs a prepared model's forward under autocast whatever the caller's context)."""
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
    return mixed or next(accelerator.unwrap_model(model).parameters()).dtype


def pick_samples(table: SequenceTable, count: int = SAMPLES, tree: bool = False) -> list[int]:
    """``count`` sample indices that exercise a layout (repeated when the table holds fewer).

    Two short completions of the largest prompt group with a prompt of at least 2 tokens (shared prompts are checked
    on siblings: :func:`_siblings`), then the longest and the shortest other samples (padded rows get padding; the
    longest reaches what only long sequences meet, such as a sliding window). With ``tree`` (a prefix tree to check)
    and a three-level tree in the table (:func:`tree_samples`), its three samples, then the longest other one.
    """
    lengths = table.lengths.tolist()
    chosen = (tree_samples(table) if tree else None) or _siblings(table)
    others = sorted((i for i in range(len(table)) if i not in chosen), key=lambda i: (-lengths[i], i))
    if others:
        chosen += [others[0]] + ([others[-1]] if len(others) > 1 and len(chosen) < 3 else [])
    chosen = sorted(set(chosen)) or [0]
    return (chosen * count)[:count]


def gradient_samples(table: SequenceTable, picked: Sequence[int], tree: bool = False) -> list[int]:
    """The samples of ``picked`` whose gradients the check compares: the siblings (a prefix's state handed to its
    blocks, or their keys gathered behind it, carry gradients back to the prompt; with ``tree``, the samples of
    :func:`tree_samples`, whose nested paths do) and the shortest other sample with a completion. Not the longest: a
    backward costs twice its forward, and its log-probs are compared all the same."""
    completions = table.completion_lengths.tolist()
    shared = (tree_samples(table) if tree else None) or _siblings(table)
    siblings = [i for i in shared if i in picked]
    others = sorted((i for i in set(picked) if i not in siblings and completions[i]), key=lambda i: (completions[i], i))
    return sorted(siblings + others[:1])


def tree_samples(table: SequenceTable) -> list[int] | None:
    """Three samples whose prefix tree (``table``'s, :meth:`SequenceTable.prefix_tree` ``"tree"``) has three levels:
    two that share a node below another shared node and part below it, and a third that shares only the node above;
    None when the table holds no such samples. The deepest such node is taken (the longest paths of nodes), and under
    it and beside it the shortest samples with a completion (the cheapest passes whose log-probs count)."""
    tree = table.prefix_tree(SharePrefix.TREE)
    lengths, completions = table.lengths.tolist(), table.completion_lengths.tolist()
    children, through, paths = tree.children(), tree.samples_through(), tree.paths()

    def cheapest(samples):
        return min(samples, key=lambda i: (completions[i] == 0, lengths[i], i))

    best = None
    for node, above in enumerate(tree.parent):
        if above < 0 or len(children[node]) < 2:
            continue
        inside = set(through[node])
        beside = [i for i in through[above] if i not in inside]
        depth = paths[through[node][0]].index(node)  # nodes above it
        if beside and (best is None or depth > best[0]):
            picked = [cheapest(through[child]) for child in children[node][:2]] + [cheapest(beside)]
            best = (depth, sorted(picked))
    return None if best is None else best[1]


def tree_probe(table: SequenceTable, layouts: Sequence[Layout]) -> tuple[SequenceTable, str]:
    """The samples the self-check of ``layouts`` picks from, and a sentence for its log (empty: nothing to say).

    Without a prefix tree among ``layouts``, or when ``table``'s samples hold a three-level tree
    (:func:`tree_samples`): ``table``. Otherwise ``table`` with two copies of its shortest sample of at least 3
    completion tokens, cut inside its completion at a third and two thirds of its first
    :data:`~hf_dynbsz.execution.check_passes.GRADIENT_COMPLETION` tokens: the three share the prompt and the first
    tokens, the longer two the next ones, and all three part (in the gradient passes too, whose completions are cut
    there). When no sample can give that tree, ``table`` and the sentence that the tree was not probed."""
    if not any(layout.sharing is SharePrefix.TREE for layout in layouts) or tree_samples(table) is not None:
        return table, ""
    completions, lengths = table.completion_lengths.tolist(), table.lengths.tolist()
    candidates = [i for i, c in enumerate(completions) if c >= 3]
    if candidates:
        index = min(candidates, key=lambda i: (lengths[i], i))
        kept = min(completions[index], GRADIENT_COMPLETION)
        probe = _with_cut_copies(table, index, [kept // 3, 2 * kept // 3])
        if tree_samples(probe) is not None:
            return probe, (
                " The step's samples share no prefix three levels deep: the prefix tree was probed on two copies of "
                "one of them cut short."
            )
    return table, (
        " The prefix tree was not probed: the step's samples share no prefix three levels deep and none has the 3 "
        "completion tokens to make one, so its check was the prompt groups'."
    )


def _with_cut_copies(table: SequenceTable, index: int, completion_tokens: Sequence[int]) -> SequenceTable:
    """``table`` and, after its samples, copies of sample ``index`` whose completions are cut to each of
    ``completion_tokens`` (its prompt, images, token fields, positions and rope width kept alike)."""
    prompt = int(table.prompt_lengths[index])
    ends = [prompt + tokens for tokens in completion_tokens]
    fields = table.token_fields
    return SequenceTable(
        tokens=[*table.tokens, *(table.tokens[index][:end] for end in ends)],
        prompt_lengths=torch.cat([table.prompt_lengths, table.prompt_lengths.new_tensor([prompt] * len(ends))]),
        completion_lengths=torch.cat(
            [table.completion_lengths, table.completion_lengths.new_tensor(completion_tokens)]
        ),
        media=None if table.media is None else [*table.media, *(table.media[index] for _ in ends)],
        token_fields={name: [*values, *(values[index][:end] for end in ends)] for name, values in fields.items()}
        if fields
        else fields,
        positions=None
        if table.positions is None
        else [*table.positions, *(table.positions[index][:, :end] for end in ends)],
        rope_widths=None
        if table.rope_widths is None
        else table.rope_widths[[*range(len(table)), *[index] * len(ends)]],
    )


def _siblings(table: SequenceTable) -> list[int]:
    """Two samples of the largest prompt group (prompt of at least 2 tokens) with the shortest completions of at least
    :data:`SIBLING_COMPLETION` tokens (shorter ones next, empty ones last): a block of a few tokens already takes its
    prefix's state or keys, and their backward costs little."""
    prompts = table.prompt_lengths.tolist()
    completions = table.completion_lengths.tolist()
    members: dict[int, list[int]] = {}
    for index, group in enumerate(table.prompt_groups()):
        if prompts[index] > 1:
            members.setdefault(group, []).append(index)
    if not members:
        return []
    siblings = max(members.values(), key=len)
    return sorted(
        siblings, key=lambda i: (completions[i] == 0, completions[i] < SIBLING_COMPLETION, completions[i], i)
    )[:2]


#: The fewest completion tokens a sibling of :func:`pick_samples` has, where its group has them.
SIBLING_COMPLETION = 4


@dataclass(frozen=True)
class CheckResult:
    """``chosen``: index of the layout to use (``len(layouts)``: none, stock math); ``errors``: per layout tried (the
    chosen one and those before it), the largest log-prob difference from the reference on this process (``inf``
    when its pass raised, or its gradients differed); ``reasons``: one line per layout left, for the log;
    ``gradient_errors``: per layout whose gradients were compared, :func:`gradient_error`; ``gradients_checked``:
    whether the probes carried gradients; ``limit``, ``gradient_limit``: the tolerances the check applied;
    ``out_of_memory``: where a pass of the check ran out of memory (on this process, or another's), the error's first
    line, and nothing was decided (``chosen`` is ``len(layouts)``); empty otherwise."""

    chosen: int
    errors: list[float]
    reasons: list[str]
    gradient_errors: list[float] = field(default_factory=list)
    gradients_checked: bool = False
    limit: float = math.nan
    gradient_limit: float = math.nan
    out_of_memory: str = ""

    def summary(self, layouts: Sequence[Layout]) -> str:
        """What the run trains with and why, for the log."""
        why = "; ".join(self.reasons)
        if self.chosen == len(layouts):
            return (
                f"self-check: no layout gives each sample's own log-probs and gradients on this model, stock TRL "
                f"math runs ({why})."
            )
        if self.chosen:
            return (
                f"self-check: {layouts[self.chosen].describe()} runs, the faster layouts differ from each "
                f"sample's own log-probs or gradients ({why})."
            )
        gradients = ""
        if self.gradients_checked and self.gradient_errors:
            gradients = f", gradients {self.gradient_errors[0]:.1e} of {self.gradient_limit:g}"
        return (
            f"self-check passed: {layouts[0].describe()} (largest log-prob difference {self.errors[0]:.1e} of "
            f"{self.limit:g}{gradients})."
        )


def run_self_check(
    layouts: Sequence[Layout],
    table: SequenceTable,
    run_layout: Callable[[Layout, list[int], bool], Probe],
    run_alone: Callable[[int, bool], Probe],
    limit: float,
    agree: Callable[[int], int] = lambda vote: vote,
    gradient_limit: float = math.inf,
    gradients: bool = True,
    recovers: Callable[[BaseException], bool] = is_out_of_memory,
) -> CheckResult:
    """Check ``layouts`` (fastest first) on a few samples of ``table``, up to the first that every process passes.

    ``run_layout(layout, indices, gradients)`` returns the :class:`Probe` of one pass over those samples in that
    layout, ``run_alone(index, gradients)`` that of the sample alone (``(1, width)`` log-probs); with ``gradients``,
    over the samples of :func:`~hf_dynbsz.execution.check_passes.gradient_table` and with the gradients of
    :func:`~hf_dynbsz.execution.check_passes.check_loss`. The log-probs of :func:`pick_samples` (its repeats keep the
    forward count equal on every process) are compared in one pass without gradients; where they pass, the gradients
    of :func:`gradient_samples` in a second pass. ``limit`` is the log-prob
    tolerance, ``gradient_limit`` the gradient tolerance (:func:`gradient_error`); ``agree(vote)`` the largest vote
    of every process on the layout tried (:data:`PASSED`, :data:`FAILED` or :data:`OUT_OF_MEMORY`: an all-reduce
    every process calls once per layout tried). ``gradients=False``, or probes that carry none, compare log-probs only
    (``gradients=False`` where the gradient passes' count may not differ between processes: under ZeRO-3 every
    forward gathers parameters). ``recovers(error)``: whether an error a pass raised is an out-of-memory error the
    caller recovers from (or it raises it, saying why not): then no layout is judged, every process stops at the
    layout it is on (its vote is :data:`OUT_OF_MEMORY`) and the result says so (:attr:`CheckResult.out_of_memory`).
    Any other error of a sample alone is raised; of a layout's pass, leaves that layout.
    """
    tree = any(layout.sharing is SharePrefix.TREE for layout in layouts)
    samples = pick_samples(table, tree=tree)
    distinct = sorted(set(samples))
    graded = gradient_samples(table, distinct, tree=tree) if gradients else []
    memory, reference, reference_gradients = "", {}, None
    try:
        for index in samples:  # the same number of forwards on every process
            reference.setdefault(index, run_alone(index, False).logps[0])
        for index in graded:
            reference_gradients = _summed(reference_gradients, run_alone(index, True).gradients)
    except Exception as failure:  # noqa: BLE001 - raised again unless an out-of-memory error recovered
        if not recovers(failure):
            raise
        memory = _first_line(failure)
    judge = _Judge(distinct, table.completion_lengths.tolist(), run_layout, recovers, limit, gradient_limit)
    errors, gradient_errors, reasons = [], [], []
    for layout in layouts:
        error, reason = math.inf, ""
        if not memory:
            try:
                error, reason = judge(layout, reference, graded, reference_gradients, gradient_errors)
            except _RanOutOfMemory as failure:
                memory = str(failure)
        vote = agree(OUT_OF_MEMORY if memory else PASSED if error <= limit else FAILED)
        if vote == OUT_OF_MEMORY:
            memory = memory or "a pass of another process's self-check ran out of memory"
            break
        errors.append(error)
        if vote == PASSED:
            break
        reasons.append(reason if error > limit else f"{layout.describe()}: another process found it inexact")
    chosen = len(layouts) if memory else len(reasons)
    checked = reference_gradients is not None
    return CheckResult(chosen, errors, reasons, gradient_errors, checked, limit, gradient_limit, memory)


class _RanOutOfMemory(Exception):
    """A pass of the check ran out of memory (its message: the error's first line)."""


def _first_line(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:300]}"


@dataclass(frozen=True)
class _Judge:
    """One layout's verdict in :func:`run_self_check`: its log-probs, and where they pass and there are reference
    gradients, its gradients (appended to ``gradient_errors``). Returns ``(error, reason)`` (``inf`` where the
    gradients differ); raises :class:`_RanOutOfMemory` where a pass ran out of memory (``recovers``)."""

    distinct: list[int]
    completions: list[int]
    run_layout: Callable
    recovers: Callable[[BaseException], bool]
    limit: float
    gradient_limit: float

    def __call__(self, layout, reference, graded, reference_gradients, gradient_errors) -> tuple[float, str]:
        error, reason = _layout_error(
            layout, self.distinct, self.completions, self.run_layout, reference, self.limit, self.recovers
        )
        if error <= self.limit and reference_gradients is not None:
            gradient, reason = _gradient_error(
                layout, graded, self.run_layout, reference_gradients, self.gradient_limit, self.recovers
            )
            gradient_errors.append(gradient)
            error = error if gradient <= self.gradient_limit else math.inf  # a wrong backward trains wrong all the same
        return error, reason


def _gradient_error(layout, graded, run_layout, reference, gradient_limit, recovers) -> tuple[float, str]:
    """:func:`gradient_error` of one pass in ``layout`` with gradients (``inf`` when it raised), and the line that
    says so; :class:`_RanOutOfMemory` where it ran out of memory (``recovers``)."""
    try:
        error, name = gradient_error(run_layout(layout, graded, True).gradients, reference)
    except Exception as failure:  # noqa: BLE001 - a layout the model cannot train is a layout not to use
        if recovers(failure):
            raise _RanOutOfMemory(_first_line(failure)) from None
        return math.inf, f"{layout.describe()}: backward: {_first_line(failure)}"
    return error, (
        f"{layout.describe()}: gradients differ from each sample's own by {error:.2e} at {name} "
        f"(tolerance {gradient_limit:g})"
    )


def _summed(total: dict | None, gradients: dict | None) -> dict | None:
    if gradients is None:
        return total
    if total is None:
        return dict(gradients)
    return {name: total[name] + gradient for name, gradient in gradients.items()}


def _layout_error(layout, distinct, completions, run_layout, reference, limit, recovers) -> tuple[float, str]:
    """The largest completion log-prob difference of one pass in ``layout`` from the references (``inf`` when the
    pass raised or gave NaN), and the line that says so; :class:`_RanOutOfMemory` where it ran out of memory
    (``recovers``)."""
    try:
        logps = run_layout(layout, distinct, False).logps
        error = max(
            (
                float((logps[row, : completions[i]] - reference[i][: completions[i]]).abs().max())
                for row, i in enumerate(distinct)
                if completions[i]
            ),
            default=0.0,
        )
    except Exception as failure:  # noqa: BLE001 - a layout the model cannot run is a layout not to use
        if recovers(failure):
            raise _RanOutOfMemory(_first_line(failure)) from None
        return math.inf, f"{layout.describe()}: {_first_line(failure)}"
    error = math.inf if math.isnan(error) else error
    return error, f"{layout.describe()}: log-probs differ from each sample's own by {error:.2e} (tolerance {limit:g})"


def check_layouts(executor, model, table: SequenceTable) -> None:
    """The self-check of ``executor``'s run on ``table``'s samples: keep the fastest layout whose log-probs and
    gradients equal each sample's own, on every model the loss checks (a distillation's teacher too, log-probs only);
    when none does, stock math runs (``executor.enabled`` False). The check's passes are unsharded, whatever the run's
    sequence parallelism; a prefix tree is probed on three levels (:func:`tree_probe`, which may add cut copies of a
    sample, or say that it could not); the run's layout timing follows from its result.

    A pass of the check that runs out of memory (here or on another process) is recovered as a training pass's is
    (:meth:`~hf_dynbsz.execution.recovery.OutOfMemoryRecovery.recovers_in_check`): the cached memory is freed and the
    check runs again on smaller probes, every completion cut to its first
    :data:`~hf_dynbsz.execution.check_passes.GRADIENT_COMPLETION` tokens; when that runs out of memory too, stock math
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
    """:func:`run_self_check` of ``layouts`` through ``passes`` (``alone``: its samples alone, cached or not), at
    ``dtype``'s tolerances, every process agreeing through one all-reduce per layout tried (a pass out of memory on
    any process stops it everywhere: the result's ``out_of_memory``); gradients where ``passes`` computes them."""
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
