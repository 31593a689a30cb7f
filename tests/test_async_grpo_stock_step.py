"""DynamicBatchAsyncGRPOTrainer's default step (``async_step="stock"``) against stock TRL AsyncGRPOTrainer at the same
config, one process on CPU, through TRL's own protocols (:mod:`hf_dynbsz.testing.async_grpo`).

With ``token_budget > 0`` an optimizer step holds the samples stock's ``TokenBudgetBatcher`` puts in its
``gradient_accumulation_steps`` micro-batches (a sample longer than the budget dropped, with stock's warning and
counter), each micro-batch normalised by its own trained tokens; with ``token_budget <= 0`` stock's fixed-count
micro-batches at the user's ``per_device_train_batch_size`` and ``gradient_accumulation_steps``. The plugin's passes
are sized by its own budget (``max_tokens_per_microbatch``, or the tokens of stock's row), never by ``token_budget``.
The opt-in ``async_step="samples"`` trains the plugin's own step: ``8 x 2`` equals stock's ``16 x 1``.
"""

from __future__ import annotations

import pytest
from test_async_grpo_trainer import PARAMETER_TOLERANCE, UPDATE_TOLERANCE, assert_equals_stock

from hf_dynbsz.testing import (
    STOCK_BUDGET_STEP,
    STOCK_STEP_SCRIPT,
    async_grpo_run,
    async_grpo_stock_cut,
    perf_token_counts,
    relative_difference,
    update_difference,
)

#: Rows of which a tenth trains no token; stock's token-budget mode at 400 tokens per row, GA 2.
SCRIPT, BUDGET_STEP = STOCK_STEP_SCRIPT, STOCK_BUDGET_STEP


#: A device peak for stock's MFU figures (none is known on CPU), the same in both runs.
PEAK_FLOPS = 1e12
#: The plugin's own figures of its passes, logged beside stock's names each step (docs/async-grpo.md, Metrics).
PASS_FIGURES = (
    "dynbsz/microbatches",
    "dynbsz/tokens_per_microbatch_mean",
    "dynbsz/tokens_per_microbatch_max",
    "dynbsz/computed_tokens",
    "dynbsz/padding_fraction",
    "dynbsz/budget_utilization",
    "dynbsz/train_seconds",
    "dynbsz/tokens_per_second",
)


def run(trainer: str, model_dir: str, output_dir, **fields):
    """``async_grpo_run`` of ``trainer`` ("stock": ``async_grpo_stock``, "dynamic": ``async_grpo_dynamic``) on this
    module's script, into ``output_dir``."""
    return async_grpo_run(f"async_grpo_{trainer}", model_dir, str(output_dir), SCRIPT, **fields)


@pytest.fixture(scope="module")
def stock_budget(model_dir, tmp_path_factory):
    return run("stock", model_dir, tmp_path_factory.mktemp("stock-budget"), peak_flops=PEAK_FLOPS, **BUDGET_STEP)


def assert_stock_names_mean_stocks(ours, stock) -> None:
    """Beyond :func:`assert_equals_stock` (every ``batch/*`` name, ``batch/pad_frac``, ``batch/row_*``,
    ``batch/packing_ratio``, ``batch/forwarded_tokens_per_step`` and ``batch/microbatches_per_step`` included, equals
    stock's): stock's ``perf/*`` throughput figures count stock's forwarded tokens and its FLOPs per token (at its
    unique-token sequence length), ``perf/fwd_s`` (a forward-only time the passes do not have) is not logged, and the
    plugin's figures of its passes are logged under ``dynbsz/*``."""
    stock_counts = perf_token_counts(stock.history, PEAK_FLOPS)
    for counts in stock_counts:
        counts["names"] -= {"perf/fwd_s"}
    assert perf_token_counts(ours.history, PEAK_FLOPS) == stock_counts and len(stock_counts) == 3
    assert all("perf/fwd_s" in entry for entry in stock.history if "perf/fwd_bwd_s" in entry)
    assert not any("perf/fwd_s" in entry for entry in ours.history)
    assert all(entry["batch/packing_ratio"] > 1 for entry in stock.history if "loss" in entry)  # unique < raw tokens
    steps = [entry for entry in ours.history if "loss" in entry]
    assert all(name in entry for entry in steps for name in PASS_FIGURES)


@pytest.mark.parametrize("passes", [None, 64], ids=["stock-rows", "64-token-passes"])
def test_token_budget_step_equals_stock(model_dir, stock_budget, tmp_path, passes):
    ours = run("dynamic", model_dir, tmp_path, max_tokens_per_microbatch=passes, peak_flops=PEAK_FLOPS, **BUDGET_STEP)
    assert_equals_stock(ours, stock_budget)
    assert_stock_names_mean_stocks(ours, stock_budget)
    steps = [entry for entry in ours.history if "loss" in entry]
    assert len(steps) == 3
    stock_samples = [e["batch/samples_per_step"] for e in stock_budget.history if "loss" in e]
    assert [e["batch/samples_per_step"] for e in steps] == stock_samples
    assert all(round(count) != 32 for count in stock_samples)  # the budget, not 16 x 2, decided the step
    if passes:
        assert max(e["dynbsz/tokens_per_microbatch_max"] for e in steps) <= passes
        assert min(e["dynbsz/microbatches"] for e in steps) > 2


