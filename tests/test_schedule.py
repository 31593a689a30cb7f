"""Specification of hf_dynbsz.planning.schedule: budget, layout, oversize policy and lockstep, decided in one place."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.balance import SPLIT_CLOSE_ENOUGH, assign
from hf_dynbsz.planning.cost import WorkloadModel
from hf_dynbsz.planning.model_support import ModelSupport
from hf_dynbsz.planning.partition import OversizeSequenceError
from hf_dynbsz.planning.schedule import SINGLE_PROCESS, Scheduler, simulate_processes, stock_microbatch_tokens
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.planning.tokens import microbatch_tokens


class OtherProcesses:
    """A RankGroup whose other processes contributed ``others`` to every all-reduce (element-wise MAX)."""

    def __init__(self, *others: int, num_processes: int = 2):
        self.others = list(others)
        self.num_processes = num_processes
        self.calls = 0

    def all_reduce_max(self, values):
        self.calls += 1
        return [max(mine, theirs) for mine, theirs in zip(values, self.others)]


def scheduler(layout="padded", attention="dense", group=SINGLE_PROCESS, balance_across_ranks=False, **settings_):
    """A scheduler; lockstep alone unless balancing is asked for (OtherProcesses only all-reduces)."""
    return Scheduler(
        layout=layout,
        attention=attention,
        workload=WorkloadModel.default(layout, attention),
        group=group,
        balance_across_ranks=balance_across_ranks,
        **settings_,
    )


# ---- layout (decided by hf_dynbsz.planning.model_support, see tests/test_model_support.py) ---------------------------
def test_from_args_reads_the_config_and_the_model():
    args = SimpleNamespace(
        packing_layout="auto",
        pad_to_multiple_of=8,
        oversize_policy="error",
        max_tokens_per_microbatch=512,
        max_tokens_per_microbatch_logprob=None,
    )
    model_config = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    built = Scheduler.from_args(args, ModelSupport.of(model_config, attn_implementation="flash_attention_2"))
    assert (built.layout, built.attention, built.pad_to_multiple_of, built.oversize_policy) == (
        "padding_free",
        "varlen",
        8,
        "error",
    )
    assert built.workload == WorkloadModel.from_model_config(model_config, layout="padding_free", attention="varlen")
    generic = Scheduler.from_args(args, ModelSupport.of(attn_implementation="sdpa", model=None))
    assert generic.workload == WorkloadModel.default(layout="padding_free", attention="varlen")


# ---- budget ------------------------------------------------------------------------------------------------
def test_training_budget_is_the_setting_or_stocks_own_microbatch():
    assert scheduler().budget(3000) == 3000
    assert scheduler(max_tokens_per_microbatch=1024).budget(3000) == 1024


def test_logprob_budget_is_its_setting_or_twice_the_training_budget():
    assert scheduler().budget(3000, "logprob") == 6000
    assert scheduler(max_tokens_per_microbatch=1024).budget(3000, "logprob") == 2048
    assert (
        scheduler(max_tokens_per_microbatch=1024, max_tokens_per_microbatch_logprob=700).budget(3000, "logprob") == 700
    )
    with pytest.raises(ValueError, match="kind must be one of 'training', 'logprob', 'teacher'"):
        scheduler().budget(3000, "eval")


def test_a_teachers_budget_is_its_setting_or_the_log_prob_rule_at_the_teachers_size():
    """A distillation's teacher passes: ``max_tokens_per_microbatch_teacher``, else twice the training budget times
    ``teacher_scale`` (the student's no-grad memory per token over the teacher's), else with a memory limit what fits
    the teacher's memory model."""
    import dataclasses

    half = dataclasses.replace(scheduler(), teacher_scale=0.5)
    assert half.budget(3000, "teacher") == 3000 and scheduler().budget(3000, "teacher") == 6000
    assert dataclasses.replace(half, max_tokens_per_microbatch=1024).budget(3000, "teacher") == 1024
    assert dataclasses.replace(half, max_tokens_per_microbatch_teacher=700).budget(3000, "teacher") == 700
    assert half.budget(3000, "teacher", fits=900) == 900
    assert half.budget(3000, "teacher", fits=900, cap=500) == 500


def test_stock_microbatch_is_rows_times_longest_prompt_plus_longest_completion():
    assert stock_microbatch_tokens(4, [10, 3], [1, 50]) == 4 * 60
    assert stock_microbatch_tokens(2, [10, 3], [1, 50], pad_to_multiple_of=8) == 2 * (16 + 56)


# ---- lockstep ----------------------------------------------------------------------------------------------
def test_one_process_runs_the_passes_it_needs():
    schedule = scheduler(layout="padding_free").plan([30, 30, 30, 30], 60)
    assert schedule.passes == schedule.passes_needed == 2
    assert schedule.dummy_passes == 0
    assert sorted(i for group in schedule.microbatches for i in group) == [0, 1, 2, 3]


def test_a_lighter_process_runs_as_many_passes_as_the_busiest():
    group = OtherProcesses(5, 0)
    schedule = scheduler(layout="padding_free", group=group).plan([30, 30, 30, 30], 60)
    assert group.calls == 1  # one all-reduce per schedule, whatever happens
    assert schedule.passes_needed == 2 and schedule.passes == 5
    assert schedule.dummy_passes == 1  # four samples spread over four passes, the fifth is empty
    assert schedule.microbatches[-1] == []


