"""The simulation of ``hf-dynbsz plan --lengths``: a list of sample lengths scheduled step by step, as training would.

:func:`read_lengths` reads the lengths file (totals, ``PROMPT COMPLETION`` or ``PROMPT COMPLETION GROUP`` per sample),
:func:`read_pair_lengths` a DPO run's (``PROMPT CHOSEN REJECTED`` per preference pair); :func:`simulate` cuts the
samples into optimizer steps over ``num_processes`` processes and schedules each step with the trainer's own
:class:`~hf_dynbsz.planning.schedule.Scheduler` (through :func:`~hf_dynbsz.planning.schedule.simulate_processes`: the
scheduler's phases for every process in one thread, each collective computed over the processes' values), with and
without cross-rank balancing; :class:`StepFigures` are a step's figures on one process (passes, lower bound,
utilisation, computed and stock tokens) and their totals. The command line (:mod:`hf_dynbsz.cli`) renders them.

Units: lengths, budgets and token counts are tokens. Pure Python (no torch, no TRL).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from hf_dynbsz.planning.coerce import parse_int
from hf_dynbsz.planning.partition import token_lower_bound
from hf_dynbsz.planning.prefix_tree import PrefixTree
from hf_dynbsz.planning.schedule import Scheduler, StepSchedule, simulate_processes, stock_microbatch_tokens
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.planning.tokens import round_up

__all__ = [
    "SimulatedRound",
    "StepFigures",
    "processes_as_dict",
    "prompt_groups",
    "read_lengths",
    "read_pair_lengths",
    "simulate",
    "simulation_as_dict",
]

#: A sample of the lengths file: ``(total, prompt, group)``, ``prompt``/``group`` None when the file does not give them.
Sample = tuple[int, int | None, int | None]


def _entries(text: str, path: str) -> list[tuple[Any, str]]:
    """The items of a lengths file, each with where it is (``"item 3"``, ``"line 7"``): a JSON list's items, or a
    line's one value or list of values (blank lines and ``#`` comments skipped)."""
    entries: list[tuple[Any, str]] = []
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lengths {path!r} is not a valid JSON list: {error}") from None
        if not isinstance(data, list):
            raise ValueError(f"--lengths {path!r}: expected a JSON list of integers or [prompt, completion] pairs.")
        for index, item in enumerate(data):
            entries.append((item, f"item {index}"))
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if line:
                parts = line.replace(",", " ").split()
                entries.append((parts[0] if len(parts) == 1 else parts, f"line {number}"))
    return entries


