"""The budget from memory (hf_dynbsz.planning.memory, hf_dynbsz.execution.device_memory) in training, against stock TRL.

With ``max_memory_per_device_mib`` the trainer chooses each step's budget from a model of a pass's memory, and a
pass that runs out of memory is re-planned with a smaller budget: in both cases the parameters after training
must equal stock GRPOTrainer's.
"""

from __future__ import annotations

import pytest
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution.device_memory import inject_out_of_memory
from hf_dynbsz.testing import relative_difference, run_training, update_difference

PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def stock_run(model_dir, tmp_path_factory):
    return run_training(
        GRPOTrainer,
        GRPOConfig,
        model_dir,
        str(tmp_path_factory.mktemp("stock")),
        beta=0.1,
        num_iterations=2,
        max_steps=3,
    )


def ours(model_dir, tmp_path, **overrides):
    overrides = dict(dict(beta=0.1, num_iterations=2, max_steps=3), **overrides)
    return run_training(DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, model_dir, str(tmp_path), **overrides)


def assert_matches(stock_run, our_run):
    initial, stock, stock_completions, _ = stock_run
    _, params, completions, history = our_run
    assert completions == stock_completions
    assert relative_difference(params, stock) <= PARAM_TOLERANCE
    assert update_difference(initial, params, stock) <= UPDATE_TOLERANCE
    return [entry for entry in history if "dynbsz/microbatches" in entry]


def test_memory_chosen_budget_matches_stock_and_logs_its_prediction(model_dir, stock_run, tmp_path):
    steps = assert_matches(stock_run, ours(model_dir, tmp_path, max_memory_per_device_mib=100_000))
    assert all(entry["dynbsz/predicted_peak_memory_mib"] > 0 for entry in steps)
    assert all(entry["dynbsz/oom_retries"] == 0 for entry in steps)


@pytest.mark.parametrize(
    "kind, phase, after", [("training", "forward", 1), ("training", "backward", 2), ("logprob", "forward", 1)]
)
def test_an_out_of_memory_pass_is_replanned_and_matches_stock(model_dir, stock_run, tmp_path, kind, phase, after):
    inject_out_of_memory(kind, phase, after)
    steps = assert_matches(stock_run, ours(model_dir, tmp_path, max_tokens_per_microbatch=60))
    assert sum(entry["dynbsz/oom_retries"] for entry in steps) == 1


@pytest.mark.parametrize(
    "faults, outcome",
    [
        ([7], "ran again on smaller probes"),  # the 4th sample alone with gradients (the tree probe's)
        ([9], "ran again on smaller probes"),  # the fastest layout's pass with gradients
        ([0, 0], "stock TRL math runs"),  # the first probe of each try
    ],
    ids=["reference-backward-pass", "layout-pass", "both-tries"],
)
def test_a_self_check_pass_out_of_memory_is_recovered_and_matches_stock(
    model_dir, stock_run, tmp_path, caplog, faults, outcome
):
    """A ``torch.OutOfMemoryError`` raised from inside the model (the middle decoder layer's forward hook) in the
    self-check at start: the check runs again on smaller probes, or where that runs out of memory too, stock math
    runs; never a crash, one log line on it, and the parameters equal stock's."""
    import logging

    from hf_dynbsz.execution import device_memory

    for after in faults:
        inject_out_of_memory("check", "forward", after)
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        run = ours(model_dir, tmp_path)
    assert not device_memory._FAULTS  # every fault fired
    assert_matches(stock_run, run)
    lines = [record.getMessage() for record in caplog.records if "self-check" in record.getMessage()]
    assert (
        len(lines) == 1 and "ran out of memory (_InjectedOutOfMemory: injected out-of-memory error (check" in lines[0]
    )
    assert outcome in lines[0], lines[0]


def capped_run(limit, tmp_path) -> dict:
    import json
    import sys
    from pathlib import Path

    from hf_dynbsz.testing import run_with_timeout

    root = Path(__file__).resolve().parents[1]
    output = run_with_timeout(
        [sys.executable, str(root / "tests" / "memory_capped_run.py"), str(limit), str(tmp_path / f"run-{limit}")],
        root,
        600,
        f"capped run at {limit} MiB",
    )
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith('{"peak_mib')))