def test_a_process_without_samples_runs_only_dummy_passes():
    schedule = scheduler(group=OtherProcesses(3, 0)).plan([], 60)
    assert schedule.microbatches == [[], [], []]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), max_size=40),
    budget=st.integers(1, 600),
    others=st.integers(0, 50),
    layout=st.sampled_from(["padding_free", "padded"]),
    pad=st.sampled_from([None, 1, 8]),
)
def test_schedule_invariants(lengths, budget, others, layout, pad):
    attention = "dense" if layout == "padded" else "varlen"
    schedule = scheduler(layout, attention, OtherProcesses(others, 0), pad_to_multiple_of=pad).plan(lengths, budget)
    assert schedule.passes == max(schedule.passes_needed, others, 1)
    assert sorted(i for group in schedule.microbatches for i in group) == list(range(len(lengths)))
    for group in schedule.microbatches:
        if len(group) > 1 or (group and group[0] not in schedule.oversize):
            assert microbatch_tokens([lengths[i] for i in group], layout, pad) <= budget
    for index in schedule.oversize:
        assert [index] in schedule.microbatches  # a sequence over the budget runs alone
        assert microbatch_tokens([lengths[index]], layout, pad) > budget


# ---- oversize ----------------------------------------------------------------------------------------------
def test_oversize_warn_runs_a_long_sequence_alone_and_says_so():
    schedule = scheduler().plan([10, 500, 20], 100)
    assert schedule.oversize == [1] and [1] in schedule.microbatches
    message = Scheduler.oversize_warning(1, 500, 100)
    assert "1 sequence(s) longer than the token budget (100 tokens; longest 500)" in message
    assert "max_tokens_per_microbatch" in message


def test_oversize_error_names_the_sequence_the_budget_and_the_fix():
    with pytest.raises(OversizeSequenceError) as raised:
        scheduler(oversize_policy="error").plan([10, 500, 20], 100)
    message = str(raised.value)
    assert "sequence 1 of this process's step has 500 tokens" in message
    assert "max_tokens_per_microbatch=100" in message and "max_tokens_per_microbatch to >= 500" in message


def test_oversize_error_names_the_logprob_setting_for_no_grad_passes():
    with pytest.raises(OversizeSequenceError, match="max_tokens_per_microbatch_logprob=100"):
        scheduler(oversize_policy="error").plan([10, 500], 100, kind="logprob")


def test_oversize_on_another_process_stops_this_one_too():
    # This process's samples fit; another process holds a 900-token sequence: every process raises.
    with pytest.raises(OversizeSequenceError) as raised:
        scheduler(oversize_policy="error", group=OtherProcesses(1, 900)).plan([10, 20], 100)
    assert "a sequence on another process has 900 tokens" in str(raised.value)
    assert ">= 900" in str(raised.value)


# ---- cross-rank balancing -----------------------------------------------------------------------------------
def balanced_plans(lengths_per_rank, budgets, layout="padding_free", attention="varlen", **settings_):
    """Every simulated process's schedule (threads meeting at real collectives: simulate_processes)."""
    planner = scheduler(layout, attention, balance_across_ranks=True, **settings_)
    return simulate_processes(planner, lengths_per_rank, budgets, [[1] * len(lengths) for lengths in lengths_per_rank])


def test_balancing_evens_out_lopsided_processes_consistently():
    lengths = [[300, 280, 310, 290, 305, 295], [20, 25, 30, 22, 28, 24], [150, 10, 160, 12, 140, 11]]
    plans = balanced_plans(lengths, [700, 700, 700])
    assert len({plan.passes for plan in plans}) == 1  # lockstep, with no all-reduce beyond the all-gather
    assert {plan.budget for plan in plans} == {700}
    balance = plans[0].balance
    assert all(plan.balance == balance for plan in plans)  # the same assignment everywhere, no broadcast
    assert balance.imbalance_after < balance.imbalance_before and balance.moved > 0
    run_anywhere = sorted(item for plan in plans for item in plan.exchange.incoming)
    assert run_anywhere == [(p, i) for p in range(3) for i in range(6)]  # every sample runs exactly once
    for rank, plan in enumerate(plans):
        assert plan.lengths == [lengths[origin][i] for origin, i in plan.exchange.incoming]
        for target, indices in enumerate(plan.exchange.outgoing):  # what I send is what the target expects
            assert [(rank, i) for i in indices] == [item for item in plans[target].exchange.incoming if item[0] == rank]
        assert sorted(i for group in plan.microbatches for i in group) == list(range(len(plan.lengths)))


def test_balancing_uses_the_largest_automatic_budget_of_all_processes():
    plans = balanced_plans([[40, 50], [400, 410]], [100, 820])
    assert {plan.budget for plan in plans} == {820}
    assert all(not plan.oversize for plan in plans)


def test_already_even_processes_exchange_nothing():
    plans = balanced_plans([[100, 20], [20, 100]], [300, 300])
    assert all(plan.exchange is None and plan.balance.moved == 0 for plan in plans)
    assert plans[0].lengths == [100, 20] and plans[1].lengths == [20, 100]


def test_oversize_on_one_process_stops_every_process():
    plans = balanced_plans([[10, 20], [10, 900]], [100, 100], oversize_policy="error")
    assert all(isinstance(plan, OversizeSequenceError) for plan in plans)
    assert "a sequence on process 1 has 900 tokens" in str(plans[0])
    assert "sequence 1 of this process's step has 900 tokens" in str(plans[1])


