"""``hf_dynbsz.planning.simulation``: the lengths file, prompt groups, the simulated steps and their figures.

The command's output is checked end to end in ``tests/test_cli.py``; these tests state the pieces.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_dynbsz.planning.cost import WorkloadModel
from hf_dynbsz.planning.schedule import Scheduler, stock_microbatch_tokens
from hf_dynbsz.planning.simulation import StepFigures, prompt_groups, read_lengths, simulate
from hf_dynbsz.planning.simulation_table import render_processes


def write(tmp_path, text: str) -> str:
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    return str(path)


def plan(per_device: int = 2, accumulation: int = 2, processes: int = 1, num_generations: int = 2, budget=None):
    """The fields of a :class:`~hf_dynbsz.planning.plan.BatchSizePlan` the simulation reads."""
    return SimpleNamespace(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        per_device_samples_per_optimizer_step=per_device * accumulation,
        num_processes=processes,
        num_generations=num_generations,
        pad_to_multiple_of=None,
        max_tokens_per_microbatch=budget,
    )


def scheduler(budget: int | None = None) -> Scheduler:
    return Scheduler("padding_free", "varlen", WorkloadModel(1.0, 0.0), max_tokens_per_microbatch=budget)


# --------------------------------------------------------------------------- the lengths file
def test_read_lengths_takes_totals_pairs_and_triples(tmp_path):
    assert read_lengths(write(tmp_path, "5\n# a comment\n\n7\n")) == [(5, None, None), (7, None, None)]
    assert read_lengths(write(tmp_path, "2 3\n4, 1\n")) == [(5, 2, None), (5, 4, None)]
    assert read_lengths(write(tmp_path, "[[2, 3, 0], [2, 4, 0]]")) == [(5, 2, 0), (6, 2, 0)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5\n2 3\n", "mix of formats"),
        ("5\nabc\n", "line 2: expected a non-negative integer number of tokens, got 'abc'"),
        ("0 0\n", "a sample has at least 1 token"),
        ("# nothing\n", "holds no lengths"),
        ("[1, [2]]", "item 1: expected PROMPT COMPLETION [GROUP]"),
        ("[1, 2", "is not a valid JSON list"),
    ],
)
def test_read_lengths_names_the_file_and_the_line_of_a_bad_entry(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match="--lengths") as error:
        read_lengths(path)
    assert message in str(error.value) and path in str(error.value)


# --------------------------------------------------------------------------- prompt groups
def test_prompt_groups_are_runs_of_num_generations_with_equal_prompts():
    samples = [(9, 4, None), (8, 4, None), (7, 4, None), (6, 4, None), (5, 3, None), (4, 3, None)]
    assert prompt_groups(samples, num_generations=4) == [0, 0, 0, 0, 1, 1]
    changed = [(9, 4, None), (8, 4, None), (7, 5, None), (6, 5, None)]  # a new prompt length starts a new prompt
    assert prompt_groups(changed, num_generations=4) == [0, 0, 1, 1]


def test_prompt_groups_follow_the_group_column_and_totals_have_none():
    assert prompt_groups([(9, 4, 7), (8, 4, 7), (7, 4, 3)], num_generations=2) == [7, 7, 3]
    assert prompt_groups([(9, None, None)], num_generations=2) is None


# --------------------------------------------------------------------------- the simulated steps
def test_simulate_cuts_optimizer_steps_over_the_processes_process_0_first():
    samples = [(10 + i, None, None) for i in range(10)]  # two processes x 4 per step: a full step and a partial one
    rounds = simulate(plan(processes=2), scheduler(budget=40), samples)
    assert [round_.lengths for round_ in rounds] == [[[10, 11, 12, 13], [14, 15, 16, 17]], [[18, 19]]]
    assert [round_.partial for round_ in rounds] == [False, True]
    first = rounds[0]
    assert len(first.balanced) == len(first.unbalanced) == 2
    assert first.stock_tokens == 4 * 13 + 4 * 17  # each process's samples padded to its longest


def test_a_partial_step_on_one_process_has_nothing_to_balance():
    samples = [(10 + i, None, None) for i in range(9)]  # a full step over two processes, then one sample
    full, partial = simulate(plan(processes=2), scheduler(budget=40), samples)
    assert partial.lengths == [[18]] and partial.balanced[0].balance is None  # one process: no assignment
    assert partial.imbalance == (1.0, 1.0)
    balance = full.balanced[0].balance
    assert full.imbalance == (balance.imbalance_before, balance.imbalance_after)
    table = render_processes(plan(processes=2), scheduler(budget=40), [full, partial])
    assert "over the processes that hold them" in table
    assert table.splitlines()[-1].split()[:9] == ["2*", "1", "18", "40", "1", "1", "1.00", "1.00", "0"]


def test_simulate_budget_is_stock_micro_batch_without_a_setting():
    samples = [(total, prompt, None) for total, prompt in [(12, 4), (9, 5), (20, 2), (7, 3)]]
    (step,) = simulate(plan(), scheduler(), samples)
    width = stock_microbatch_tokens(1, [4, 5, 2, 3], [8, 4, 18, 4])
    assert step.balanced[0].budget == 2 * width


# --------------------------------------------------------------------------- the figures
def test_step_figures_leave_an_oversize_pass_out_of_the_utilisation():
    lengths = [30, 10, 10, 50]  # 50 is over the budget of 40: a pass of its own
    (step,) = simulate(plan(), scheduler(budget=40), [(length, None, None) for length in lengths])
    figures = StepFigures.of(lengths, step.balanced[0], stock_tokens=4 * 50)
    assert (figures.samples, figures.real_tokens, figures.budget) == (4, 100, 40)
    assert figures.passes == 3 and figures.lower_bound == 3  # the oversize one, and 50 tokens into passes of 40
    assert figures.capacity == 2 * 40 and figures.fitting_real_tokens == 50
    assert figures.utilisation == pytest.approx(50 / 80)
    assert figures.saved == pytest.approx(1 - 100 / 200)


def test_step_figures_total_sums_the_steps_without_a_budget():
    one = StepFigures(2, 20, 16, 2, 2, 20, 32, 20, 40)
    two = StepFigures(1, 5, 8, 1, 1, 5, 8, 5, 0)
    total = StepFigures.total([one, two])
    assert total == StepFigures(3, 25, None, 3, 3, 25, 40, 25, 40)
    assert two.saved is None and StepFigures(0, 0, 8, 0, 0, 0, 0, 0, 0).utilisation is None
