"""``hf-dynbsz plan --trainer async_grpo`` and the plan table of DynamicBatchAsyncGRPOTrainer: the samples an
optimizer step takes from the rollout queue, stock's ``token_budget`` as the training budget, training's own checks."""

from __future__ import annotations

from hf_dynbsz.cli import main
from hf_dynbsz.planning.plan import BatchSizePlan


def test_the_async_plan_shows_the_queue_and_no_generation_round():
    class Options:  # the planner's namespace of raw values
        per_device_train_batch_size, gradient_accumulation_steps, num_generations = 8, 2, 4

    plan = BatchSizePlan.from_args(Options(), num_processes=2, trainer="async_grpo")
    assert plan.stock_trainer == "AsyncGRPOTrainer"
    assert plan.global_samples_per_optimizer_step == 32 and plan.prompts_per_optimizer_step == 8
    rows = {row[0]: row for row in plan.rows()}
    assert rows["rollout queue"][1:3] == ("16", "32")
    assert "generation_batch_size" not in rows and "per_device_generation_batch_size" not in rows
    assert "stock's row of 8 samples per micro-batch" in rows["max_tokens_per_microbatch"][3]
    assert "async_step='samples'" in rows["rollout queue"][3]


def test_the_plan_of_stocks_step_says_what_decides_its_samples():
    class Options:  # the trainer's config: stock's step (the default) with stock's token budget
        per_device_train_batch_size, gradient_accumulation_steps, num_generations = 8, 2, 4
        async_step, token_budget = "stock", 400

    rows = {row[0]: row for row in BatchSizePlan.from_args(Options(), num_processes=2, trainer="async_grpo").rows()}
    assert rows["rollout queue"][1:3] == ("-", "-") and "token_budget=400 tokens per row" in rows["rollout queue"][3]
    assert "stock's row of token_budget=400" in rows["max_tokens_per_microbatch"][3]
    Options.token_budget = 0  # stock's fixed count: 8 x 2 per process, each micro-batch normalised by its own tokens
    rows = {row[0]: row for row in BatchSizePlan.from_args(Options(), num_processes=2, trainer="async_grpo").rows()}
    assert rows["rollout queue"][1:3] == ("16", "32") and "each normalised by its own" in rows["rollout queue"][3]


def test_plan_async_grpo_takes_stocks_options_and_token_budget(capsys):
    options = ["--per_device_train_batch_size", "16", "--num_generations", "8", "--num_processes", "2"]
    assert main(["plan", "--trainer", "async_grpo", *options, "--token_budget", "4096"]) == 0
    table = capsys.readouterr().out
    assert "rollout queue" in table
    assert next(line for line in table.splitlines() if line.startswith("max_tokens_per_microbatch")).split()[1:3] == [
        "4096",
        "8192",
    ]


def test_plan_async_grpo_refuses_what_training_refuses(capsys):
    budgets = ["--token_budget", "4096", "--max_tokens_per_microbatch", "2048"]
    assert main(["plan", "--trainer", "async_grpo", "--per_device_train_batch_size", "8", *budgets]) == 2
    assert "token_budget=4096 and max_tokens_per_microbatch=2048 disagree" in capsys.readouterr().err
    assert main(["plan", "--trainer", "async_grpo", "--sequence_parallel_size", "2", "--num_processes", "2"]) == 2
    assert "DynamicBatchAsyncGRPOTrainer does not run sequence parallelism" in capsys.readouterr().err