def threaded_plans(planner, lengths, budgets, prompts, groups) -> list:
    """:meth:`Scheduler.plan` on every process as training calls it: each process a thread, meeting the others at
    real barrier-synchronised collectives; each process's schedule, or the exception it raised."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    count, posted = len(lengths), {}
    barrier = threading.Barrier(count, timeout=60)

    class Threaded:
        num_processes = count

        def __init__(self, rank):
            self.rank, self.calls = rank, 0

        def all_gather(self, values):
            call, self.calls = self.calls, self.calls + 1
            posted[call, self.rank] = list(values)
            barrier.wait()
            return [list(posted[call, process]) for process in range(count)]

        def all_reduce_max(self, values):
            return [max(column) for column in zip(*self.all_gather(values))]

    def run(rank):
        try:
            return dataclasses.replace(planner, group=Threaded(rank)).plan(
                lengths[rank], budgets[rank], prompt_lengths=prompts[rank], groups=groups[rank]
            )
        except Exception as error:  # noqa: BLE001 - the process's result
            return error

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


@settings(max_examples=40, deadline=None)
@given(
    samples=st.lists(
        st.lists(st.tuples(st.integers(1, 30), st.integers(0, 90), st.integers(0, 3)), max_size=10),
        min_size=1,
        max_size=4,
    ),
    budgets=st.lists(st.integers(20, 300), min_size=4, max_size=4),
    layout=st.sampled_from(["padding_free", "padded"]),
    balance=st.booleans(),
    share=st.booleans(),
    policy=st.sampled_from(["warn", "error"]),
    pad=st.sampled_from([None, 8]),
)
def test_simulated_processes_compute_what_processes_meeting_at_collectives_compute(
    samples, budgets, layout, balance, share, policy, pad
):
    """simulate_processes (one thread, each collective computed over the processes' values) returns, for every
    process, what Scheduler.plan returns on that process when the processes meet at real collectives: the same
    schedule (passes, exchange, assignment) or the same error."""
    planner = scheduler(
        layout,
        "varlen" if layout == "padding_free" else "dense",
        balance_across_ranks=balance,
        sharing=SharePrefix.GROUPS if share and layout == "padding_free" else SharePrefix.NONE,
        oversize_policy=policy,
        pad_to_multiple_of=pad,
    )
    lengths = [[p + c for p, c, _ in process] for process in samples]
    prompts = [[p for p, _, _ in process] for process in samples]
    groups = [[g for _, _, g in process] for process in samples]
    budgets = budgets[: len(samples)]
    simulated = simulate_processes(planner, lengths, budgets, prompts, groups=groups)
    threaded = threaded_plans(planner, lengths, budgets, prompts, groups)
    for mine, theirs in zip(simulated, threaded):
        if isinstance(theirs, Exception):
            assert (type(mine), str(mine)) == (type(theirs), str(theirs))
        else:
            assert mine == theirs


def test_a_simulated_process_that_fails_before_the_collective_stops_the_others():
    """Without balancing, a process whose own samples are bad fails before the all-reduce and the others cannot go
    on; with balancing every process reads every process's samples after the all-gather and raises the same error."""
    lengths, budgets = [[10, 0], [10]], [100, 100]  # a sample of 0 tokens on process 0
    alone, stopped = simulate_processes(scheduler("padding_free", "varlen"), lengths, budgets)
    assert isinstance(alone, ValueError) and "lengths[1] must be a positive number of tokens" in str(alone)
    assert isinstance(stopped, RuntimeError) and "simulated process 0 failed before the collective" in str(stopped)
    balanced = simulate_processes(scheduler("padding_free", "varlen", balance_across_ranks=True), lengths, budgets)
    assert [str(error) for error in balanced] == [str(alone)] * 2


# ---- the planner simulates exactly what training runs -----------------------------------------------------------
def _train_recording_schedules(tmp_path, monkeypatch, settings_):
    """Train a tiny model on scripted random lengths; the model's folder and each step's batch, training schedule
    and prompt groups."""
    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.execution.batch import StepBatch
    from hf_dynbsz.testing import ScriptedRollout, run_training, save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"))
    batches, schedules, groups = [], [], []
    from_slices = StepBatch.from_slices.__func__

    def recording_from_slices(cls, window, *args):
        batches.append(from_slices(cls, window, *args))
        return batches[-1]

    monkeypatch.setattr(StepBatch, "from_slices", classmethod(recording_from_slices))

    class Recording(DynamicBatchGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner = self._dynbsz.scheduler

            class RecordingScheduler:
                def __getattr__(self, name):
                    return getattr(inner, name)

                def plan(self, lengths, budget_, kind="training", **kwargs):
                    schedule = inner.plan(lengths, budget_, kind, **kwargs)
                    if kind == "training":
                        schedules.append(schedule)
                        groups.append(kwargs.get("groups"))
                    return schedule

            self._dynbsz.scheduler = RecordingScheduler()

    rollout = ScriptedRollout(
        lambda rng, n, rank: rng.integers(1, 41, n),
        lambda rng: rng.integers(2, 21),
        max_completion_length=40,
        seed=6,
    )
    run_training(
        Recording,
        DynamicBatchGRPOConfig,
        model_dir,
        str(tmp_path / "out"),
        trainer_kwargs={"rollout_func": rollout},
        **settings_,
    )
    return model_dir, batches, schedules, groups


@pytest.mark.parametrize("layout, budget", [("padded", None), ("padding_free", 48), ("padded", 40)])
def test_plan_lengths_simulates_the_trainers_schedules(tmp_path, monkeypatch, layout, budget):
    """Train on scripted random lengths, then give those lengths to `hf-dynbsz plan --lengths`: same passes. Prompts
    are shared in their groups (a lengths file holds no tokens: the prefix tree of the default rule shares what
    completions of a 4-character alphabet begin with, which lengths cannot tell)."""
    import json

    import numpy as np

    from hf_dynbsz.cli import main

    schedule = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_steps=4)
    settings_ = dict(schedule, max_completion_length=40, packing_layout=layout, max_tokens_per_microbatch=budget)
    settings_.update(share_prompt_prefix="groups")
    model_dir, batches, schedules, groups = _train_recording_schedules(tmp_path, monkeypatch, settings_)
    assert len(batches) == len(schedules) == 4
    assert all(step_groups is not None for step_groups in groups) == (layout == "padding_free")  # shared prompts
    pairs = [
        [int(p), int(c)] + ([] if step_groups is None else [group])
        for batch, step_groups in zip(batches, groups)
        for p, c, group in zip(
            batch.table.prompt_lengths, batch.table.completion_lengths, step_groups or [None] * len(batch)
        )
    ]
    (tmp_path / "lengths.json").write_text(json.dumps(pairs))

    options = [
        "plan",
        "--lengths",
        str(tmp_path / "lengths.json"),
        "--json",
        "--model_config",
        model_dir,
        "--attn_implementation",
        "sdpa",
    ]
    for name, value in settings_.items():
        if value is not None and name != "max_steps":
            options += [f"--{name}", str(value)]

    def simulate(arguments):
        with open(tmp_path / "plan.json", "w") as handle:
            monkeypatch.setattr("sys.stdout", handle)
            assert main(arguments) == 0
        monkeypatch.undo()
        return json.loads((tmp_path / "plan.json").read_text())["steps"]

    simulated = simulate(options)
    assert [step["budget"] for step in simulated] == [schedule.budget for schedule in schedules]
    assert [step["microbatches"] for step in simulated] == [schedule.microbatches for schedule in schedules]
    assert any(len(schedule.microbatches) > 1 for schedule in schedules)  # the steps were really cut up
    assert np.unique([schedule.budget for schedule in schedules]).size >= (1 if budget else 2)
    if layout == "padded" and budget is None:
        # These passes depend on the model's workload: a planner balancing for another model would differ.
        generic = simulate([option for option in options if option not in ("--model_config", model_dir)])
        assert [step["microbatches"] for step in generic] != [schedule.microbatches for schedule in schedules]


def scheduler_args(**fields) -> SimpleNamespace:
    """The scheduler's settings at their defaults ("auto" layout, no fixed budgets, shared prompts), ``fields`` set."""
    defaults = dict(packing_layout="auto", oversize_policy="warn", share_prompt_prefix=True)
    return SimpleNamespace(**defaults, max_tokens_per_microbatch=None, max_tokens_per_microbatch_logprob=None, **fields)


# ---- shared prompts: units are prompt-group pieces ----------------------------------------------------------------
def test_shared_prompts_apply_only_to_padding_free_rows_with_segment_attention():
    args = scheduler_args()
    segments = ModelSupport.of(attn_implementation="sdpa")
    no_segments = dataclasses.replace(segments, segment_attention_blocker="no AttentionInterface")
    assert Scheduler.from_args(args, segments).sharing
    assert not Scheduler.from_args(args, no_segments).sharing  # padded then
    assert Scheduler.from_args(args, no_segments).layout == "padded"
    args.packing_layout = "padded"
    assert not Scheduler.from_args(args, segments).sharing
    args.packing_layout, args.share_prompt_prefix = "padding_free", False
    assert not Scheduler.from_args(args, segments).sharing
    assert Scheduler.from_args(args, segments).segment_attention == "sdpa"


def test_units_share_a_prompt_and_split_into_pieces_that_fit():
    from hf_dynbsz.planning.schedule import build_units

    prompts, completions = [10, 10, 10, 10, 10, 1, 1, 7], [5, 20, 3, 30, 8, 4, 6, 9]
    groups = [0, 0, 0, 0, 0, 1, 1, 2]
    units = build_units(prompts, completions, groups, budget=50)
    by_sample = {i: unit for unit in units for i in unit.samples}
    assert sorted(by_sample) == list(range(8))
    for unit in units:
        if len(unit.samples) > 1:
            assert unit.tokens == 9 + sum(completions[i] + 1 for i in unit.samples) <= 50
    # blocks 31, 21, 9, 6, 4 packed first-fit-decreasing next to the 9-token prefix: [31, 9] and [21, 6, 4]
    assert {by_sample[i].samples for i in range(5)} == {(3, 4), (0, 1, 2)}
    assert by_sample[5] is not by_sample[6]  # a 1-token prompt has no prefix to share
    assert by_sample[7].samples == (7,) and by_sample[7].tokens == 16 and by_sample[7].pairs == 16**2
    assert build_units(prompts, completions, None, 50) == [
        type(units[0])((i,), p + c, (p + c) ** 2) for i, (p, c) in enumerate(zip(prompts, completions))
    ]


def built_passes(table, passes, pad, **sharing):
    """The collator's padding-free rows of ``passes`` (sample indices of ``table``) on sdpa, sharing by ``sharing``
    (``groups=`` or ``keys=``)."""
    from hf_dynbsz.execution.packing import build_microbatch

    return [
        build_microbatch(
            table, samples, layout="padding_free", pad_token_id=0, pad_to_multiple_of=pad, attention="sdpa", **sharing
        )  # fmt: skip
        for samples in passes
    ]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_shared_passes_compute_what_the_schedule_counts(data):
    """For random prompt groups the collator's rows are exactly the tokens the schedule planned, within budget."""
    import torch

    from hf_dynbsz.execution.packing import SequenceTable, build_microbatch

    count = data.draw(st.integers(1, 16))
    prompt_of = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    prompt_lengths = data.draw(st.lists(st.integers(1, 12), min_size=4, max_size=4))
    completions = data.draw(st.lists(st.integers(0, 15), min_size=count, max_size=count))
    budget = data.draw(st.integers(8, 80))
    pad = data.draw(st.sampled_from([None, 4]))
    prompts = [list(range(3, 3 + prompt_lengths[k])) for k in range(4)]
    tokens = [torch.tensor(prompts[k] + [5] * c) for k, c in zip(prompt_of, completions)]
    table = SequenceTable(
        tokens=tokens,
        prompt_lengths=torch.tensor([prompt_lengths[k] for k in prompt_of]),
        completion_lengths=torch.tensor(completions),
    )
    planner = scheduler("padding_free", "varlen", pad_to_multiple_of=pad)
    planner = dataclasses.replace(planner, sharing=SharePrefix.GROUPS)
    groups = table.prompt_groups()
    schedule = planner.plan(table.lengths.tolist(), budget, prompt_lengths=table.prompt_lengths.tolist(), groups=groups)
    assert sorted(i for group in schedule.microbatches for i in group) == list(range(count))
    real = [group for group in schedule.microbatches if group]
    for group, planned, mb in zip(real, schedule.pass_tokens, built_passes(table, real, pad, groups=groups)):
        assert mb.computed_tokens == planned
        if not set(group) & set(schedule.oversize):
            assert planned <= budget
    assert schedule.shared_tokens_saved == sum(table.lengths.tolist()) - sum(
        build_microbatch(table, g, layout="padding_free", pad_token_id=0, attention="sdpa", groups=groups).real_tokens
        for g in real
    )


def tree_table(block: list[int], prompts: list[list[int]], completions: list[list[int]], prompt_of: list[int]):
    """A SequenceTable of samples ``block + prompts[prompt_of[i]] + completions[i]``."""
    import torch

    from hf_dynbsz.execution.packing import SequenceTable

    tokens = [torch.tensor(block + prompts[k] + c) for k, c in zip(prompt_of, completions)]
    return SequenceTable(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(block) + len(prompts[k]) for k in prompt_of]),
        completion_lengths=torch.tensor([len(c) for c in completions]),
    )


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_prefix_tree_passes_compute_what_the_schedule_counts(data):
    """Random blocks every prompt begins with, prompts, and completions that begin alike (tokens of a 3-symbol
    alphabet): each pass the collator builds from the samples' prefix tree computes the tokens the schedule planned,
    within the budget, and the tokens saved are the samples' less the passes'."""

    symbols = st.integers(3, 5)
    block = data.draw(st.lists(symbols, max_size=6))
    prompts = data.draw(st.lists(st.lists(symbols, min_size=1, max_size=5), min_size=1, max_size=3))
    count = data.draw(st.integers(1, 12))
    prompt_of = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=count, max_size=count))
    completions = data.draw(st.lists(st.lists(symbols, max_size=8), min_size=count, max_size=count))
    table = tree_table(block, prompts, completions, prompt_of)
    budget, pad = data.draw(st.integers(8, 60)), data.draw(st.sampled_from([None, 4]))
    planner = dataclasses.replace(scheduler("padding_free", "varlen", pad_to_multiple_of=pad), sharing=SharePrefix.TREE)
    tree = table.prefix_tree("tree")
    schedule = planner.plan(table.lengths.tolist(), budget, prompt_lengths=table.prompt_lengths.tolist(), tree=tree)
    assert sorted(i for group in schedule.microbatches for i in group) == list(range(count))
    real = [group for group in schedule.microbatches if group]
    built = built_passes(table, real, pad, keys=table.prefix_keys("tree"))
    for group, planned, mb in zip(real, schedule.pass_tokens, built):
        assert mb.computed_tokens == planned
        if not set(group) & set(schedule.oversize):
            assert planned <= budget
    assert schedule.shared_tokens_saved == sum(table.lengths.tolist()) - sum(mb.real_tokens for mb in built)
    assert schedule.pass_pairs == [tree.pairs(group) for group in real]
    assert schedule.pass_path_keys == [tree.path_keys(group) for group in real]
    assert schedule.pass_shapes() == list(zip(schedule.pass_tokens, schedule.pass_pairs, schedule.pass_path_keys))


