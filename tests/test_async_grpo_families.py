"""DynamicBatchAsyncGRPOTrainer where stock AsyncGRPOTrainer refuses or cannot run, one process on CPU.

Stock trains only through its FlashAttention-3 tree kernel and refuses models with layers other than full or sliding
attention (hybrids, state-space models) and models with attention sinks. The plugin trains them on their own kernels
(segment recurrence for the sequence mixers, the model's own attention for sinks); the reference is stock's
fixed-count step computed sample by sample on the model's own forward
(:func:`~hf_dynbsz.testing.reference_async_grpo_steps`), which is first shown equal to stock where stock runs.
"""

from __future__ import annotations

import pytest

from hf_dynbsz.testing import (
    TEST_ALPHABET,
    RolloutScript,
    async_grpo_run,
    build_char_tokenizer,
    reference_async_grpo_steps,
    relative_difference,
    save_tiny_model,
    update_difference,
)

#: The plugin's samples-defined step as 8 x 2 samples cut by a 64-token budget; the reference's (and stock's) as 16 in
#: one.
STEP = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, token_budget=64, async_step="samples")
SCRIPT = RolloutScript(seed=5, shared_prefix=6, tool_turns=1, forks=0.3, completion_lengths=(4, 30))


def reference(
    model_dir: str,
    script: RolloutScript = SCRIPT,
    steps: int = 3,
    per_step: int = 16,
    router_aux_loss_coef: float = 0.0,
) -> dict:
    """The reference step (:func:`reference_async_grpo_steps`) from the model saved at ``model_dir``, on the samples
    the stand-in worker hands out (no sample goes stale in these runs: the queue order)."""
    import torch
    from transformers import AutoModelForCausalLM

    samples = script.take(steps * per_step)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    chunks = [samples[step * per_step : (step + 1) * per_step] for step in range(steps)]
    return reference_async_grpo_steps(model, chunks, learning_rate=0.5, router_aux_loss_coef=router_aux_loss_coef)


def assert_equals(ours, expected: dict) -> None:
    parameters = relative_difference(ours.final, expected)
    update = update_difference(ours.initial, ours.final, expected)
    assert parameters < 1e-5 and update < 1e-3, (parameters, update)


def save_zoo_model(directory: str, model_type: str) -> str:
    """The zoo's tiny ``model_type`` (:mod:`hf_dynbsz.testing.zoo`) saved with the test tokenizer."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    build_tiny_causal_lm_of_type(model_type, seed=0).save_pretrained(directory)
    build_char_tokenizer(TEST_ALPHABET).save_pretrained(directory)
    return directory


def stock_and_ours(tmp_path, model_dir: str, **ours) -> tuple:
    """Stock's fixed-count step (16 x 1) and the plugin's run with ``ours``'s fields, on :data:`SCRIPT`."""
    stock = async_grpo_run(
        "async_grpo_stock", model_dir, str(tmp_path / "stock"), SCRIPT, per_device_train_batch_size=16
    )
    return stock, async_grpo_run("async_grpo_dynamic", model_dir, str(tmp_path / "ours"), SCRIPT, **ours)


def test_the_reference_step_equals_stock(tmp_path):
    """Where stock runs, its fixed-count step equals the reference: the reference is stock's math."""
    model_dir = save_tiny_model(str(tmp_path / "model"))
    stock = async_grpo_run(
        "async_grpo_stock", model_dir, str(tmp_path / "stock"), SCRIPT, per_device_train_batch_size=16
    )
    assert_equals(stock, reference(model_dir))


def test_the_models_eager_attention_equals_stock(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "model"))
    stock, ours = stock_and_ours(tmp_path, model_dir, model_init_kwargs={"attn_implementation": "eager"}, **STEP)
    assert ours.trainer.model.config._attn_implementation == "eager"
    assert_equals(ours, stock.final)


@pytest.mark.parametrize(
    ("model_type", "refusal"),
    [("qwen3_next", "linear_attention"), ("lfm2", "conv"), ("gpt_oss", "attention sinks")],
    ids=["hybrid-gated-delta-net", "state-space-conv", "attention-sinks"],
)
def test_a_model_stock_refuses_trains_as_the_reference(tmp_path, model_type, refusal):
    model_dir = save_zoo_model(str(tmp_path / "model"), model_type)
    with pytest.raises(ValueError, match=refusal):
        async_grpo_run(
            "async_grpo_stock", model_dir, str(tmp_path / "stock"), SCRIPT, train=False, router_aux_loss_coef=0.0
        )
    ours = async_grpo_run(
        "async_grpo_dynamic", model_dir, str(tmp_path / "ours"), SCRIPT, router_aux_loss_coef=0.0, **STEP
    )
    assert_equals(ours, reference(model_dir))
    entries = [entry for entry in ours.history if "loss" in entry]
    assert all(entry["dynbsz/microbatches"] > 1 for entry in entries)  # the budget cut the steps
    scheduler = ours.trainer._dynbsz.scheduler
    assert scheduler.layout == "padding_free"
    if model_type != "gpt_oss":  # the sequence mixers run per node of the prefix tree
        assert scheduler.segment_recurrence


@pytest.mark.parametrize(
    ("per_device", "accumulation", "budget"), [(16, 1, 0), (8, 2, 64)], ids=["16x1-auto", "8x2-64"]
)
def test_an_moe_models_router_aux_loss_equals_stock(tmp_path, per_device, accumulation, budget):
    """Stock adds its MoE router aux loss over each packed row, a shared position counted once: the plugin weighs each
    position by its share of the trie node (and the reference written out agrees). The samples-defined step; stock's
    step at other configs: ``tests/test_async_grpo_stock_step.py``."""
    model_dir = save_tiny_model(str(tmp_path / "model"), architecture="qwen3_moe")
    stock, ours = stock_and_ours(
        tmp_path,
        model_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        token_budget=budget,
        async_step="samples",
    )
    assert stock.trainer.aux_loss_enabled and ours.trainer._dynbsz.capabilities.router_aux
    assert_equals(ours, stock.final)
    stock_aux = [entry["aux_loss"] for entry in stock.history if "aux_loss" in entry]
    assert len(stock_aux) == 3
    assert [entry["aux_loss"] for entry in ours.history if "aux_loss" in entry] == pytest.approx(stock_aux, rel=1e-5)
    if not budget:
        coef = stock.trainer.router_aux_loss_coef
        assert_equals(stock, reference(model_dir, router_aux_loss_coef=coef))
