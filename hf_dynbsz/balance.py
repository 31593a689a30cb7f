"""Cross-rank balancing: which process runs which samples of an optimizer step (pure Python).

Under DDP and DeepSpeed every process runs as many passes as the busiest one needs and synchronises at the end of
the step (ZeRO-3 and ZeRO-2 even in every pass), so a process whose share of the step holds the long completions
makes every other process wait. Before the passes of a step, every process learns the lengths of all processes'
samples (a small all-gather of lengths, not of data) and calls :func:`assign` with the same input: every process
computes the same assignment of *units* (a sample, or samples that must stay together, e.g. sharing a prompt) to
processes, with no broadcast. The samples then move with everything that belongs to them
(:mod:`hf_dynbsz.distributed`), and their loss weights were fixed on the process they came from, so the summed
gradient, and the parameters, stay stock's.

The objective is the largest per-process cost, a unit's cost being that of the partitioner's workload model
(:func:`hf_dynbsz.partition.item_costs`: tokens plus the attention term, padded rows where the layout pads).
:func:`assign` takes the better of two deterministic schedules, each then improved by moves and swaps from the
most to the least loaded process:

* the current placement (nothing moves unless it helps, so the result is never worse than no balancing);
* longest-processing-time-first (LPT), its bins renamed to keep as many units as possible where they are. LPT's
  largest load is at most ``(4/3 - 1/(3P))`` times the optimum (Graham, 1969); moves and swaps never raise it.

Ties are broken by process number and unit order, never by hashing or timing. When the predicted gain is below
:data:`MIN_RELATIVE_GAIN` of the largest load, nothing moves (the exchange would not pay).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MIN_RELATIVE_GAIN", "Assignment", "assign", "imbalance"]

#: Smallest predicted reduction of the largest per-process cost, relative to it, worth exchanging samples for.
#: Below it the exchange (two all-to-alls of a few hundred bytes per token moved) would cost about what it saves.
MIN_RELATIVE_GAIN = 0.02


def imbalance(loads: Sequence[float]) -> float:
    """Largest load over the mean load (1.0 = perfectly even; 1.0 for no work at all)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


@dataclass(frozen=True)
class Assignment:
    """Where each unit runs. Units are numbered in input order: process 0's units, then process 1's, ...

    ``origin[u]`` and ``destination[u]`` are the processes unit ``u`` comes from and runs on; ``loads_before`` and
    ``loads_after`` the per-process costs without and with the assignment.
    """

    origin: list[int]
    destination: list[int]
    loads_before: list[float]
    loads_after: list[float]

    @property
    def moved(self) -> int:
        """Units that change process."""
        return sum(1 for source, target in zip(self.origin, self.destination) if source != target)

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.loads_after)


def assign(unit_costs: Sequence[Sequence[float]], min_relative_gain: float = MIN_RELATIVE_GAIN) -> Assignment:
    """The assignment of units to processes minimising the largest per-process cost (deterministic).

    ``unit_costs[p]`` are the costs of process ``p``'s units, in its order. Every process must call this with the
    same ``unit_costs`` (the result depends on nothing else).
    """
    num_processes = len(unit_costs)
    costs = [float(cost) for per_process in unit_costs for cost in per_process]
    origin = [process for process, per_process in enumerate(unit_costs) for _ in per_process]
    before = _loads(origin, costs, num_processes)
    unchanged = Assignment(origin, list(origin), before, before)
    if num_processes < 2 or not costs:
        return unchanged
    candidates = [
        _improve(list(origin), costs, num_processes),
        _improve(_renamed(_longest_first(costs, num_processes), origin, costs, num_processes), costs, num_processes),
    ]
    best = min(candidates, key=lambda destination: (max(_loads(destination, costs, num_processes)),
                                                    sum(a != b for a, b in zip(destination, origin))))
    after = _loads(best, costs, num_processes)
    if max(before) - max(after) < min_relative_gain * max(before):
        return unchanged
    return Assignment(origin, best, before, after)