def test_a_shared_prefix_keeps_its_samples_in_one_pass_where_they_fit():
    """A 40-token block every prompt begins with, 4 prompts of 3 completions: their tree fits one pass of 300 tokens,
    where prompt groups need two (and compute the block in each); balancing of two processes moves subtrees, each
    process charged for the paths of the parts it runs."""
    block, prompts = [7] * 40, [[3 + k, 4] for k in range(4)]
    completions = [[5 + (j % 3)] * (6 + j) for j in range(12)]
    table = tree_table(block, prompts, completions, [j // 3 for j in range(12)])
    lengths, prompt_lengths = table.lengths.tolist(), table.prompt_lengths.tolist()
    shared = dataclasses.replace(scheduler("padding_free", "varlen"), sharing=SharePrefix.GROUPS)
    tree = dataclasses.replace(shared, sharing=SharePrefix.TREE)
    by_tree = tree.plan(lengths, 300, prompt_lengths=prompt_lengths, tree=table.prefix_tree("tree"))
    by_groups = shared.plan(lengths, 300, prompt_lengths=prompt_lengths, groups=table.prompt_groups())
    assert by_tree.passes == 1 and by_tree.pass_tokens == [table.prefix_tree("tree").tokens()] and by_groups.passes == 2
    assert sum(by_groups.pass_tokens) - sum(by_tree.pass_tokens) >= 39 * 3  # the block once, not once per prompt
    assert tree.step_cost(lengths, 300, prompt_lengths, tree=table.prefix_tree("tree")) < shared.step_cost(
        lengths, 300, prompt_lengths, groups=table.prompt_groups()
    )
    planner = dataclasses.replace(tree, balance_across_ranks=True)
    trees = [table.prefix_tree("tree"), tree_table(block, prompts[:1], completions[:3], [0, 0, 0]).prefix_tree("tree")]
    plans = simulate_processes(
        planner, [lengths, lengths[:3]], [120, 120], [prompt_lengths, prompt_lengths[:3]], trees=trees
    )
    units = trees[0].units(120)
    assert len(units) > 1 and plans[0].exchange is not None
    balance = plans[0].balance
    for number, unit in enumerate(units):  # a unit (a subtree, or a piece carrying its path) runs whole, or in parts
        placed = balance.placed(number, unit.samples)
        assert {plans[0].exchange.destination[0][i] for i in unit.samples} == set(placed)
    for plan in plans:  # every sample computes its whole path where it runs: a cut unit's path on both processes
        assert [plan.tree.tokens([j]) for j in range(len(plan.lengths))] == plan.lengths
    for plan in plans:  # samples of one process keep their shared path in the tree the receiver plans by
        incoming = plan.exchange.incoming
        roots = [path[0] for path in plan.tree.paths()]
        assert [r1 == r2 for r1 in roots for r2 in roots] == [a[0] == b[0] for a in incoming for b in incoming]


def test_balancing_moves_a_prompt_group_piece_whole():
    from hf_dynbsz.planning.schedule import build_units

    lengths = [[40] * 8, [400] * 8]
    prompts = [[30] * 8, [30] * 8]
    groups = [[0] * 4 + [1] * 4, [0] * 8]  # process 0: two prompts x 4; process 1: one prompt x 8, in two pieces
    budget = 1600
    planner = dataclasses.replace(
        scheduler("padding_free", "varlen", balance_across_ranks=True), sharing=SharePrefix.GROUPS
    )
    plans = simulate_processes(planner, lengths, [budget, budget], prompts, groups=groups)
    exchange = plans[0].exchange
    # a small piece of process 0 and a large piece of process 1 swap: even loads
    assert exchange is not None and plans[0].samples_moved == 8
    assert plans[0].balance.imbalance_after < 1.01 < 1.5 < plans[0].balance.imbalance_before
    for origin in range(2):
        units = build_units(
            prompts[origin], [n - p for n, p in zip(lengths[origin], prompts[origin])], groups[origin], budget
        )
        assert len(units) == 2
        for unit in units:  # a piece moves whole
            assert len({exchange.destination[origin][i] for i in unit.samples}) == 1
    for plan in plans:  # the prompts each process shares: those of one origin group exactly
        origin_groups = [(origin, groups[origin][i]) for origin, i in plan.exchange.incoming]
        roots = [path[0] for path in plan.tree.paths()]
        assert [r1 == r2 for r1 in roots for r2 in roots] == [o1 == o2 for o1 in origin_groups for o2 in origin_groups]


def brute_positions(sequences) -> int:
    """Brute force: the positions ``sequences`` compute in one tree (a position is a sample's tokens up to the one
    after it: the prefix tree's key)."""
    return len({tuple([*s, -1][: i + 2]) for s in sequences for i in range(len(s))})


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_balancing_cuts_lopsided_trees_charging_each_part_its_path(data):
    """Two processes, every prompt beginning with a shared block and completions that begin alike (a 3-symbol
    alphabet), one process's completions long: each process is charged, per process it took samples from, the
    positions those samples compute together (their shared path on every process holding some of them: brute force
    over prefixes), and the busiest process ends within one sample of the mean, however coarse the trees' subtrees."""
    symbols = st.integers(3, 5)
    block = data.draw(st.lists(symbols, max_size=12))
    tables, longest = [], 0
    for length in (st.integers(8, 40), st.integers(1, 4)):  # the long process, then the short one
        prompts = data.draw(st.lists(st.lists(symbols, min_size=1, max_size=5), min_size=1, max_size=3))
        prompt_of = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=8))
        completions = [data.draw(st.lists(symbols, min_size=n, max_size=n)) for n in data.draw(
            st.lists(length, min_size=len(prompt_of), max_size=len(prompt_of)))]  # fmt: skip
        tables.append(tree_table(block, prompts, completions, prompt_of))
        longest = max(longest, *tables[-1].lengths.tolist())
    if data.draw(st.booleans()):
        tables.reverse()
    planner = dataclasses.replace(
        scheduler("padding_free", "dense", balance_across_ranks=True), sharing=SharePrefix.TREE
    )  # dense: a pass costs its tokens
    plans = simulate_processes(
        planner, [t.lengths.tolist() for t in tables], [10**6] * 2, [t.prompt_lengths.tolist() for t in tables],
        trees=[t.prefix_tree("tree") for t in tables],
    )  # fmt: skip
    balance = plans[0].balance
    runs = [plan.exchange.incoming if plan.exchange else [(rank, i) for i in range(len(plan.lengths))]
            for rank, plan in enumerate(plans)]  # fmt: skip
    sequences = [[t.tokens[i].tolist() for i in range(len(t))] for t in tables]
    charged = [
        sum(brute_positions([sequences[q][i] for origin, i in run if origin == q]) for q in range(2)) for run in runs
    ]
    assert balance.loads_after == pytest.approx(charged)
    event(f"cut {bool(balance.shares)}, moved {bool(balance.moved)}")
    mean = sum(charged) / 2
    if balance.moved:
        assert max(charged) <= max((1 + SPLIT_CLOSE_ENOUGH) * mean, mean + longest / 2) + 1e-9
    assert max(charged) <= max(balance.loads_before)