def read_lengths(path: str) -> list[Sample]:
    """Sample lengths in tokens from ``path``, as ``(total, prompt, group)`` (``prompt``/``group`` None when not given).

    Accepted formats: one integer per line (prompt + completion tokens; blank lines and ``#`` comments skipped),
    lines ``PROMPT COMPLETION`` or ``PROMPT COMPLETION GROUP``; or a JSON list of integers, or of ``[prompt,
    completion]`` pairs or ``[prompt, completion, group]`` triples. With separate prompt and completion lengths the
    automatic budget and stock TRL's padding are exact (TRL pads prompts and completions separately); with totals
    only they use the longest total. ``GROUP`` (an integer, equal for samples whose prompts are identical) says
    which samples may share a prompt; without it, each run of ``num_generations`` consecutive samples with equal
    prompt lengths is taken for one prompt's completions. A file that cannot be read or holds anything else:
    ``ValueError`` naming the file, the line or item and what was expected.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"cannot read --lengths {path!r}: {error.strerror or error}") from None

    def as_length(value: Any, where: str) -> int:
        number = parse_int(value)
        if number is None or number < 0:
            raise ValueError(
                f"--lengths {path!r}: {where}: expected a non-negative integer number of tokens, got {value!r}."
            )
        return number

    lengths: list[Sample] = []
    for item, where in _entries(text, path):
        if isinstance(item, list | tuple):
            if len(item) not in (2, 3):
                raise ValueError(f"--lengths {path!r}: {where}: expected PROMPT COMPLETION [GROUP], got {item!r}.")
            prompt, completion = as_length(item[0], where), as_length(item[1], where)
            group = as_length(item[2], where) if len(item) == 3 else None
            lengths.append((prompt + completion, prompt, group))
        else:
            lengths.append((as_length(item, where), None, None))
        if lengths[-1][0] < 1:
            raise ValueError(f"--lengths {path!r}: {where}: a sample has at least 1 token, got {lengths[-1][0]}.")
    if not lengths:
        raise ValueError(f"--lengths {path!r} holds no lengths.")
    if len({(prompt is None, group is None) for _, prompt, group in lengths}) > 1:
        raise ValueError(
            f"--lengths {path!r}: mix of formats (totals, PROMPT COMPLETION, PROMPT COMPLETION GROUP); use one."
        )
    return lengths


def read_pair_lengths(path: str) -> list[Sample]:
    """Preference pairs' lengths in tokens from ``path`` (``hf-dynbsz plan --trainer dpo``): lines ``PROMPT CHOSEN
    REJECTED`` or a JSON list of such triples, as two samples per pair, ``(prompt + chosen, prompt, pair)`` then
    ``(prompt + rejected, prompt, pair)`` (the pair's number its group: the two share their prompt). A file that
    cannot be read or holds anything else: ``ValueError`` naming the file, the line or item and what was expected."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"cannot read --lengths {path!r}: {error.strerror or error}") from None
    samples: list[Sample] = []
    for pair, (item, where) in enumerate(_entries(text, path)):
        values = [parse_int(value) for value in item] if isinstance(item, list | tuple) else []
        if len(values) != 3 or any(value is None or value < 0 for value in values) or min(values[1:]) < 1:
            raise ValueError(
                f"--lengths {path!r}: {where}: expected PROMPT CHOSEN REJECTED (tokens; each response at least 1) "
                f"for --trainer dpo, got {item!r}."
            )
        prompt, chosen, rejected = values
        samples += [(prompt + chosen, prompt, pair), (prompt + rejected, prompt, pair)]
    if not samples:
        raise ValueError(f"--lengths {path!r} holds no pairs.")
    return samples


def _pair_microbatches(plan, totals: list[int]) -> tuple[int, int]:
    """``(largest, all)``: token positions of stock DPOTrainer's micro-batches of one process's pairs (``totals``: the
    step's samples, chosen then rejected per pair): ``per_device_train_batch_size`` pairs each, ``2 B`` rows padded to
    their longest (``DataCollatorForPreference``)."""
    rows = 2 * plan.per_device_train_batch_size
    sizes = [
        len(totals[start : start + rows]) * round_up(max(totals[start : start + rows]), plan.pad_to_multiple_of)
        for start in range(0, len(totals), rows)
    ]
    return max(sizes, default=0), sum(sizes)


def prompt_groups(samples: list[Sample], num_generations: int) -> list[int] | None:
    """Prompt groups of a step's samples: the file's GROUP column, else runs of ``num_generations`` consecutive samples
    with equal prompt lengths; None with totals only (no prompt to share)."""
    if samples[0][1] is None:
        return None
    if samples[0][2] is not None:
        return [group for _, _, group in samples]
    groups, run = [], -1
    for index, (_, prompt, _) in enumerate(samples):
        if index % num_generations == 0 or prompt != samples[index - 1][1]:
            run += 1
        groups.append(run)
    return groups


@dataclass
class SimulatedRound:
    """One optimizer step of ``--lengths`` over several processes, with and without cross-rank balancing."""

    lengths: list[list[int]]  # per process, prompt + completion tokens per sample
    stock_tokens: int  # token positions stock TRL's padded micro-batches compute, all processes
    balanced: list[StepSchedule]  # per process, balance_across_ranks on
    unbalanced: list[StepSchedule]  # per process, balance_across_ranks off
    partial: bool

    @property
    def imbalance(self) -> tuple[float, float]:
        """The rank imbalance (largest per-process cost over the mean, workload model) without and with balancing:
        1.0 each for a step whose samples are all on one process (a partial step: nothing to balance)."""
        balance = self.balanced[0].balance
        return (1.0, 1.0) if balance is None else (balance.imbalance_before, balance.imbalance_after)


def simulate(
    plan, scheduler: Scheduler, lengths: list[Sample], shared_prefix: int = 0, pairs: bool = False
) -> list[SimulatedRound]:
    """The schedules of each optimizer step of ``lengths`` (samples in training order), as every process computes
    them: a step takes ``num_processes x per_device_train_batch_size x gradient_accumulation_steps`` samples, process
    0's first (the last step may be partial: it is simulated over the processes that hold its samples), and is
    scheduled by ``scheduler`` exactly as the trainer schedules it, with and without cross-rank balancing
    (:func:`~hf_dynbsz.planning.schedule.simulate_processes`). ``plan`` is the run's
    :class:`~hf_dynbsz.planning.plan.BatchSizePlan`. With ``max_tokens_per_microbatch`` unset, each process's budget
    is the automatic one, ``per_device_train_batch_size`` rows of stock TRL's padded width. Stock pads to the whole
    generation batch; equal to the optimizer step's when ``steps_per_generation == gradient_accumulation_steps`` (the
    default).
    ``shared_prefix``: with a prefix tree, every prompt begins with that many tokens in common
    (:meth:`~hf_dynbsz.planning.prefix_tree.PrefixTree.of_groups`). ``pairs``: ``lengths`` are preference pairs
    (:func:`read_pair_lengths`): a step takes two samples per pair, each pair's two in one pass, and stock's
    micro-batches pad their ``2 B`` rows to the longest (DPO's collator)."""
    per_process, processes = plan.per_device_samples_per_optimizer_step * (2 if pairs else 1), plan.num_processes
    rounds = []
    for start in range(0, len(lengths), per_process * processes):
        step = lengths[start : start + per_process * processes]
        parts = [step[p * per_process : (p + 1) * per_process] for p in range(processes)]
        parts = [part for part in parts if part]
        totals = [[total for total, _, _ in part] for part in parts]
        prompts = [[prompt or 0 for _, prompt, _ in part] for part in parts]
        groups = [prompt_groups(part, plan.num_generations) for part in parts]
        if pairs:
            stock_per_process = [_pair_microbatches(plan, ts) for ts in totals]
            budgets = [scheduler.budget(largest) for largest, _ in stock_per_process]
            stock = sum(every for _, every in stock_per_process)
        else:
            rows = [
                stock_microbatch_tokens(1, p, [t - q for t, q in zip(ts, p)], plan.pad_to_multiple_of)
                for ts, p in zip(totals, prompts)
            ]
            budgets = [scheduler.budget(plan.per_device_train_batch_size * row) for row in rows]
            stock = sum(len(ts) * row for ts, row in zip(totals, rows))
        together = [[index // 2 for index in range(len(ts))] for ts in totals] if pairs else None
        schedules = {}
        trees = _trees(scheduler, totals, prompts, groups, shared_prefix)  # the same for both simulations
        for balance in (True, False):
            planner = dataclasses.replace(scheduler, balance_across_ranks=balance)
            results = simulate_processes(
                planner,
                totals,
                budgets,
                prompts,
                groups=None if groups[0] is None else groups,
                trees=trees,
                together=together,
            )
            errors = [result for result in results if isinstance(result, Exception)]
            if errors:
                raise errors[0]
            schedules[balance] = results
        rounds.append(
            SimulatedRound(totals, stock, schedules[True], schedules[False], len(step) < per_process * processes)
        )
    return rounds


def _trees(scheduler: Scheduler, totals, prompts, groups, shared_prefix: int):
    """Per process, the prefix tree of its samples when the scheduler shares a tree and prompts share a block (the
    prompt groups' tree with the block once); None otherwise (the prompt groups, as the scheduler reads them)."""
    if scheduler.sharing is not SharePrefix.TREE or not shared_prefix or groups[0] is None:
        return None
    return [
        PrefixTree.of_groups(p, [t - q for t, q in zip(ts, p)], g, shared_prefix)
        for ts, p, g in zip(totals, prompts, groups)
    ]


@dataclass(frozen=True)
class StepFigures:
    """A step's figures on one process, or (:meth:`total`) those of several steps: token counts in tokens.

    ``fitting_real_tokens`` and ``capacity`` (passes x budget) count only the passes within the budget: an oversize
    sequence's pass is over it, by design, and is left out of the utilisation.
    """

    samples: int
    real_tokens: int
    budget: int | None  # None for a total
    passes: int
    lower_bound: int  # fewest passes the step's tokens allow (each oversize sequence one)
    fitting_real_tokens: int
    capacity: int
    computed_tokens: int  # the passes' token positions, padding included
    stock_tokens: int  # stock TRL's padded micro-batches' token positions

    @classmethod
    def of(cls, lengths: list[int], schedule: StepSchedule, stock_tokens: int) -> StepFigures:
        """The figures of one process's step: its samples' ``lengths`` scheduled as ``schedule``."""
        fitting = [batch for batch in schedule.microbatches if not set(batch) & set(schedule.oversize)]
        return cls(
            samples=len(lengths),
            real_tokens=sum(lengths),
            budget=schedule.budget,
            passes=schedule.passes,
            lower_bound=token_lower_bound(lengths, schedule.budget),
            fitting_real_tokens=sum(lengths[i] for batch in fitting for i in batch),
            capacity=len(fitting) * schedule.budget,
            computed_tokens=sum(schedule.pass_tokens),
            stock_tokens=stock_tokens,
        )

    @classmethod
    def total(cls, steps: list[StepFigures]) -> StepFigures:
        """The sums of ``steps``' figures (no budget)."""
        sums = {
            field.name: sum(getattr(step, field.name) for step in steps)
            for field in dataclasses.fields(cls)
            if field.name != "budget"
        }
        return cls(budget=None, **sums)

    @property
    def utilisation(self) -> float | None:
        """Real tokens over the capacity of the passes within the budget (None: no such pass)."""
        return self.fitting_real_tokens / self.capacity if self.capacity else None

    @property
    def saved(self) -> float | None:
        """The share of stock's token positions the passes do not compute (None: stock computes none)."""
        return 1 - self.computed_tokens / self.stock_tokens if self.stock_tokens else None


def processes_as_dict(rounds: list[SimulatedRound]) -> list[dict[str, Any]]:
    """``--json`` with several processes: per step, each process's micro-batches with and without balancing."""
    return [
        {
            "lengths": step.lengths,
            "budget": step.balanced[0].budget,
            "passes_without_balancing": step.unbalanced[0].passes,
            "passes": step.balanced[0].passes,
            "rank_imbalance_before": step.imbalance[0],
            "rank_imbalance_after": step.imbalance[1],
            "samples_moved": step.balanced[0].samples_moved,
            "processes": [{"lengths": s.lengths, "microbatches": s.microbatches} for s in step.balanced],
            "processes_without_balancing": [
                {"lengths": s.lengths, "microbatches": s.microbatches} for s in step.unbalanced
            ],
            "partial": step.partial,
        }
        for step in rounds
    ]


def simulation_as_dict(rounds: list[SimulatedRound]) -> list[dict[str, Any]]:
    """``--json`` on one process: per optimizer step, the lengths, budget and micro-batches (sample indices within
    the step)."""
    return [
        {
            "lengths": step.lengths[0],
            "budget": step.balanced[0].budget,
            "microbatches": step.balanced[0].microbatches,
            "passes_needed": step.balanced[0].passes_needed,
            "oversize": step.balanced[0].oversize,
            "partial": step.partial,
        }
        for step in rounds
    ]