def test_samples_over_the_budget_are_dropped_as_stock_drops_them(model_dir, tmp_path):
    step = dict(BUDGET_STEP, token_budget=40)
    stock = run("stock", model_dir, tmp_path / "stock", **step)
    ours = run("dynamic", model_dir, tmp_path / "ours", max_tokens_per_microbatch=24, **step)
    assert_equals_stock(ours, stock)
    dropped = [e.get("batch/dropped_oversize_total") for e in ours.history if "loss" in e]
    assert any(dropped) and dropped == [e.get("batch/dropped_oversize_total") for e in stock.history if "loss" in e]


@pytest.fixture(scope="module")
def stock_cut(model_dir, tmp_path_factory):
    """Stock's fixed-count mode at 8 x 2."""
    return async_grpo_stock_cut(model_dir, str(tmp_path_factory.mktemp("stock-cut")), SCRIPT)


@pytest.mark.parametrize("passes", [None, 100], ids=["stock-rows", "100-token-passes"])
def test_fixed_count_step_equals_stock_at_the_users_cut(model_dir, stock_cut, tmp_path, passes):
    ours = run(
        "dynamic",
        model_dir,
        tmp_path,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_tokens_per_microbatch=passes,
    )
    assert_equals_stock(ours, stock_cut)


def test_the_samples_step_is_opt_in_and_equals_stock_16x1(model_dir, stock_cut, tmp_path, caplog):
    stock = run("stock", model_dir, tmp_path / "stock", per_device_train_batch_size=16)
    with caplog.at_level("WARNING", logger="hf_dynbsz"):
        ours = run(
            "dynamic",
            model_dir,
            tmp_path / "ours",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            async_step="samples",
        )
    assert_equals_stock(ours, stock, stock_cut)
    assert update_difference(stock.initial, stock_cut.final, stock.final) > 20 * UPDATE_TOLERANCE
    assert relative_difference(ours.final, stock.final) < PARAMETER_TOLERANCE
    said = [record.getMessage() for record in caplog.records]
    said = [message for message in said if message.startswith("hf_dynbsz: async_step='samples'")]
    assert len(said) == 1 and "differs from stock" in said[0]


@pytest.mark.parametrize(
    "step",
    [dict(BUDGET_STEP, token_budget=300), dict(per_device_train_batch_size=8, gradient_accumulation_steps=2)],
    ids=["token-budget-300", "8x2"],
)
def test_an_moe_models_router_aux_loss_equals_stock(tmp_path, step):
    """Stock adds its router aux loss over each micro-batch's packed row, a shared position once, divided by the
    accumulation steps: the plugin weighs each position by its share of the trie node of its micro-batch."""
    from hf_dynbsz.testing import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"), architecture="qwen3_moe")
    stock = run("stock", model_dir, tmp_path / "stock", **step)
    ours = run("dynamic", model_dir, tmp_path / "ours", max_tokens_per_microbatch=64, **step)
    assert stock.trainer.aux_loss_enabled and ours.trainer._dynbsz.capabilities.router_aux
    assert_equals_stock(ours, stock)
    stock_aux = [entry["aux_loss"] for entry in stock.history if "aux_loss" in entry]
    assert len(stock_aux) == 3
    assert [entry["aux_loss"] for entry in ours.history if "aux_loss" in entry] == pytest.approx(stock_aux, rel=1e-5)


def test_each_sample_weighs_as_stock_weighs_its_micro_batch():
    """A sample's weight is processes / (its micro-batch's trained tokens over all processes) / GA, the micro-batch's
    tokens per process counted as at least 1 (stock's clamp), whatever process it runs on."""
    import types

    import torch

    from hf_dynbsz.execution.async_loss import async_loss_settings, async_sample_weights

    trainer = types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.2, args=types.SimpleNamespace(max_completion_length=8)
    )
    batch = types.SimpleNamespace(
        loss_tokens=torch.tensor([3, 5, 1, 0]),
        slice_ids=torch.tensor([0, 0, 1, 3]),  # micro-batches 0 and 1 of process 0, micro-batch 1 of process 1
        slice_rows=torch.tensor([2, 1, 0, 1]),
        num_items=torch.tensor([20.0, 20.0, 1.0, 1.0], dtype=torch.float64),
    )
    weights = async_sample_weights(async_loss_settings(trainer), batch, num_processes=2, gradient_accumulation_steps=2)
    assert weights.tolist() == pytest.approx([2 / 20 / 2, 2 / 20 / 2, 1 / 2, 1 / 2])
