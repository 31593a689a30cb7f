"""DynamicBatchAsyncGRPOTrainer against stock TRL AsyncGRPOTrainer, one process on CPU, through TRL's own protocols.

Stock runs here through its own extension points (:mod:`hf_dynbsz.testing.async_grpo`): a stand-in rollout worker
over scripted samples, a no-op weight transfer, its FA3 tree kernel in plain torch. The reference is stock's
fixed-count mode with the whole optimizer step in one micro-batch per process (``token_budget=0``,
``per_device_train_batch_size`` the step's samples, ``gradient_accumulation_steps=1``), where stock's loss is the
step's token mean: the default step (``async_step="stock"``) at ``16 x 1`` is that step whatever the plugin's pass
budget (``max_tokens_per_microbatch``, memory), and the samples-defined step (``async_step="samples"``) is it however
the step is written (``16 x 1`` or ``8 x 2``) and whatever its budget (``token_budget``): the parameters (SGD at a
large rate: the update shows every sample's weight), and every metric stock logs, equal stock's. Stock's step at
other configs (its token budget, ``8 x 2``): ``tests/test_async_grpo_stock_step.py``.
"""

from __future__ import annotations

import pytest

from hf_dynbsz.testing import (
    ASYNC_UNCOMPARED,
    RolloutScript,
    async_grpo_run,
    async_grpo_stock_cut,
    logged_metrics,
    metric_mismatches,
    relative_difference,
    update_difference,
)

#: The plugin's and stock's parameters (relative) and updates (relative to stock's update) after 3 steps.
PARAMETER_TOLERANCE, UPDATE_TOLERANCE = 1e-5, 1e-3
#: The plugin's own step, defined by samples (opt-in).
SAMPLES = dict(async_step="samples")


@pytest.fixture(scope="module")
def stock_step(model_dir, tmp_path_factory):
    """Stock's fixed-count mode, the step in one micro-batch: 16 samples x 1 accumulation step."""
    return async_grpo_run(
        "async_grpo_stock", model_dir, str(tmp_path_factory.mktemp("stock")), per_device_train_batch_size=16
    )


@pytest.fixture(scope="module")
def stock_cut(model_dir, tmp_path_factory):
    """Stock's fixed-count mode with the same samples per step cut 8 x 2."""
    return async_grpo_stock_cut(model_dir, str(tmp_path_factory.mktemp("stock-cut")))


#: What the optimizer step computed (its loss, gradient and stock's loss metrics), compared with stock's step in one
#: micro-batch; what stock's collator logs per micro-batch (sample and reward figures, the queue) depends on how the
#: step is written, and is compared with stock's run written the same way.
STEP_METRICS = ("loss", "grad_norm", "ratio", "kl", "entropy", "clip_ratio/", "train_loss", "aux_loss")


def step_metrics(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k.startswith(STEP_METRICS)} for entry in history]


def assert_equals_stock(ours, stock, same_cut=None) -> None:
    """``ours`` trained ``stock``'s parameters and logged its step's metrics; every other metric stock logs is that
    of ``same_cut`` (stock written as ``ours`` is; default ``stock``)."""
    parameters = relative_difference(ours.final, stock.final)
    update = update_difference(stock.initial, ours.final, stock.final)
    assert parameters < PARAMETER_TOLERANCE and update < UPDATE_TOLERANCE, (parameters, update)
    assert metric_mismatches(step_metrics(ours.history), step_metrics(stock.history)) == []
    left_out = (*ASYNC_UNCOMPARED, *STEP_METRICS)
    same_cut = same_cut or stock
    assert metric_mismatches(logged_metrics(ours.history, left_out), logged_metrics(same_cut.history, left_out)) == []


@pytest.mark.parametrize(
    ("per_device", "accumulation", "budget"),
    [(16, 1, 0), (16, 1, 64), (8, 2, 0), (8, 2, 100)],
    ids=["16x1-auto", "16x1-64", "8x2-auto", "8x2-100"],
)
def test_the_samples_step_equals_stock_fixed_count_whatever_the_budget(
    model_dir, stock_step, stock_cut, tmp_path, per_device, accumulation, budget
):
    ours = async_grpo_run(
        "async_grpo_dynamic",
        model_dir,
        str(tmp_path),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        token_budget=budget,
        **SAMPLES,
    )
    assert_equals_stock(ours, stock_step, stock_cut if accumulation > 1 else stock_step)
    if not budget and accumulation == 1:  # the same tokens as stock's one row per step: the same FLOP count
        assert ours.history[-1]["total_flos"] == stock_step.history[-1]["total_flos"]
    passes = [entry["dynbsz/microbatches"] for entry in ours.history if "dynbsz/microbatches" in entry]
    assert len(passes) == 3
    if budget:  # the budget cut each step into several passes
        assert min(passes) > 1
        assert max(e["dynbsz/tokens_per_microbatch_max"] for e in ours.history if "loss" in e) <= budget
    trained = [e["batch/samples_per_step"] for e in ours.history if "loss" in e]
    assert trained == [16.0, 16.0, 16.0]