def _loads(destination: Sequence[int], costs: Sequence[float], num_processes: int) -> list[float]:
    loads = [0.0] * num_processes
    for unit, process in enumerate(destination):
        loads[process] += costs[unit]
    return loads


def _longest_first(costs: Sequence[float], num_processes: int) -> list[int]:
    """LPT: units by decreasing cost (ties by unit order), each to the least loaded bin (ties: lowest bin)."""
    order = sorted(range(len(costs)), key=lambda unit: (-costs[unit], unit))
    bins = [(0.0, number) for number in range(num_processes)]
    destination = [0] * len(costs)
    for unit in order:
        load, number = heapq.heappop(bins)
        destination[unit] = number
        heapq.heappush(bins, (load + costs[unit], number))
    return destination


def _renamed(bins: list[int], origin: list[int], costs: Sequence[float], num_processes: int) -> list[int]:
    """Bins renamed to processes so that the most work stays where it is (greedy on the overlap, deterministic)."""
    overlap = [[0.0] * num_processes for _ in range(num_processes)]
    for unit, number in enumerate(bins):
        overlap[number][origin[unit]] += costs[unit]
    pairs = sorted(((-overlap[b][p], b, p) for b in range(num_processes) for p in range(num_processes)))
    name, taken = {}, set()
    for _, number, process in pairs:
        if number not in name and process not in taken:
            name[number] = process
            taken.add(process)
    return [name[number] for number in bins]


def _improve(destination: list[int], costs: Sequence[float], num_processes: int) -> list[int]:
    """Moves and swaps between the most and the least loaded process while they lower the larger of the two.

    A move gives the least loaded process a unit of cost ``c < gap`` (``gap`` = difference of the two loads), a
    swap exchanges units whose costs differ by ``0 < d < gap``; either picks the change closest to ``gap / 2``.
    Both lower the heavier load and keep the lighter one below it, so the sum of squared loads strictly falls
    and the loop ends; the largest load never rises.
    """
    members: list[list[int]] = [[] for _ in range(num_processes)]
    for unit, process in enumerate(destination):
        members[process].append(unit)
    loads = _loads(destination, costs, num_processes)
    for _ in range(4 * len(costs) + 4):
        heavy = max(range(num_processes), key=lambda process: (loads[process], -process))
        light = min(range(num_processes), key=lambda process: (loads[process], process))
        gap = loads[heavy] - loads[light]
        change = _best_change(members[heavy], members[light], costs, gap)
        if change is None:
            break
        give, take = change
        for unit, source, target in ((give, heavy, light), (take, light, heavy)):
            if unit is None:
                continue
            members[source].remove(unit)
            members[target].append(unit)
            destination[unit] = target
            loads[source] -= costs[unit]
            loads[target] += costs[unit]
    return destination


def _best_change(heavy: list[int], light: list[int], costs: Sequence[float], gap: float):
    """(unit to give, unit to take back or None) whose cost difference is in (0, gap) and closest to gap / 2."""
    if gap <= 0:
        return None
    best, best_score = None, gap / 2
    for unit in heavy:  # moves
        cost = costs[unit]
        if 0 < cost < gap and abs(gap / 2 - cost) < best_score - 1e-12 * gap:
            best, best_score = (unit, None), abs(gap / 2 - cost)
    by_cost = sorted(light, key=lambda unit: (costs[unit], unit))
    light_costs = [costs[unit] for unit in by_cost]
    for unit in heavy:  # swaps: the light unit whose cost is closest to costs[unit] - gap / 2
        target = costs[unit] - gap / 2
        position = bisect.bisect_left(light_costs, target)
        for candidate in (position - 1, position):
            if 0 <= candidate < len(by_cost):
                difference = costs[unit] - light_costs[candidate]
                if 0 < difference < gap and abs(gap / 2 - difference) < best_score - 1e-12 * gap:
                    best, best_score = (unit, by_cost[candidate]), abs(gap / 2 - difference)
    return best
