"""Balancing: items with costs into ``k`` bins, the one routine for passes and for processes (pure Python).

Two decisions spread work over bins: which samples of a device's optimizer step share a pass
(:func:`hf_dynbsz.planning.partition.partition_by_token_budget`, bins with a *capacity*, the token budget) and which
process runs which samples (:func:`assign`, cross-rank balancing, no capacity). Both call :func:`balance`:

1. **longest first with a room check**: items by decreasing cost (ties by index), each to the least loaded bin that
   has room for its tokens (longest-processing-time-first, Graham 1969: the largest load at most ``4/3 - 1/(3k)``
   times the optimum without a capacity);
2. **a bounded improvement** (:func:`improve`): moves and swaps between the most and the least loaded bin, each
   lowering the larger of the two loads and keeping every bin within its capacity, so the largest load never rises.

With a capacity, longest-first can strand an item that fits no bin any more (a tight budget); the caller then
improves a first-fit-decreasing assignment instead, which always fits (:mod:`hf_dynbsz.planning.partition`).

Cross-rank balancing (:func:`assign`): under DDP and DeepSpeed every process runs as many passes as the busiest one
needs and synchronises at the end of the step (ZeRO-3 and ZeRO-2 even in every pass), so a process whose share of the
step holds the long completions makes every other process wait. Before the passes of a step, every process learns
the lengths of all processes' samples (a small all-gather of lengths, not of data) and calls :func:`assign` with the
same input, computing the same assignment of *units* (a sample, or samples that share a prompt) to processes, with
no broadcast. It takes the better of two schedules: the current placement improved (nothing moves unless it helps,
so the result is never worse than no balancing), and longest-first with its bins renamed to keep as much work as
possible where it is. Whole units can be too coarse: a prefix tree makes a GRPO group one unit, and a block every
prompt begins with makes all of a process's samples one. Units given as :class:`Divisible` are then cut where that
lowers the largest load (:func:`spread`): a piece of a unit (the samples of one of its subtrees) moves from the most
loaded process to the least loaded one, and each process holding part of a unit is charged what its part computes,
the path the part shares with the rest of the unit included (the path is computed on both processes). The samples then
move with everything that belongs to them (:mod:`hf_dynbsz.parallel.distributed`); their loss weights were fixed on
the process they came from, so the summed gradient, and the parameters, stay stock's. When the predicted gain is below
:data:`MIN_RELATIVE_GAIN` of the largest load, nothing moves.

Everything is deterministic: ties are broken by bin number and item order, never by hashing or timing.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["MIN_RELATIVE_GAIN", "SPLIT_CLOSE_ENOUGH", "Assignment", "Divisible", "assign", "balance", "imbalance",
           "improve", "spread"]  # fmt: skip

#: Smallest predicted reduction of the largest per-process cost, relative to it, worth exchanging samples for.
#: Below it the exchange (two all-to-alls of a few hundred bytes per token moved) would cost about what it saves.
MIN_RELATIVE_GAIN = 0.02
#: Units are cut (:func:`spread`) only while the largest load is more than this far (relative) above the mean: a cut
#: computes the piece's path twice and moves more samples, for what the cost model can no longer tell apart.
SPLIT_CLOSE_ENOUGH = 0.01


def imbalance(loads: Sequence[float]) -> float:
    """Largest load over the mean load (1.0 = perfectly even; 1.0 for no work at all)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def balance(
    costs: Sequence[float],
    bins: int,
    sizes: Sequence[int] | None = None,
    capacity: int | None = None,
    close_enough: float = 0.0,
) -> list[int] | None:
    """Bin (``0 .. bins - 1``) of each item: longest first with a room check, then :func:`improve`.

    ``costs``: what the bins' loads sum; ``sizes``/``capacity``: the tokens of each item and the most a bin holds
    (None: no capacity); ``close_enough`` as in :func:`improve`. Returns None when, with a capacity, some item fits
    no bin on the way.
    """
    order = sorted(range(len(costs)), key=costs.__getitem__, reverse=True)  # stable: ties keep item order
    by_load = [(0.0, number) for number in range(bins)]  # (load, bin), lightest on top
    destination = [0] * len(costs)
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace
    if capacity is None:
        for item in order:
            load, number = by_load[0]
            destination[item] = number
            heapreplace(by_load, (load + costs[item], number))
        return improve(destination, costs, bins, sizes, capacity, close_enough)
    room = [capacity] * bins
    full: list[tuple[int, int, float]] = []  # (-room, bin, load): bins set aside until an item fits their room
    for item in order:
        size = sizes[item]
        while full and -full[0][0] >= size:
            _, number, load = heappop(full)
            heappush(by_load, (load, number))
        while by_load and room[by_load[0][1]] < size:
            load, number = heappop(by_load)
            heappush(full, (-room[number], number, load))
        if not by_load:
            return None
        load, number = by_load[0]
        room[number] -= size
        destination[item] = number
        heapreplace(by_load, (load + costs[item], number))
    loads = [load for load, _ in by_load] + [load for _, _, load in full]
    if max(loads) <= (1.0 + close_enough) * sum(loads) / bins:
        return destination  # already even: nothing to improve
    return improve(destination, costs, bins, sizes, capacity, close_enough)


