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
the caller to check again on smaller probes (:func:`~hf_dynbsz.execution.check_passes.check_layouts`).

Every process checks its own samples with the same number of forwards (ZeRO-3 gathers parameters in each): the
same count of references, then layout by layout with one all-reduce after each (did every process pass it?), so
the processes try the same layouts and stop at the same one.

A prefix tree is checked on a tree of at least three levels (:func:`tree_samples`: a node shared by all the probe's
tree samples, one below it shared by two, and where they part), from the step's own samples when they hold one,
else from two copies of one of them cut short inside its completion (:func:`tree_probe`); when no sample has the
completion tokens for that, the log says that the tree was not probed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hf_dynbsz.execution.device_memory import is_out_of_memory
from hf_dynbsz.execution.packing import MicroBatch, SequenceTable, build_microbatch
from hf_dynbsz.planning.model_support import Layout
from hf_dynbsz.planning.settings import SharePrefix

__all__ = [
    "FAILED",
    "OUT_OF_MEMORY",
    "PASSED",
    "CheckResult",
    "Probe",
    "alone_microbatch",
    "check_loss",
    "checked_parameters",
    "gradient_error",
    "gradient_samples",
    "gradient_table",
    "gradient_tolerance",
    "gradients_of",
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


def checked_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters whose gradients the check compares: every kind of parameter (its name with layer
    numbers taken out: ``model.layers.*.mamba.A_log``) in the first and the last layer that has it, so attention,
    sequence mixers, MLPs, experts, routers, norms, embeddings and head are all covered at a cost that does not grow
    with depth."""
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for name, _ in parameters:
        kind = re.sub(r"\.\d+\.", ".*.", name)
        first.setdefault(kind, name)
        last[kind] = name
    kept = set(first.values()) | set(last.values())
    return [(name, p) for name, p in parameters if name in kept]


def gradients_of(loss: torch.Tensor, parameters: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The gradients of ``loss`` with respect to ``parameters`` (name to tensor; zeros where ``loss`` does not depend
    on one), through ``torch.autograd.grad``: nothing accumulates into ``.grad`` and no gradient hook of DDP or
    DeepSpeed runs."""
    found = [None] * len(parameters)
    if loss.requires_grad:
        found = torch.autograd.grad(loss, [p for _, p in parameters], allow_unused=True)
    return {name: (g if g is not None else torch.zeros_like(p)).detach() for (name, p), g in zip(parameters, found)}


def check_loss(logps: torch.Tensor, indices: Sequence[int], completions: Sequence[int]) -> torch.Tensor:
    """The scalar whose gradients the check compares: each completion token's log-prob times a fixed weight in
    [-1, 1) drawn for its sample and position (the same for a sample alone and in a pass), summed. ``logps``
    ``(rows, width)`` holds the samples ``indices`` row by row."""
    total = logps.new_zeros(())
    for row, index in enumerate(indices):
        length = completions[index]
        if length:
            weights = torch.rand(length, generator=torch.Generator().manual_seed(index)) * 2 - 1
            total = total + (logps[row, :length] * weights.to(logps.device, logps.dtype)).sum()
    return total


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
    completion tokens, cut inside its completion at a third and two thirds of its first :data:`GRADIENT_COMPLETION`
    tokens: the three share the prompt and the first tokens, the longer two the next ones, and all three part (in the
    gradient passes too, whose completions are cut at :data:`GRADIENT_COMPLETION`). When no sample can give that
    tree, ``table`` and the sentence that the tree was not probed."""
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

#: Completion tokens per sample that the gradient comparison keeps (:func:`gradient_table`).
GRADIENT_COMPLETION = 16


def gradient_table(table: SequenceTable, completion_tokens: int = GRADIENT_COMPLETION) -> SequenceTable:
    """``table`` with every completion cut to its first ``completion_tokens`` tokens (prompts, their images, token
    fields and positions kept alike): the samples of the check's passes with gradients. A block of a few tokens
    already takes its prefix's state or keys, and hands gradients back through them; a backward's cost grows with
    the tokens (a step of 512-token completions checked whole took 3.4 times the check of log-probs alone)."""
    completions = table.completion_lengths.clamp(max=completion_tokens)
    lengths = (table.prompt_lengths + completions).tolist()
    fields = table.token_fields
    return SequenceTable(
        tokens=[tokens[:length] for tokens, length in zip(table.tokens, lengths)],
        prompt_lengths=table.prompt_lengths,
        completion_lengths=completions,
        media=table.media,
        token_fields={name: [v[:n] for v, n in zip(values, lengths)] for name, values in fields.items()}
        if fields
        else fields,
        positions=None if table.positions is None else [p[:, :n] for p, n in zip(table.positions, lengths)],
        rope_widths=table.rope_widths,
    )


def alone_microbatch(table: SequenceTable, index: int, pad_token_id: int, device) -> MicroBatch:
    """The per-sample reference's input: sample ``index`` as one unpadded row with an all-ones attention mask and no
    position ids (the model positions it as it does any single sequence, as generation did)."""
    mb = build_microbatch(
        table, [index], layout="padded", pad_token_id=pad_token_id, device=device, attention_mask=True
    )
    mb.model_inputs.pop("position_ids", None)
    return mb


@dataclass(frozen=True)
class Probe:
    """One pass of the check: completion log-probs ``(rows, width)``, and the gradients of :func:`check_loss` with
    respect to the checked parameters (name to tensor; None where the pass computed none)."""

    logps: torch.Tensor
    gradients: dict[str, torch.Tensor] | None = None


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
    over the samples of :func:`gradient_table` and with the gradients of :func:`check_loss`. The log-probs of
    :func:`pick_samples` (its repeats keep the forward count equal on every process) are compared in one pass without
    gradients; where they pass, the gradients of :func:`gradient_samples` in a second pass. ``limit`` is the log-prob
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