def test_stock_depends_on_how_its_step_is_cut(stock_step, stock_cut):
    """The control: stock's 8 x 2 takes the same samples per step as its 16 x 1 and trains different parameters
    (each micro-batch normalised by its own tokens), so the comparisons above can tell the two apart."""
    assert update_difference(stock_step.initial, stock_cut.final, stock_step.final) > 20 * UPDATE_TOLERANCE


def test_multi_turn_forks_and_a_shared_tool_block_equal_stock(model_dir, tmp_path):
    """Tool results inside a completion (context), conversations forked into a second row sharing their history,
    and a block every prompt begins with: the prefix tree shares them, the step equals stock's."""
    script = RolloutScript(seed=3, shared_prefix=12, tool_turns=2, forks=0.5, completion_lengths=(6, 40))
    stock = async_grpo_run(
        "async_grpo_stock", model_dir, str(tmp_path / "stock"), script, per_device_train_batch_size=16
    )
    ours = async_grpo_run(
        "async_grpo_dynamic",
        model_dir,
        str(tmp_path / "ours"),
        script,
        per_device_train_batch_size=16,
        max_tokens_per_microbatch=120,
    )
    assert_equals_stock(ours, stock)
    entries = [entry for entry in ours.history if "loss" in entry]
    assert all(entry["dynbsz/tree_tokens_saved"] > 0 for entry in entries)
    assert all(entry["dynbsz/prompt_tokens_saved"] > 0 for entry in entries)


@pytest.mark.parametrize("step", ["stock", "samples"])
def test_a_sample_longer_than_the_pass_budget_is_trained_not_dropped(model_dir, stock_step, tmp_path, step):
    """A sample longer than the plugin's pass budget gets a pass of its own (stock's step: stock's fixed count decided
    the samples; the samples step: token_budget is the pass budget and drops nothing)."""
    budget = dict(max_tokens_per_microbatch=24) if step == "stock" else dict(token_budget=24)
    with pytest.warns(UserWarning, match="longer than"):
        ours = async_grpo_run(
            "async_grpo_dynamic", model_dir, str(tmp_path), per_device_train_batch_size=16, async_step=step, **budget
        )
    assert_equals_stock(ours, stock_step)


def test_the_constructor_is_stocks():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from hf_dynbsz import DynamicBatchAsyncGRPOTrainer
    from hf_dynbsz.testing import signature_mismatches

    assert not signature_mismatches(DynamicBatchAsyncGRPOTrainer, AsyncGRPOTrainer)  # the constructor and overrides
    assert issubclass(DynamicBatchAsyncGRPOTrainer, AsyncGRPOTrainer)


def test_the_budget_from_memory_equals_stock(model_dir, stock_step, tmp_path):
    """No pass budget, a memory limit: each step's budget is the largest whose predicted peak fits (the samples step
    with token_budget unset: the server is not asked for max_model_len)."""
    ours = async_grpo_run(
        "async_grpo_dynamic",
        model_dir,
        str(tmp_path),
        per_device_train_batch_size=16,
        token_budget=None,
        max_memory_per_device_mib=100_000,
        **SAMPLES,
    )
    assert_equals_stock(ours, stock_step)
    steps = [entry for entry in ours.history if "dynbsz/microbatches" in entry]
    assert all(entry["dynbsz/predicted_peak_memory_mib"] > 0 for entry in steps)


def test_an_out_of_memory_pass_is_replanned_and_equals_stock(model_dir, stock_step, tmp_path):
    from hf_dynbsz.execution.device_memory import inject_out_of_memory

    inject_out_of_memory("training", "backward", 2)
    ours = async_grpo_run(
        "async_grpo_dynamic", model_dir, str(tmp_path), per_device_train_batch_size=16, max_tokens_per_microbatch=96
    )
    assert_equals_stock(ours, stock_step)
    assert sum(entry.get("dynbsz/oom_retries", 0) for entry in ours.history) == 1