@pytest.mark.long
@pytest.mark.slow
def test_a_real_memory_cap_holds_and_a_higher_one_buys_larger_passes(tmp_path):
    """Fresh processes on this machine: the default budget's run peaks above the cap; under the cap the run stays
    below it (whole-process peak, VmHWM) and trains; with the cap raised the budget grows."""
    uncapped = capped_run("none", tmp_path)  # one pass of 16 samples; the longest alone needs a fifth of it
    cap = int(uncapped["peak_mib"]) - 500
    capped = capped_run(cap, tmp_path)
    assert capped["peak_mib"] <= cap, (capped, cap)
    assert len(capped["budgets"]) == 3 and max(capped["passes"]) > 1  # it trained, in more passes than one
    raised = capped_run(cap + 300, tmp_path)
    assert sum(raised["budgets"]) > sum(capped["budgets"])
    assert raised["peak_mib"] <= cap + 300, (raised, cap + 300)


def test_one_sequence_that_runs_out_of_memory_twice_stops_with_its_length(model_dir, tmp_path):
    from hf_dynbsz import OutOfMemoryBudgetError

    inject_out_of_memory("training", "forward", 0)
    inject_out_of_memory("training", "forward", 0)
    with pytest.raises(
        OutOfMemoryBudgetError,
        match=r"one sequence of \d+ tokens alone needs about .* and cannot be "
        r"split\. Lower max_completion_length",
    ):
        ours(model_dir, tmp_path, max_tokens_per_microbatch=1, max_steps=1)


def test_a_memory_fraction_needs_a_cuda_device(model_dir, tmp_path):
    with pytest.raises(
        ValueError,
        match="max_memory_fraction_per_device=0.5 needs a CUDA device, this process runs "
        "on cpu: set max_memory_per_device_mib",
    ):
        ours(model_dir, tmp_path, max_memory_fraction_per_device=0.5)


def test_a_limit_no_pass_fits_warns_what_a_sequence_needs_and_still_matches_stock(model_dir, stock_run, tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"The budget follows max_memory_per_device_mib=100: a sequence of \d+ tokens "
        r"alone is predicted to add about \d+ MiB",
    ):
        run = ours(model_dir, tmp_path, max_memory_per_device_mib=100)  # less than the process holds
    assert_matches(stock_run, run)


def test_a_planned_pass_that_does_not_fit_is_planned_again_smaller(model_dir, tmp_path):
    """Six short leaves under a 60-token trunk (5.9 path keys per token in their subtree) and three 50-token samples
    alone (none): the budget from the step's path keys per token (2.1) puts the subtree in one pass, which the model (a
    path key as heavy as a token) says does not fit; the step is planned again with a smaller budget, after which every
    pass of several samples fits, and a pass of one sample (that cannot be split) is left as it is."""
    import torch

    from hf_dynbsz.execution.packing import SequenceTable
    from hf_dynbsz.planning.memory import KINDS, Coefficients, MemoryModel
    from hf_dynbsz.testing import base_config_kwargs, saved_model_trainer

    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), max_memory_per_device_mib=100_000))
    executor = saved_model_trainer(args, model_dir)._dynbsz
    assert executor.scheduler.sharing == "tree"
    held = executor.meters.memory.held()
    room = 300.0  # MiB a pass may add, far above what the resident set moves between two readings
    executor.memory = MemoryModel({kind: Coefficients(0.0, 1.0, 0.0, 1.0) for kind in KINDS}, 0.0)
    executor.memory.limit_mib = (held + room) / (1 - executor.memory.headroom)
    trunk = [3 + (i % 4) for i in range(60)]
    tokens = [trunk + [3 + leaf % 4, 4 + leaf // 4, 3 + leaf % 3] for leaf in range(6)]
    tokens += [[3 + (i * 7 + k) % 4 for i in range(50)] for k in range(3)]
    table = SequenceTable(
        tokens=[torch.tensor(ids) for ids in tokens],
        prompt_lengths=torch.tensor([30] * 9),
        completion_lengths=torch.tensor([len(ids) - 30 for ids in tokens]),
    )
    plans = []
    plan = executor._plan
    executor._plan = lambda *arguments: plans.append(plan(*arguments)) or plans[-1]  # the real planner, watched
    schedule = executor._planned(table, 10_000, "training", lambda schedule: 0.0)
    assert len(plans) >= 2 and schedule is plans[-1] and schedule.budget < plans[0].budget
    memory = executor.memory
    margin = 1 + memory.increment_margin

    def too_large(plan, slack: float) -> list:
        passes = zip(plan.pass_shapes(), filter(None, plan.microbatches))
        return [group for shape, group in passes if len(group) > 1 and margin * memory.increment(
            "training", *shape[:2], shape[2]) > room + slack]  # fmt: skip

    assert too_large(plans[0], -5.0)  # the first plan had a pass that did not fit
    assert not too_large(schedule, 5.0)  # (the resident set moves a few MiB between the readings)
    assert any(len(group) == 1 and group[0] < 6 for group in schedule.microbatches)  # a leaf alone with its trunk