def improve(
    destination: list[int],
    costs: Sequence[float],
    bins: int,
    sizes: Sequence[int] | None = None,
    capacity: int | None = None,
    close_enough: float = 0.0,
) -> list[int]:
    """Moves and swaps between the most loaded bin holding two items or more (a bin of one item cannot get lighter)
    and the least loaded bin, while they lower the larger of the two loads.

    A move gives the least loaded bin an item of cost ``c < gap`` (``gap``: the difference of the two loads), a swap
    exchanges items whose costs differ by ``0 < d < gap``; either picks the change closest to ``gap / 2`` among those
    that keep both bins within ``capacity``. Both lower the heavier load and keep the lighter one below it, so the
    sum of squared loads strictly falls and the loop ends; the largest load never rises. Stops early once the
    heaviest load is within ``close_enough`` (relative) of the mean. Returns ``destination`` (changed in place).
    """
    members: list[list[int]] = [[] for _ in range(bins)]
    loads = [0.0] * bins
    tokens = [0] * bins
    for item, number in enumerate(destination):
        members[number].append(item)
        loads[number] += costs[item]
        if sizes is not None:
            tokens[number] += sizes[item]
    good_enough = (1.0 + close_enough) * sum(loads) / max(bins, 1)
    heaviest = [(-loads[number], -number) for number in range(bins) if len(members[number]) > 1]
    lightest = [(loads[number], number) for number in range(bins)]
    heapq.heapify(heaviest)
    heapq.heapify(lightest)  # both with stale entries, skipped when their load is no longer the bin's
    for _ in range(4 * len(costs) + 4):
        while heaviest and (-heaviest[0][0] != loads[-heaviest[0][1]] or len(members[-heaviest[0][1]]) < 2):
            heapq.heappop(heaviest)  # a bin of one item cannot get lighter
        while lightest[0][0] != loads[lightest[0][1]]:
            heapq.heappop(lightest)
        if not heaviest or -heaviest[0][0] <= good_enough:
            break
        heavy, light = -heaviest[0][1], lightest[0][1]
        change = _best_change(
            members[heavy],
            members[light],
            costs,
            loads[heavy] - loads[light],
            sizes,
            None if capacity is None else (capacity - tokens[heavy], capacity - tokens[light]),
        )
        if change is None:
            break
        for item, source, target in ((change[0], heavy, light), (change[1], light, heavy)):
            if item is None:
                continue
            members[source].remove(item)
            members[target].append(item)
            destination[item] = target
            loads[source] -= costs[item]
            loads[target] += costs[item]
            if sizes is not None:
                tokens[source] -= sizes[item]
                tokens[target] += sizes[item]
        for number in (heavy, light):
            heapq.heappush(lightest, (loads[number], number))
            if len(members[number]) > 1:
                heapq.heappush(heaviest, (-loads[number], -number))
    return destination


def _best_change(
    heavy: list[int],
    light: list[int],
    costs: Sequence[float],
    gap: float,
    sizes: Sequence[int] | None,
    free: tuple[int, int] | None,
):
    """(item to give, item to take back or None) whose cost difference is in (0, gap) and closest to gap / 2, within
    the ``free`` room of the heavy and the light bin (None: no capacity)."""
    if gap <= 0:
        return None

    def fits(give: int, take: int | None) -> bool:
        if free is None:
            return True
        moved = sizes[give] - (sizes[take] if take is not None else 0)
        return moved <= free[1] and -moved <= free[0]

    half, slack = gap / 2, 1e-12 * gap
    best, best_score = None, half
    for item in heavy:  # moves
        cost = costs[item]
        if 0 < cost < gap and abs(half - cost) < best_score - slack and fits(item, None):
            best, best_score = (item, None), abs(half - cost)
    by_cost = sorted(light, key=lambda item: (costs[item], item))
    light_costs = [costs[item] for item in by_cost]
    count = len(by_cost)
    for item in heavy:  # swaps: light items by closeness of their cost to costs[item] - gap / 2, the first that fits
        cost = costs[item]
        target = cost - half
        below = bisect.bisect_left(light_costs, target) - 1
        above = below + 1
        while below >= 0 or above < count:
            if above >= count or (below >= 0 and target - light_costs[below] <= light_costs[above] - target):
                candidate, below = below, below - 1
            else:
                candidate, above = above, above + 1
            difference = cost - light_costs[candidate]
            if abs(half - difference) >= best_score - slack:
                break  # the rest are further from gap / 2
            if 0 < difference < gap and fits(item, by_cost[candidate]):
                best, best_score = (item, by_cost[candidate]), abs(half - difference)
                break
    return best