def test_dynamic_batching_off_is_stock(model_dir, stock_step, tmp_path):
    """dynamic_batching=False: stock's trainer (its FA3 tree kernel, here the reference one; its batchers and
    compute_loss), the same parameters and every logged metric."""
    ours = async_grpo_run(
        "async_grpo_dynamic", model_dir, str(tmp_path), per_device_train_batch_size=16, dynamic_batching=False
    )
    assert ours.trainer.model.config._attn_implementation == "tree_fa3"
    assert relative_difference(ours.final, stock_step.final) == 0.0
    left_out = ("perf/", "sample/time_in_queue_s")
    assert metric_mismatches(logged_metrics(ours.history, left_out), logged_metrics(stock_step.history, left_out)) == []


# ---- the config ------------------------------------------------------------------------------------------------


def test_token_budget_is_stocks_by_default_and_the_samples_steps_training_budget(tmp_path):
    from hf_dynbsz import DynamicBatchAsyncGRPOConfig

    config = DynamicBatchAsyncGRPOConfig(str(tmp_path), token_budget=512, max_tokens_per_microbatch=256, use_cpu=True)
    assert (config.async_step, config.token_budget, config.max_tokens_per_microbatch) == ("stock", 512, 256)
    config = DynamicBatchAsyncGRPOConfig(str(tmp_path), token_budget=512, use_cpu=True, **SAMPLES)
    assert config.max_tokens_per_microbatch == 512
    config = DynamicBatchAsyncGRPOConfig(str(tmp_path), token_budget=0, use_cpu=True, **SAMPLES)
    assert config.max_tokens_per_microbatch is None
    with pytest.raises(ValueError, match="token_budget=512 and max_tokens_per_microbatch=256 disagree"):
        DynamicBatchAsyncGRPOConfig(
            str(tmp_path), token_budget=512, max_tokens_per_microbatch=256, use_cpu=True, **SAMPLES
        )
    with pytest.raises(ValueError, match="async_step must be one of 'stock', 'samples', got 'steps'"):
        DynamicBatchAsyncGRPOConfig(str(tmp_path), async_step="steps", use_cpu=True)
    with pytest.raises(ValueError, match="sequence_parallel_size=2: DynamicBatchAsyncGRPOTrainer does not run"):
        DynamicBatchAsyncGRPOConfig(str(tmp_path), sequence_parallel_size=2, use_cpu=True)


def test_a_plain_async_config_gains_the_plugins_fields_and_the_environment(model_dir, tmp_path, monkeypatch):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from hf_dynbsz.configs.async_grpo import async_trainer_config

    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "256")
    config = async_trainer_config(AsyncGRPOConfig(str(tmp_path), token_budget=300, use_cpu=True), model_dir)
    assert (config.async_step, config.tensor_batch_size, config.dynamic_batching) == ("stock", 256, True)
    assert (config.token_budget, config.max_tokens_per_microbatch) == (300, None)
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "256")
    plain = AsyncGRPOConfig(str(tmp_path), token_budget=300, use_cpu=True)
    plain.async_step = "samples"
    assert async_trainer_config(plain, model_dir).max_tokens_per_microbatch == 300


def test_a_memory_cap_under_the_steps_one_pass_peak_cuts_more_passes_and_equals_stock(model_dir, stock_step, tmp_path):
    """The cap 20 MiB under the peak a roomy cap's run predicted (on CPU this process's held memory is most of it, and
    may move by a few MiB between runs): the budget from memory shrinks, the step runs in more passes, and it still
    equals stock. (A cap of 100,000 MiB never binds.)"""
    fields = dict(per_device_train_batch_size=16, token_budget=None, **SAMPLES)
    roomy = async_grpo_run("async_grpo_dynamic", model_dir, str(tmp_path / "roomy"), max_memory_per_device_mib=100_000,
                           **fields)  # fmt: skip
    roomy_steps = [entry for entry in roomy.history if "dynbsz/microbatches" in entry]
    cap = int(min(entry["dynbsz/predicted_peak_memory_mib"] for entry in roomy_steps)) - 20
    ours = async_grpo_run("async_grpo_dynamic", model_dir, str(tmp_path / "capped"), max_memory_per_device_mib=cap,
                          **fields)  # fmt: skip
    assert_equals_stock(ours, stock_step)
    steps = [entry for entry in ours.history if "dynbsz/microbatches" in entry]
    assert min(step["dynbsz/microbatches"] for step in steps) > max(step["dynbsz/microbatches"] for step in roomy_steps)
