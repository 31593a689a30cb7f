"""Specification of hf_dynbsz.planning.balance: which process runs which units, decided identically everywhere."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.balance import MIN_RELATIVE_GAIN, SPLIT_CLOSE_ENOUGH, Divisible, assign, imbalance

costs_per_process = st.lists(st.lists(st.floats(0.5, 1000.0), max_size=12), min_size=1, max_size=6)


def optimum(unit_costs) -> float:
    """The smallest possible largest load, by brute force (small cases only)."""
    costs = [c for per_process in unit_costs for c in per_process]
    best = float("inf")
    for destination in itertools.product(range(len(unit_costs)), repeat=len(costs)):
        loads = [0.0] * len(unit_costs)
        for cost, process in zip(costs, destination):
            loads[process] += cost
        best = min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(costs_per_process)
def test_every_unit_runs_exactly_once_and_never_worse_than_staying(unit_costs):
    result = assign(unit_costs)
    units = sum(len(per_process) for per_process in unit_costs)
    assert len(result.destination) == len(result.origin) == units
    assert all(0 <= process < len(unit_costs) for process in result.destination)
    assert result.origin == [p for p, per_process in enumerate(unit_costs) for _ in per_process]
    assert max(result.loads_after) <= max(result.loads_before) + 1e-9
    assert sum(result.loads_after) == pytest.approx(sum(result.loads_before))


@settings(max_examples=80, deadline=None)
@given(costs_per_process)
def test_deterministic(unit_costs):
    assert assign(unit_costs) == assign([list(per_process) for per_process in unit_costs])


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 60), max_size=4), min_size=2, max_size=3).filter(
        lambda costs: 0 < sum(map(len, costs)) <= 8
    )
)
def test_within_grahams_bound_of_the_optimum(unit_costs):
    result = assign(unit_costs, min_relative_gain=0.0)
    processes = len(unit_costs)
    assert max(result.loads_after) <= (4 / 3 - 1 / (3 * processes)) * optimum(unit_costs) + 1e-9


def test_small_cases_are_often_optimal():
    optimal = 0
    cases = [[[7, 5, 4], [3, 3, 2]], [[9, 9], [1, 1, 1, 1]], [[6, 6, 6, 6], []], [[10, 1], [1, 1], [1]]]
    for unit_costs in cases:
        optimal += max(assign(unit_costs, min_relative_gain=0.0).loads_after) == optimum(unit_costs)
    assert optimal == len(cases)


def test_lopsided_processes_are_evened_out():
    result = assign([[100.0] * 4, [1.0] * 4])
    assert result.imbalance_before == pytest.approx(400 / 202)
    assert result.loads_after == [202.0, 202.0] and result.imbalance_after == 1.0
    assert result.moved == 4  # two long units one way, two short ones the other: the fewest for 202 each


def test_balanced_input_moves_nothing():
    result = assign([[5.0, 3.0], [4.0, 4.0]])
    assert result.moved == 0 and result.destination == result.origin


def test_a_gain_below_the_threshold_is_not_worth_an_exchange():
    # Moving the 1.0 unit would lower the largest load from 101 to 100: under 2%.
    result = assign([[100.0, 1.0], [99.0]])
    assert MIN_RELATIVE_GAIN > 1 / 101 and result.moved == 0
    assert assign([[100.0, 1.0], [99.0]], min_relative_gain=0.0).moved == 1


def test_one_process_or_no_work_is_left_alone():
    assert assign([[3.0, 4.0]]).destination == [0, 0]
    assert assign([[], []]).destination == []
    assert imbalance([0.0, 0.0]) == 1.0 and imbalance([3.0, 1.0]) == 1.5


# ---- units cut across processes ---------------------------------------------------------------------------------
class Forest:
    """Divisible units for the specification: unit ``u`` is a path of ``paths[u]`` cost shared by its parts, and
    part ``k`` of it costs ``leaves[u][k]`` more; a process holding some parts of ``u`` computes the path once and
    each of their leaves. A unit may be cut into any of its single parts, or its first half."""

    def __init__(self, paths, leaves):
        self.paths, self.leaves = paths, leaves

    def cost(self, unit, parts):
        return self.paths[unit] + sum(self.leaves[unit][k] for k in parts) if parts else 0.0

    def divisible(self):
        def pieces(unit, parts):
            return list(dict.fromkeys([parts, parts[: len(parts) // 2] or parts, *((k,) for k in parts)]))

        def costs(unit, sets):
            return [self.cost(unit, parts) for parts in sets]

        return Divisible([tuple(range(len(leaves))) for leaves in self.leaves], costs, pieces)


forests = st.lists(  # per process, its units: (path cost, leaf costs)
    st.lists(st.tuples(st.floats(0.0, 50.0), st.lists(st.floats(0.5, 100.0), min_size=1, max_size=6)), max_size=4),
    min_size=2,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(forests)
def test_cut_units_run_every_part_once_and_charge_the_path_on_every_process_holding_part(units_per_process):
    units = [unit for per_process in units_per_process for unit in per_process]
    forest = Forest([path for path, _ in units], [leaves for _, leaves in units])
    whole = [[forest.cost(u, tuple(range(len(leaves)))) for u, (_, leaves) in enumerate(units)]]
    costs, offset = [], 0
    for per_process in units_per_process:
        costs.append(whole[0][offset : offset + len(per_process)])
        offset += len(per_process)
    result = assign(costs, min_relative_gain=0.0, divisible=forest.divisible())
    charged = [0.0] * len(costs)
    for unit, (_, leaves) in enumerate(units):
        placed = result.placed(unit, tuple(range(len(leaves))))
        assert sorted(k for parts in placed.values() for k in parts) == list(range(len(leaves)))  # each part once
        assert all(parts for parts in placed.values())
        for process, parts in placed.items():  # the path on every process holding part of the unit
            charged[process] += forest.cost(unit, parts)
        assert (len(placed) > 1) == (unit in result.shares)
    assert result.loads_after == pytest.approx(charged)
    uncut = assign(costs, min_relative_gain=0.0)
    assert max(result.loads_after) <= max(uncut.loads_after) + 1e-9  # never worse than moving whole units


@settings(max_examples=200, deadline=None)
@given(forests)
def test_cutting_units_balances_within_a_part_of_the_mean(units_per_process):
    """Where cutting ends, moving any one part from the busiest process to the idlest would not lower the larger of
    the two loads, so they differ by at most what one part costs there (its path with it): the largest load is
    within that of the mean, or within SPLIT_CLOSE_ENOUGH of it."""
    units = [unit for per_process in units_per_process for unit in per_process]
    forest = Forest([path for path, _ in units], [leaves for _, leaves in units])
    costs, offset = [], 0
    for per_process in units_per_process:
        costs.append([forest.cost(u, tuple(range(len(units[u][1])))) for u in range(offset, offset + len(per_process))])
        offset += len(per_process)
    if not any(costs):
        return
    result = assign(costs, min_relative_gain=0.0, divisible=forest.divisible())
    loads = result.loads_after
    mean = sum(loads) / len(loads)
    part = max(path + max(leaves) for path, leaves in units)
    assert max(loads) <= max((1 + SPLIT_CLOSE_ENOUGH) * mean, mean + part, max(result.loads_before)) + 1e-6


def test_a_process_holding_one_big_unit_shares_it():
    """Process 0 holds one unit (a path of 10 and 8 parts of 100), process 1 one small one: whole units cannot move
    usefully (1.6 times the mean); cut, each process runs about half, the path computed on both."""
    forest = Forest([10.0, 10.0], [[100.0] * 8, [5.0] * 4])
    costs = [[forest.cost(0, tuple(range(8)))], [forest.cost(1, tuple(range(4)))]]
    assert assign(costs).moved == 0  # whole units: nothing helps
    result = assign(costs, divisible=forest.divisible())
    assert result.imbalance_before > 1.6 and result.imbalance_after < 1.1
    assert sorted(result.shares[0]) == [0, 1] and result.loads_after == [430.0, 430.0]
    extra = sum(10.0 * (len(result.shares.get(unit, {0: ()})) - 1) for unit in range(2))
    assert sum(result.loads_after) == pytest.approx(sum(result.loads_before) + extra)  # a path on both processes


def test_units_are_not_cut_where_whole_units_balance():
    forest = Forest([10.0, 10.0, 10.0, 10.0], [[100.0] * 4, [100.0] * 4, [5.0] * 4, [5.0] * 4])
    costs = [[forest.cost(0, (0, 1, 2, 3)), forest.cost(1, (0, 1, 2, 3))], [forest.cost(2, (0, 1, 2, 3))] * 2]
    result = assign(costs, divisible=forest.divisible())
    assert result.shares == {} and result.imbalance_after == 1.0 and result.moved == 2
