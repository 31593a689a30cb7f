"""Specification of hf_dynbsz.planning.balance: which process runs which units, decided identically everywhere."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.balance import MIN_RELATIVE_GAIN, assign, imbalance

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
