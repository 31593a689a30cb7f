"""Specification of hf_dynbsz.planning.plan_table: the plan table's rows, one declarative spec each."""

from __future__ import annotations

from types import SimpleNamespace

from hf_dynbsz.planning.plan import BatchSizePlan
from hf_dynbsz.planning.plan_table import PLAN_ROWS, plan_rows, text_table


def plan(num_processes=2, **overrides):
    values = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, bf16=None)
    values.update(overrides)
    return BatchSizePlan.from_args(SimpleNamespace(**values), num_processes=num_processes)


def test_every_spec_that_applies_gives_one_row_in_order():
    rows = plan_rows(plan())
    assert [row[0] for row in rows] == [spec.setting for spec in PLAN_ROWS if spec.when is None or spec.when(plan())]
    assert all(len(row) == 4 and all(isinstance(cell, str) for cell in row) for row in rows)


def test_conditional_rows_show_only_when_their_predicate_holds():
    names = [row[0] for row in plan_rows(plan(num_processes=4, sequence_parallel_size=2))]
    assert names[-3:] == [
        "sequence_parallel_size",
        "tokens per training pass (group)",
        "tokens per logprob pass (group)",
    ]
    assert "image inputs" not in names and "router aux loss" not in names


def test_environment_sources_are_named_in_the_meaning():
    args = SimpleNamespace(per_device_train_batch_size=4, num_generations=4, max_tokens_per_microbatch=4096)
    args._hf_dynbsz_env_sources = {"max_tokens_per_microbatch": "DIFFU_MAX_TOKENS=4096"}
    row = dict((r[0], r) for r in plan_rows(BatchSizePlan.from_args(args, num_processes=2)))[
        "max_tokens_per_microbatch"
    ]
    assert row[1:3] == ("4096", "8192") and row[3].endswith("[set by DIFFU_MAX_TOKENS=4096]")


def test_text_table_aligns_columns():
    assert text_table(("a", "bb", "c"), [("xxx", "1", "free text")], "<>-") == [
        "a    bb  c",
        "---  --  -",
        "xxx   1  free text",
    ]