@dataclass(frozen=True)
class Divisible:
    """Units that may be cut into pieces run by different processes (:func:`spread`).

    ``parts[u]``: the parts of unit ``u`` (its samples, as integers; ascending); ``costs(u, [parts, ...])``: for each
    of several sets of parts of unit ``u``, what a process holding them computes for them, their shared path
    included (0 for none; ``parts[u]`` costs the unit's cost), asked for at once so that they are counted at once;
    ``pieces(u, parts)``: the pieces ``parts`` may give away (each a non-empty ascending tuple of them, ``parts``
    itself included: a whole move).
    """

    parts: Sequence[tuple[int, ...]]
    costs: Callable[[int, list[tuple[int, ...]]], list[float]]
    pieces: Callable[[int, tuple[int, ...]], Sequence[tuple[int, ...]]]


@dataclass(frozen=True)
class Assignment:
    """Where each unit runs. Units are numbered in input order: process 0's units, then process 1's, ...

    ``origin[u]`` and ``destination[u]`` are the processes unit ``u`` comes from and runs on; ``loads_before`` and
    ``loads_after`` the per-process costs without and with the assignment. ``shares``: the units cut across
    processes (:func:`spread`), each as ``{process: its parts there}``; such a unit's ``destination`` is where its
    first part runs.
    """

    origin: list[int]
    destination: list[int]
    loads_before: list[float]
    loads_after: list[float]
    shares: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def moved(self) -> int:
        """Units that change process, wholly or in part."""
        return sum(
            1
            for unit, (source, target) in enumerate(zip(self.origin, self.destination))
            if (set(self.shares[unit]) != {source} if unit in self.shares else source != target)
        )

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.loads_after)

    def placed(self, unit: int, parts: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        """Unit ``unit``'s ``parts`` (all of them) by the process that runs them, in process order."""
        return dict(sorted(self.shares[unit].items())) if unit in self.shares else {self.destination[unit]: parts}


def assign(
    unit_costs: Sequence[Sequence[float]],
    min_relative_gain: float = MIN_RELATIVE_GAIN,
    divisible: Divisible | None = None,
) -> Assignment:
    """The assignment of units to processes minimising the largest per-process cost (deterministic).

    ``unit_costs[p]`` are the costs of process ``p``'s units, in its order. Every process must call this with the
    same ``unit_costs`` (the result depends on nothing else). ``divisible``: the units (numbered as in
    :class:`Assignment`) may be cut where whole units leave the largest load more than :data:`SPLIT_CLOSE_ENOUGH`
    above the mean (:func:`spread`).
    """
    num_processes = len(unit_costs)
    costs = [float(cost) for per_process in unit_costs for cost in per_process]
    origin = [process for process, per_process in enumerate(unit_costs) for _ in per_process]
    before = _loads(origin, costs, num_processes)
    unchanged = Assignment(origin, list(origin), before, before)
    if num_processes < 2 or not costs:
        return unchanged
    longest_first = _renamed(balance(costs, num_processes), origin, costs, num_processes)
    candidates = [improve(list(origin), costs, num_processes), longest_first]
    best = min(
        candidates,
        key=lambda destination: (
            max(_loads(destination, costs, num_processes)),
            sum(a != b for a, b in zip(destination, origin)),
        ),
    )
    after, shares = _loads(best, costs, num_processes), {}
    if divisible is not None and max(after) > (1.0 + SPLIT_CLOSE_ENOUGH) * sum(after) / num_processes:
        placed = spread(best, num_processes, divisible)
        loads = _loads_of(placed, num_processes, divisible)
        if max(loads) < max(after):
            best = [_first(parts) for parts in placed]
            shares = {unit: parts for unit, parts in enumerate(placed) if len(parts) > 1}
            after = loads
    if max(before) - max(after) < min_relative_gain * max(before):
        return unchanged
    return Assignment(origin, best, before, after, shares)


def spread(
    destination: Sequence[int], num_processes: int, divisible: Divisible, close_enough: float = SPLIT_CLOSE_ENOUGH
) -> list[dict[int, tuple[int, ...]]]:
    """Units placed by ``destination`` (one process each), then cut across processes while that lowers the largest
    load: per unit, ``{process: its parts there}``.

    Each round looks at the most loaded process (the lowest-numbered on ties) and the least loaded one: of every
    piece (:attr:`Divisible.pieces`) of every unit part the heavy process holds, it moves the one after which the
    larger of the two loads is least, if that is below the heavy load. A process's load is the sum over the unit
    parts it holds of :attr:`Divisible.costs`, so a piece that joins another part of its unit is charged only what it
    adds, and a cut unit's shared path counts on every process holding part of it. Stops when the largest load is
    within ``close_enough`` (relative) of the mean, or no move lowers it. The largest load never rises.
    """
    placed = [{process: tuple(divisible.parts[unit])} for unit, process in enumerate(destination)]
    loads = _loads_of(placed, num_processes, divisible)
    for _ in range(4 * sum(len(parts) for parts in divisible.parts) + 4 * num_processes):
        heavy = max(range(num_processes), key=lambda p: (loads[p], -p))
        light = min(range(num_processes), key=lambda p: (loads[p], p))
        if loads[heavy] <= (1.0 + close_enough) * sum(loads) / num_processes:
            break
        move = _best_piece(placed, loads, heavy, light, divisible)
        if move is None:
            break
        unit, piece, heavy_load, light_load = move
        kept = _without(placed[unit][heavy], piece)
        if kept:
            placed[unit][heavy] = kept
        else:
            del placed[unit][heavy]
        placed[unit][light] = tuple(sorted(placed[unit].get(light, ()) + piece))
        loads[heavy], loads[light] = heavy_load, light_load
    return placed


def _best_piece(placed, loads: list[float], heavy: int, light: int, divisible: Divisible):
    """(unit, piece, heavy load after, light load after) of the move from ``heavy`` to ``light`` that leaves the
    larger of the two loads least, if below ``heavy``'s load now; None otherwise."""
    best, best_peak = None, loads[heavy] * (1.0 - 1e-9)
    for unit, parts in enumerate(placed):
        held = parts.get(heavy)
        if held is None:
            continue
        there = parts.get(light, ())
        pieces = list(divisible.pieces(unit, held))
        kept = [_without(held, piece) for piece in pieces]
        joined = [tuple(sorted(there + piece)) for piece in pieces]
        costs = divisible.costs(unit, [held, there, *kept, *joined])
        without, light_base = loads[heavy] - costs[0], loads[light] - costs[1]
        for number, piece in enumerate(pieces):
            heavy_load = without + costs[2 + number]
            light_load = light_base + costs[2 + len(pieces) + number]
            peak = max(heavy_load, light_load)
            if peak < best_peak:
                best, best_peak = (unit, piece, heavy_load, light_load), peak
    return best


def _without(parts: tuple[int, ...], piece: tuple[int, ...]) -> tuple[int, ...]:
    """``parts`` less those of ``piece``, in order."""
    given = set(piece)
    return tuple(part for part in parts if part not in given)


def _first(parts: dict[int, tuple[int, ...]]) -> int:
    """The process holding a unit's first part."""
    return min(parts, key=lambda process: parts[process][0])


def _loads_of(placed, num_processes: int, divisible: Divisible) -> list[float]:
    """Per process, the cost of the unit parts it holds."""
    loads = [0.0] * num_processes
    for unit, parts in enumerate(placed):
        for process, cost in zip(parts, divisible.costs(unit, list(parts.values()))):
            loads[process] += cost
    return loads


def _loads(destination: Sequence[int], costs: Sequence[float], num_processes: int) -> list[float]:
    loads = [0.0] * num_processes
    for unit, process in enumerate(destination):
        loads[process] += costs[unit]
    return loads


def _renamed(bins: list[int], origin: list[int], costs: Sequence[float], num_processes: int) -> list[int]:
    """Bins renamed to processes so that the most work stays where it is (greedy on the overlap, deterministic)."""
    overlap: dict[tuple[int, int], float] = {}  # (bin, process) -> cost of the bin's units from that process
    for unit, number in enumerate(bins):
        overlap[number, origin[unit]] = overlap.get((number, origin[unit]), 0.0) + costs[unit]
    pairs = sorted((-cost, b, p) for (b, p), cost in overlap.items() if cost)
    name, taken = {}, set()
    for _, number, process in pairs:
        if number not in name and process not in taken:
            name[number] = process
            taken.add(process)
    free = iter(p for p in range(num_processes) if p not in taken)  # bins sharing no work with any free process
    for number in range(num_processes):
        if number not in name:
            name[number] = next(free)
    return [name[number] for number in bins]
