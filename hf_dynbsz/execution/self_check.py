"""The self-check at start: the layouts a run may use, fastest first, against every sample computed alone (torch layer).

:mod:`hf_dynbsz.planning.model_support` decides from the model which layouts can be exact; this module verifies it on
real samples before the first pass of a run (a training step, or the old-policy / reference log-prob pass before it).
It runs one no-grad pass over a few of those samples in a layout, fastest first, and compares their completion
log-probs with the *per-sample reference*: each sample alone, as one unpadded row through the model's own attention
with no position ids given (what the model computes for that sequence by itself, as generation did). The first
layout within :func:`tolerance` on every process is kept, and the slower ones are not run; when none passes, stock
math runs. A layout whose pass raises is treated as failing, so a model the decision module misjudged steps down
instead of crashing mid-step.

Every process checks its own samples with the same number of forwards (ZeRO-3 gathers parameters in each): the
same count of references, then layout by layout with one all-reduce after each (did every process pass it?), so
the processes try the same layouts and stop at the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_dynbsz.execution.packing import MicroBatch, SequenceTable, build_microbatch
from hf_dynbsz.planning.model_support import Layout

__all__ = ["CheckResult", "alone_microbatch", "pick_samples", "run_self_check", "tolerance"]

#: Samples per check (and per-sample reference forwards on every process).
SAMPLES = 4


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


def pick_samples(table: SequenceTable, count: int = SAMPLES) -> list[int]:
    """``count`` sample indices that exercise a layout (repeated when the table holds fewer).

    The two longest completions of the largest prompt group with a prompt of at least 2 tokens (shared prompts
    are checked on siblings), then the longest and the shortest other samples (padded rows get padding).
    """
    lengths = table.lengths.tolist()
    prompts = table.prompt_lengths.tolist()
    completions = table.completion_lengths.tolist()
    members: dict[int, list[int]] = {}
    for index, group in enumerate(table.prompt_groups()):
        if prompts[index] > 1:
            members.setdefault(group, []).append(index)
    chosen: list[int] = []
    if members:
        siblings = max(members.values(), key=len)
        chosen += sorted(siblings, key=lambda i: (-completions[i], i))[:2]
    others = sorted((i for i in range(len(table)) if i not in chosen), key=lambda i: (-lengths[i], i))
    if others:
        chosen += [others[0]] + ([others[-1]] if len(others) > 1 else [])
    chosen = sorted(set(chosen)) or [0]
    return (chosen * count)[:count]


def alone_microbatch(table: SequenceTable, index: int, pad_token_id: int, device) -> MicroBatch:
    """The per-sample reference's input: sample ``index`` as one unpadded row with an all-ones attention mask and no
    position ids (the model positions it as it does any single sequence, as generation did)."""
    mb = build_microbatch(
        table, [index], layout="padded", pad_token_id=pad_token_id, device=device, attention_mask=True
    )
    mb.model_inputs.pop("position_ids", None)
    return mb


@dataclass(frozen=True)
class CheckResult:
    """``chosen``: index of the layout to use (``len(layouts)``: none, stock math); ``errors``: per layout tried (the
    chosen one and those before it), the largest log-prob difference from the reference on this process (``inf``
    when its pass raised); ``reasons``: one line per layout left, for the log."""

    chosen: int
    errors: list[float]
    reasons: list[str]

    def summary(self, layouts: Sequence[Layout]) -> str:
        """What the run trains with and why, for the log."""
        why = "; ".join(self.reasons)
        if self.chosen == len(layouts):
            return (
                f"self-check: no layout gives each sample's own log-probs on this model, stock GRPOTrainer math "
                f"runs ({why})."
            )
        if self.chosen:
            return (
                f"self-check: {layouts[self.chosen].describe()} runs, the faster layouts differ from each "
                f"sample's own log-probs ({why})."
            )
        return f"self-check passed: {layouts[0].describe()} (largest log-prob difference {self.errors[0]:.1e})."


def run_self_check(
    layouts: Sequence[Layout],
    table: SequenceTable,
    run_layout: Callable[[Layout, list[int]], torch.Tensor],
    run_alone: Callable[[int], torch.Tensor],
    limit: float,
    agree: Callable[[bool], bool] = lambda passed: passed,
) -> CheckResult:
    """Check ``layouts`` (fastest first) on a few samples of ``table``, up to the first that every process passes.

    ``run_layout(layout, indices)`` returns the completion log-probs ``(rows, width)`` of one pass over those
    samples in that layout; ``run_alone(index)`` those of the sample alone ``(1, width)``; ``limit`` the tolerance;
    ``agree(passed)`` whether every process passed the layout this one ``passed`` or not (an all-reduce; every
    process calls it once per layout tried).
    """
    samples = pick_samples(table)
    distinct = sorted(set(samples))
    completions = table.completion_lengths.tolist()
    reference = {}
    for index in samples:  # the same number of forwards on every process
        alone = run_alone(index)
        reference.setdefault(index, alone[0])
    errors, reasons = [], []
    for layout in layouts:
        error, reason = _layout_error(layout, distinct, completions, run_layout, reference, limit)
        errors.append(error)
        if agree(error <= limit):
            break
        reasons.append(reason if error > limit else f"{layout.describe()}: another process found it inexact")
    chosen = len(reasons)
    return CheckResult(chosen, errors, reasons)


def _layout_error(layout, distinct, completions, run_layout, reference, limit) -> tuple[float, str]:
    """The largest completion log-prob difference of one pass in ``layout`` from the references (``inf`` when the
    pass raised or gave NaN), and the line that says so."""
    try:
        logps = run_layout(layout, distinct)
        error = max(
            (
                float((logps[row, : completions[i]] - reference[i][: completions[i]]).abs().max())
                for row, i in enumerate(distinct)
                if completions[i]
            ),
            default=0.0,
        )
    except Exception as failure:  # noqa: BLE001 - a layout the model cannot run is a layout not to use
        return math.inf, f"{layout.describe()}: {type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
    error = math.inf if math.isnan(error) else error
    return error, f"{layout.describe()}: log-probs differ from each sample's own by {error:.2e} (tolerance {limit:g})"