def test_a_lopsided_tree_step_balances_as_an_even_one():
    """The shape of benchmarks/balance.py: 2 processes x 2 prompts x 4 completions, a 16-token block every prompt
    begins with, completions of 416 and 32 tokens, the automatic budget (4 x the longest sequence). Every long
    completion on one process: its tree is one unit over the budget, cut in two pieces at the prompts, and the
    short process's tree is one unit; moving whole units leaves the busiest process 1.07x the evenly loaded step's
    (predicted cost), cutting the short one too as much as the even step (whose trees are over the budget: a piece per
    prompt, each computing the block, as the cut pieces do)."""
    rng = np.random.default_rng(0)
    block = rng.integers(3, 53, 16).tolist()

    def step(long_rank: int | None):
        tables = []
        for rank in range(2):
            prompts = [rng.integers(3, 53, 32).tolist() for _ in range(2)]
            lengths = [416 if (rank == long_rank if long_rank is not None else j % 2 == 0) else 32 for j in range(8)]
            completions = [rng.integers(3, 53, n).tolist() for n in lengths]
            tables.append(tree_table(block, prompts, completions, [j // 4 for j in range(8)]))
        return tables

    from hf_dynbsz.testing import ModelShape

    # the benchmark's model (benchmarks/balance.py): hidden 128, 3 layers of 4 heads on 2 key/value heads, MLP 384
    workload = WorkloadModel.from_model_config(SimpleNamespace(**ModelShape(128, 3, vocab_size=4096).config_fields()))
    planner = dataclasses.replace(
        scheduler("padding_free", "varlen", balance_across_ranks=True),
        sharing=SharePrefix.TREE, workload=workload,
    )  # fmt: skip
    budget = 4 * (16 + 32 + 416)
    peaks = {}
    for name, tables in (("lopsided", step(1)), ("even", step(None))):
        plans = simulate_processes(
            planner, [t.lengths.tolist() for t in tables], [budget] * 2, [t.prompt_lengths.tolist() for t in tables],
            trees=[t.prefix_tree("tree") for t in tables],
        )  # fmt: skip
        peaks[name] = max(plans[0].balance.loads_after)
        if name == "lopsided":
            balance = plans[0].balance
            units = [t.prefix_tree("tree").units(budget) for t in tables]
            whole = assign([planner._unit_costs(u) for u in units])
            assert [len(u) for u in units] == [1, 2] and not whole.shares
            assert balance.shares and plans[0].samples_moved > 0
            peaks["whole"] = max(whole.loads_after)
    assert peaks["whole"] / peaks["even"] > 1.06
    assert peaks["lopsided"] / peaks["even"] <= 1.01


def test_repacked_vision_language_models_train_padding_free_and_balanced_other_families_padded():
    from transformers import CONFIG_MAPPING

    qwen_vl, idefics = CONFIG_MAPPING["qwen2_vl"](), CONFIG_MAPPING["idefics3"]()
    assert ModelSupport.of(qwen_vl).vision_language == "repacked"
    assert ModelSupport.of(idefics).vision_language == "stock"
    assert ModelSupport.of(qwen_vl.get_text_config()).vision_language is None  # the language model alone: text
    assert ModelSupport.of(qwen_vl).padding_free_blocker is None  # repacked: padding-free rows carry M-RoPE
    assert "position ids" in ModelSupport.of(idefics).padding_free_blocker
    args = scheduler_args(balance_across_ranks=True)
    scheduler = Scheduler.from_args(args, ModelSupport.of(qwen_vl, attn_implementation="flash_attention_2"))
    assert (scheduler.layout, scheduler.balance_across_ranks, scheduler.sharing) == (
        "padding_free",
        True,
        SharePrefix.TREE,
    )
    scheduler = Scheduler.from_args(args, ModelSupport.of(idefics, attn_implementation="flash_attention_2"))
    assert (scheduler.layout, scheduler.balance_across_ranks, scheduler.sharing) == ("padded", False, SharePrefix.NONE)
    assert scheduler.attention_mask  # image inputs are positioned from the mask
    assert Scheduler.from_args(args, ModelSupport.of(qwen_vl.get_text_config())).balance_across_ranks


def test_a_scheduler_describes_the_layout_it_was_built_from():
    """Every rung of a model's ladder, segment recurrence included, reads back from the scheduler as the layout it
    came from (the phrase logs, the zoo table and the GPU check report)."""
    args = SimpleNamespace(
        packing_layout="auto",
        oversize_policy="warn",
        max_tokens_per_microbatch=None,
        max_tokens_per_microbatch_logprob=None,
    )
    support = dataclasses.replace(
        ModelSupport.of(attn_implementation="sdpa"), sequence_mixers=("Qwen3NextGatedDeltaNet",)
    )
    layouts, _ = support.layouts()
    assert [layout.describe() for layout in layouts] == [
        "padding_free, prefix tree, segment attention (sdpa), segment recurrence",
        "padding_free, shared prompts, segment attention (sdpa), segment recurrence",
        "padding_free, segment attention (sdpa), segment recurrence",
        "padded",
        "padded, attention mask",
    ]
    for layout in layouts:
        assert Scheduler.from_args(args, support, layout=layout).describe() == layout.describe()


@pytest.mark.parametrize("layout", ["padding_free", "padded"])
def test_step_cost_is_the_cost_of_the_passes_this_scheduler_would_plan(layout):
    """What the layout timing predicts a candidate's step from: the sum over the passes one process alone plans,
    each as its workload model costs it; no collective."""
    workload = WorkloadModel(1.0, 0.01)
    scheduler = Scheduler(layout, "varlen" if layout == "padding_free" else "dense", workload)
    lengths, budget = [30, 5, 41, 12, 12, 7, 60], 64
    schedule = scheduler.plan(lengths, budget)
    expected = sum(
        workload.cost([lengths[i] for i in group], layout, None, scheduler.attention)
        for group in schedule.microbatches
        if group
    )
    assert scheduler.step_cost(lengths, budget) == pytest.approx(expected)
    assert scheduler.step_cost([], budget) == 0.0


# ---- groups that always share a pass -------------------------------------------------------------------------
def test_a_request_carries_its_together_ids_through_the_all_gather():
    from hf_dynbsz.planning.schedule import StepRequest

    planner = scheduler("padding_free", "varlen")
    request = planner._request([10, 12, 7, 9], 30, [4, 4, 3, 3], None, None, [0, 0, 1, 1])
    assert StepRequest.from_values(request.values()) == request
    plain = planner._request([10, 12], 30, [4, 4], None, None)
    assert plain.together is None and StepRequest.from_values(plain.values()) == plain


def test_balancing_moves_pairs_whole_and_runs_each_pair_in_one_pass():
    """Pairs (samples 2k and 2k + 1) on two lopsided processes: balancing moves whole pairs, and every pass holds
    whole pairs, the chosen before the rejected."""
    planner = scheduler("padding_free", "varlen", balance_across_ranks=True)
    lengths = [[300, 280, 310, 290, 305, 295, 200, 210], [20, 25, 30, 22, 28, 24, 26, 21]]
    together = [[k // 2 for k in range(len(row))] for row in lengths]
    prompts = [[1] * len(row) for row in lengths]
    plans = simulate_processes(planner, lengths, [700, 700], prompts, together=together)
    assert plans[0].balance.moved > 0
    for plan in plans:
        moved = plan.exchange.incoming
        for group in plan.microbatches:
            origins = [moved[i] for i in group]
            pairs = {(origin, index // 2) for origin, index in origins}
            assert len(origins) == 2 * len(pairs)  # whole pairs
            assert all(origins[j + 1] == (origins[j][0], origins[j][1] + 1) for j in range(0, len(origins), 2))


def test_balancing_cuts_a_tree_of_pairs_only_between_pairs():
    """Preference pairs behind a block every prompt begins with, one process's responses long, a budget that holds
    a process's step in one pass (its tree is one unit): balancing cuts that unit along its tree, but only between
    pairs (3 long pairs against 1 short: the even cut runs through a pair). A pair's chosen and rejected sequences,
    which fork below their prompt, land on one process, and every pass holds whole pairs."""
    rng = np.random.default_rng(1)
    block = rng.integers(3, 53, 12).tolist()
    tables, together = [], []
    for pairs, length in ((3, 200), (1, 10)):  # the long process, then the short one
        prompts = [rng.integers(3, 53, 8).tolist() for _ in range(pairs)]
        completions = [rng.integers(3, 53, length + k).tolist() for k in range(2 * pairs)]
        together.append([k // 2 for k in range(2 * pairs)])
        tables.append(tree_table(block, prompts, completions, together[-1]))
    planner = dataclasses.replace(
        scheduler("padding_free", "dense", balance_across_ranks=True), sharing=SharePrefix.TREE
    )  # fmt: skip
    plans = simulate_processes(
        planner, [t.lengths.tolist() for t in tables], [10**6] * 2, [t.prompt_lengths.tolist() for t in tables],
        trees=[t.prefix_tree("tree") for t in tables], together=together,
    )  # fmt: skip
    assert plans[0].balance.shares  # the long process's tree was cut (cutting a pair would have evened them out)
    where = {}
    for rank, plan in enumerate(plans):
        for group in plan.microbatches:
            held = [plan.exchange.incoming[i] for i in group]
            for origin, index in held:
                where.setdefault((origin, index // 2), set()).add(rank)
            assert sorted(held) == sorted({(o, 2 * (i // 2) + k) for o, i in held for k in (0, 1)})  # whole pairs
    assert all(len(ranks) == 1 for ranks in where.values())
