"""The automatic layout on CUDA, chosen by measurement (torch layer).

The self-check (:mod:`hf_dynbsz.execution.self_check`) keeps the first layout of the ladder whose log-probs equal each
sample's own. On CUDA, with ``packing_layout="auto"``, the executor then also checks the first layout of each other
*family* the ladder holds (varlen_attn, flex_attention, flash-attention, sdpa / eager spans, padded rows), and every
family that passes becomes a :class:`Candidate`. :class:`LayoutTiming` times the candidates on the run's own passes:

* from the second training step on (the first pays the device's warm-up), each candidate but the current one runs
  one of the step's cheapest real passes (one that fits the budget in that candidate's layout too), the current
  one the others. Every candidate is exact, so no timed pass is wasted work, and the timed passes of the slower
  candidates are the only cost of measuring (reported as ``dynbsz/layout_timing_overhead_seconds``; aimed at under
  half a steady step, since they run only the step's cheapest passes);
* each pass is timed by an injected :class:`PassClock` (CUDA events, read after the step: no wait inside it) and
  divided by its cost in that candidate's cost model (:meth:`~hf_dynbsz.planning.cost.WorkloadModel.cost`): seconds
  per cost unit;
* at the end of each measuring step every process contributes its sums to one all-gather, so every process
  computes the same totals and keeps the same candidate: the least predicted time for the step's samples (seconds
  per unit x the step's cost in that candidate's model); stock's own slices are predicted from the padded rows' rate
  (they are padded rows, to the round's longest) and chosen when cheaper, which turns dynamic batching off;
* a candidate still untimed after :data:`MEASURING_STEPS` steps is left out.

The choice and every candidate's figures are logged once and published in the step's metrics
(``dynbsz/layout_predicted_seconds/<name>``). ``packing_layout="padded"`` or ``"padding_free"`` pins the layout
(nothing is measured), and so do sequence parallelism and a memory limit (whose model learns each pass's peak in the
run's own layout). :data:`NO_LAYOUT_TIMING` is the off state: the identity the executor always holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hf_dynbsz.planning.model_support import VARLEN_ATTN, Layout
from hf_dynbsz.planning.schedule import Scheduler

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "Candidate",
    "CudaEventClock",
    "LayoutTiming",
    "NO_LAYOUT_TIMING",
    "PerfCounterClock",
    "assign_passes",
    "family",
    "pass_clock",
    "predicted_seconds",
]

#: Device types whose automatic layout is measured (tests add "cpu", with a fake clock).
MEASURED_DEVICE_TYPES = ["cuda"]
#: Training steps before the first measured one (the first step pays the device's warm-up).
WARM_UP_STEPS = 1
#: Measuring steps after which a candidate still untimed is left out.
MEASURING_STEPS = 3
#: Integer scale of the all-gathered sums (microseconds; micro cost units).
_SCALE = 1e6


def family(layout: Layout) -> str:
    """The kind of kernel work a layout does: "varlen" (torch's varlen_attn), "flex", "flash", "spans" (sdpa or
    eager per span), "padding_free" (the model's own attention over a row), "padded"."""
    base = layout.segment_attention
    if layout.name == "padded":
        return "padded"
    if base is None:
        return "padding_free"
    if base == VARLEN_ATTN:
        return "varlen"
    if base == "flex_attention":
        return "flex"
    return "spans" if base in ("sdpa", "eager") else "flash"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout the self-check passed: ``name`` (its :func:`family`), ``scheduler`` (its
    :class:`~hf_dynbsz.planning.schedule.Scheduler`: layout, cost model, budget rules)."""

    name: str
    scheduler: object

    def cost(self, lengths: Sequence[int]) -> float:
        """A pass of samples of these ``lengths`` (tokens each) in this candidate's cost model."""
        scheduler = self.scheduler
        return scheduler.workload.cost(lengths, scheduler.layout, scheduler.pad_to_multiple_of, scheduler.attention)

    def tokens(self, lengths: Sequence[int]) -> int:
        """Token positions of such a pass in this candidate's layout (a padded pass: rows x its longest)."""
        return len(lengths) * max(lengths) if self.scheduler.layout == "padded" else sum(lengths)


class PassClock(Protocol):
    """Times a pass without waiting for the device in it: ``start(label)`` (the candidate's name) and
    ``stop(token)`` around the pass, ``seconds(token)`` once the step is over."""

    def start(self, label: str): ...

    def stop(self, token) -> None: ...

    def seconds(self, token) -> float: ...


class CudaEventClock:
    """CUDA events recorded on the current stream around a pass; their interval is read after the step."""

    def start(self, label: str):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin, end

    def stop(self, token) -> None:
        token[1].record()

    def seconds(self, token) -> float:
        begin, end = token
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


class PerfCounterClock:
    """Wall time (a CPU, where a pass ends when its last operation returns)."""

    def start(self, label: str):
        return [time.perf_counter(), None]

    def stop(self, token) -> None:
        token[1] = time.perf_counter()

    def seconds(self, token) -> float:
        return token[1] - token[0]


def pass_clock(device_type: str) -> PassClock:
    """The clock of a run on ``device_type``: CUDA events on CUDA, wall time elsewhere."""
    return CudaEventClock() if device_type == "cuda" else PerfCounterClock()


def assign_passes(
    lengths_of_passes: Sequence[Sequence[int]],
    candidates: Sequence[Candidate],
    budget: int,
    waiting: Sequence[int],
    keep_one: bool = False,
) -> list[int]:
    """Per pass, the index of the candidate that runs it: 0 (the current layout) but for one pass each of the
    ``waiting`` candidates (indices; untimed so far), the cheapest real pass left that fits ``budget`` in that
    candidate's layout (an empty pass, a dummy, stays with the current layout). ``keep_one``: the costliest real
    pass stays with the current layout (untimed so far itself)."""
    chosen = [0] * len(lengths_of_passes)
    order = sorted(
        (position for position, lengths in enumerate(lengths_of_passes) if lengths),
        key=lambda position: (candidates[0].cost(lengths_of_passes[position]), position),
    )
    if keep_one:
        order = order[:-1]
    for index in waiting:
        for position in order:
            if chosen[position] == 0 and candidates[index].tokens(lengths_of_passes[position]) <= budget:
                chosen[position] = index
                break
    return chosen


def predicted_seconds(
    seconds: Sequence[float], units: Sequence[float], step_units: Sequence[float]
) -> list[float | None]:
    """Per candidate, its predicted time for a step: seconds per cost unit (``seconds / units`` of its timed passes)
    x ``step_units`` (the step's cost in its model); None when it was never timed."""
    return [s / u * step if u > 0 else None for s, u, step in zip(seconds, units, step_units)]


class _Off:
    """The executor's layout timing when nothing is measured: the identity."""

    measuring = False
    pass_scheduler = None

    def timed(self, candidate: int | None, lengths, segments) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def finish_training_step(self, batch, schedule, rows_per_slice: int) -> tuple[bool, None]:
        return False, None

    def pass_candidates(self, schedule, kind: str, lengths: Sequence[int]) -> None:
        return None

    def record(self, candidate: int, token, lengths) -> None:  # pragma: no cover - never called when off
        raise AssertionError("no layout is being timed")

    def finish_step(self, *args, **kwargs) -> None:
        return None

    def publish(self, store) -> None:
        return None


#: The layout timing of a run that measures nothing (pinned layout, one candidate, not CUDA).
NO_LAYOUT_TIMING = _Off()


class LayoutTiming:
    """Times ``candidates`` (the current layout first) on a run's training passes and keeps the fastest.

    ``clock``: a :class:`PassClock`; ``all_gather(values) -> per process values`` (integers): the run's processes.
    """

    measuring = True

    def __init__(self, candidates: list[Candidate], clock: PassClock, all_gather: Callable) -> None:
        self.candidates, self.clock, self.all_gather = candidates, clock, all_gather
        count = len(candidates)
        self.seconds = [0.0] * count  # per candidate: seconds of its timed passes (all processes)
        self.costs = [[0.0] * count for _ in range(count)]  # [i][j]: i's timed passes in j's cost model
        self.steps_seen = 0
        self.measured_steps = 0
        self._tokens: list[tuple[int, object, list[float]]] = []  # this step's (candidate, clock token, costs)
        self.decision: dict | None = None  # once chosen: what to publish
        self.published = False
        self.pass_scheduler: Scheduler | None = None  # while a timed pass runs: its candidate's

    @contextlib.contextmanager
    def timed(self, candidate: int | None, lengths: Sequence[int], segments: Callable):
        """Around a pass over samples of these ``lengths``: in the layout of ``candidate`` (its scheduler is
        :attr:`pass_scheduler`, the executor's collator reads it; ``segments(scheduler)``: the segment attention it
        runs under), timed. ``candidate`` None: the run's layout, untimed."""
        if candidate is None:
            yield
            return
        self.pass_scheduler = self.candidates[candidate].scheduler
        try:
            with segments(self.pass_scheduler):
                token = self.start(candidate)
                yield
                self.record(candidate, token, lengths)
        finally:
            self.pass_scheduler = None

    def finish_training_step(self, batch, schedule, rows_per_slice: int) -> tuple[bool, Candidate | None]:
        """After a training step's passes (``batch``: the step's pooled
        :class:`~hf_dynbsz.execution.batch.StepBatch`; ``schedule``: its plan; ``rows_per_slice``:
        ``per_device_train_batch_size``): :meth:`finish_step` with the step's cost in each candidate's model and
        stock's slices. Returns ``(chosen in this step, the candidate kept)``; kept None: stock's slices."""
        if self.decision is not None:
            return False, None
        table = batch.table
        lengths, prompts = table.lengths.tolist(), table.prompt_lengths.tolist()
        width = batch.stock_microbatch_tokens / max(rows_per_slice, 1)  # stock's padded row

        def step_costs():
            costs = []
            for candidate in self.candidates:
                sharing = candidate.scheduler.sharing
                tree = table.prefix_tree(sharing) if sharing else None
                costs.append(candidate.scheduler.step_cost(lengths, schedule.budget, prompts, tree=tree))
            return costs

        kept = self.finish_step(step_costs, (batch.stock_computed_tokens, batch.stock_computed_tokens * width))
        return self.decision is not None, kept

    # ---- one measuring step ------------------------------------------------------------------------------------
    def pass_candidates(self, schedule, kind: str, lengths: Sequence[int]) -> list[int] | None:
        """Per pass of ``schedule`` (a training step's), the candidate that runs it; None when nothing is measured
        in this step (``kind`` not "training", a warm-up step, or the choice made)."""
        if kind != "training" or self.decision is not None:
            return None
        self.steps_seen += 1
        if self.steps_seen <= WARM_UP_STEPS:
            return None
        waiting = [index for index in range(1, len(self.candidates)) if self.units[index] == 0]
        passes = [[lengths[i] for i in group] for group in schedule.microbatches]
        self._tokens = []  # (a step re-planned after running out of memory measures its new passes)
        return assign_passes(passes, self.candidates, schedule.budget, waiting, keep_one=self.units[0] == 0)

    @property
    def units(self) -> list[float]:
        """Per candidate, the cost of its timed passes in its own model (all processes)."""
        return [self.costs[i][i] for i in range(len(self.candidates))]

    def start(self, candidate: int):
        """A clock token for a pass of ``candidate`` about to run."""
        return self.clock.start(self.candidates[candidate].name)

    def record(self, candidate: int, token, lengths: Sequence[int]) -> None:
        """A timed pass of ``candidate`` over samples of these ``lengths`` (``token`` from :meth:`start`)."""
        self.clock.stop(token)
        self._tokens.append((candidate, token, [other.cost(lengths) for other in self.candidates]))

    def finish_step(self, step_costs: Callable[[], Sequence[float]], stock) -> Candidate | None:
        """After a measuring step's passes: read the clocks, sum over every process (one all-gather, every process
        calls it once per measuring step), and choose when every candidate is timed or after
        :data:`MEASURING_STEPS` steps. ``step_costs()``: the step's cost in each candidate's model (as each would lay
        the step's samples out: :meth:`~hf_dynbsz.planning.schedule.Scheduler.step_cost`); ``stock``: ``(tokens,
        pairs)`` of stock's slices of the step, or None. Returns the chosen candidate (None: not yet, or stock)."""
        if self.decision is not None or self.steps_seen <= WARM_UP_STEPS:
            return None
        self.measured_steps += 1
        count = len(self.candidates)
        local = [0.0] * (count * (count + 1))  # per candidate: seconds, then its passes' cost in each model
        for candidate, token, costs in self._tokens:
            local[candidate * (count + 1)] += self.clock.seconds(token)
            for other, cost in enumerate(costs):
                local[candidate * (count + 1) + 1 + other] += cost
        self._tokens = []
        local += [*step_costs(), *(stock or (0.0, 0.0))]  # this process's step, and its stock slices
        gathered = self.all_gather([round(value * _SCALE) for value in local])
        totals = [sum(row[k] for row in gathered) / _SCALE for k in range(len(local))]
        for index in range(count):
            self.seconds[index] += totals[index * (count + 1)]
            for other in range(count):
                self.costs[index][other] += totals[index * (count + 1) + 1 + other]
        if any(units == 0 for units in self.units) and self.measured_steps < MEASURING_STEPS:
            return None
        step, stock_totals = totals[count * (count + 1) : -2], totals[-2:]  # summed over processes
        return self._decide(step, tuple(stock_totals) if stock is not None else None)

    def _decide(self, step_units: list[float], stock: tuple[float, float] | None) -> Candidate | None:
        names = [candidate.name for candidate in self.candidates]
        units = self.units
        predicted = predicted_seconds(self.seconds, units, step_units)
        padded = next((i for i, name in enumerate(names) if name == "padded" and predicted[i] is not None), None)
        if stock is not None and padded is not None:
            workload = self.candidates[padded].scheduler.workload
            names.append("stock")
            predicted.append(self.seconds[padded] / units[padded] * workload.of(*stock))
        timed = [i for i, value in enumerate(predicted) if value is not None]
        best = min(timed, key=lambda i: (predicted[i], i))
        self.decision = {"chosen": names[best], "predicted": dict(zip(names, predicted))}
        self.decision["overhead"] = self._overhead(best if best < len(self.candidates) else 0)
        logger.warning(
            "hf_dynbsz: layout timing: %s; keeps %s (the timed passes of the others cost about %.3f s).",
            ", ".join(
                f"{name} {value:.3f} s a step" if value is not None else f"{name} not timed"
                for name, value in zip(names, predicted)
            ),
            names[best],
            self.decision["overhead"],
        )
        return self.candidates[best] if best < len(self.candidates) else None

    def _overhead(self, best: int) -> float:
        """What measuring cost, all processes together: the timed passes of the candidates not kept, less what the
        kept one would have taken for them (its seconds per unit x their cost in its model)."""
        rate = self.seconds[best] / self.costs[best][best] if self.costs[best][best] else 0.0
        return sum(
            max(self.seconds[i] - rate * self.costs[i][best], 0.0) for i in range(len(self.candidates)) if i != best
        )

    def publish(self, store) -> None:
        """Once, after the choice: every candidate's predicted step seconds and the measuring overhead (metrics)."""
        if self.decision is None or self.published:
            return
        self.published = True
        for name, value in self.decision["predicted"].items():
            if value is not None:
                store[f"dynbsz/layout_predicted_seconds/{name}"].append(value)
        store["dynbsz/layout_timing_overhead_seconds"].append(self.decision["overhead"])
