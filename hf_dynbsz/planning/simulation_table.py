"""The tables of ``hf-dynbsz plan --lengths`` (:mod:`hf_dynbsz.planning.simulation`): per optimizer step, the passes
against stock TRL's padded micro-batches on one process (:func:`render_simulation`), or the passes and rank imbalance
with and without cross-rank balancing over several processes (:func:`render_processes`), each under notes saying what
was simulated and what the columns mean; aligned by :func:`~hf_dynbsz.planning.plan_table.text_table`.

Pure Python (no torch, no TRL).
"""

from __future__ import annotations

import textwrap

from hf_dynbsz.planning.plan_table import text_table
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.planning.simulation import SimulatedRound, StepFigures

__all__ = ["render_processes", "render_simulation"]

_SIMULATION_HEADER = (
    "step",
    "samples",
    "real tokens",
    "budget",
    "micro-batches",
    "lower bound",
    "utilisation",
    "computed tokens",
    "stock tokens",
    "saved",
)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _simulation_rows(steps: list[tuple[StepFigures, bool]]) -> list[tuple[str, ...]]:
    """The rows of :func:`render_simulation`, one per ``(figures, partial)`` step, then the totals."""
    rows = [
        _figures_row(str(number) + ("*" if partial else ""), figures)
        for number, (figures, partial) in enumerate(steps, start=1)
    ]
    return [*rows, _figures_row("total", StepFigures.total([figures for figures, _ in steps]))]


def _figures_row(label: str, figures: StepFigures) -> tuple[str, ...]:
    return (
        label,
        str(figures.samples),
        str(figures.real_tokens),
        "-" if figures.budget is None else str(figures.budget),
        str(figures.passes),
        str(figures.lower_bound),
        _percent(figures.utilisation),
        str(figures.computed_tokens),
        str(figures.stock_tokens),
        _percent(figures.saved),
    )


def _simulation_notes(plan, scheduler: Scheduler, rounds: list[SimulatedRound], totals_only: bool, layout_note: str):
    """The notes above :func:`render_simulation`'s table: what was simulated, what the columns mean, oversize."""
    if plan.max_tokens_per_microbatch:
        budget_text = f"{plan.max_tokens_per_microbatch} tokens"
    elif totals_only:
        budget_text = (
            f"auto = {plan.per_device_train_batch_size} x longest sample of the step (totals only: give PROMPT "
            "COMPLETION pairs for the exact rule, longest prompt + longest completion)"
        )
    else:
        budget_text = f"auto = {plan.per_device_train_batch_size} x (longest prompt + longest completion) of the step"
    samples = sum(len(step.lengths[0]) for step in rounds)
    notes = [
        f"Simulated {samples} samples of one device, {plan.per_device_samples_per_optimizer_step} per optimizer step "
        f"(per_device_train_batch_size {plan.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{plan.gradient_accumulation_steps}); budget: {budget_text}; layout: {scheduler.layout}{layout_note}; "
        f"pad_to_multiple_of: {plan.pad_to_multiple_of or 'none'}.",
        "lower bound = fewest micro-batches the step's tokens allow (each oversize sequence counts one); utilisation "
        "= real tokens / (micro-batches x budget), over the micro-batches within the budget; computed tokens = "
        "tokens the micro-batches compute (shared prompts and prefixes once, padding included; real tokens count "
        "each sample's own); stock tokens = stock "
        "TRL's micro-batches of per_device_train_batch_size samples padded to the step's longest row.",
    ]
    notes = [textwrap.fill(note, width=110, break_on_hyphens=False) for note in notes]
    if any(step.partial for step in rounds):
        notes.append("* partial optimizer step (fewer samples than a full step).")
    oversize = [step.lengths[0][i] for step in rounds for i in step.balanced[0].oversize]
    if oversize:
        budget = max(step.balanced[0].budget for step in rounds if step.balanced[0].oversize)
        notes.append(
            "warning: "
            + scheduler.oversize_warning(len(oversize), max(oversize), budget).split(": ", 1)[1]
            + " (oversize_policy='warn')"
        )
        notes.append(
            "Their passes count in micro-batches and lower bound and are left out of utilisation; "
            "oversize_policy='error' stops training instead."
        )
    return notes


def render_simulation(
    plan, scheduler: Scheduler, rounds: list[SimulatedRound], totals_only: bool, layout_note: str = ""
) -> str:
    """The table of :func:`~hf_dynbsz.planning.simulation.simulate` on one process: micro-batches vs stock TRL's padded
    micro-batches, per step."""
    steps = [(StepFigures.of(step.lengths[0], step.balanced[0], step.stock_tokens), step.partial) for step in rounds]
    notes = _simulation_notes(plan, scheduler, rounds, totals_only, layout_note)
    rows = _simulation_rows(steps)
    return "\n".join([*notes, "", *text_table(_SIMULATION_HEADER, rows, ">" * len(_SIMULATION_HEADER))])


def render_processes(plan, scheduler: Scheduler, rounds: list[SimulatedRound]) -> str:
    """The table of :func:`~hf_dynbsz.planning.simulation.simulate` over several processes: passes and rank
    imbalance without and with balancing."""
    header = (
        "step",
        "samples",
        "real tokens",
        "budget",
        "passes (no balancing)",
        "passes (balanced)",
        "rank imbalance (no balancing)",
        "rank imbalance (balanced)",
        "samples moved",
        "computed tokens",
        "stock tokens",
    )
    rows = []
    for number, step in enumerate(rounds, start=1):
        active = step.balanced if scheduler.balance_across_ranks else step.unbalanced
        before, after = step.imbalance
        computed = sum(sum(s.pass_tokens) for s in active)
        rows.append(
            (
                str(number) + ("*" if step.partial else ""),
                str(sum(map(len, step.lengths))),
                str(sum(map(sum, step.lengths))),
                str(active[0].budget),
                str(step.unbalanced[0].passes),
                str(step.balanced[0].passes),
                f"{before:.2f}",
                f"{after:.2f}",
                str(step.balanced[0].samples_moved),
                str(computed),
                str(step.stock_tokens),
            )
        )
    note = (
        f"Simulated {sum(sum(map(len, r.lengths)) for r in rounds)} samples over {plan.num_processes} processes, "
        f"{plan.per_device_samples_per_optimizer_step} per process per optimizer step (process 0's first in each "
        f"step); layout: {scheduler.layout}; balance_across_ranks: {'on' if scheduler.balance_across_ranks else 'off'} "
        "(computed tokens follow it). rank imbalance = largest per-process cost over the mean (workload model); "
        "passes = passes every process runs per step (the busiest process's count)."
    )
    notes = [textwrap.fill(note, width=110, break_on_hyphens=False)]
    if any(step.partial for step in rounds):
        notes.append("* partial optimizer step (fewer samples than a full step), over the processes that hold them.")
    return "\n".join([*notes, "", *text_table(header, rows, ">" * len(header))])
