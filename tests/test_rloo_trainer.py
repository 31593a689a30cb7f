"""DynamicBatchRLOOTrainer equals stock TRL RLOOTrainer, single process.

Each test trains stock ``trl.RLOOTrainer`` and ``DynamicBatchRLOOTrainer`` from the same saved tiny model and seed, with
a token budget small enough that every optimizer step is cut into passes unlike stock's fixed slices, and checks:
identical completions, and the same parameters afterwards (relative difference <= 1e-5, and the relative difference
of the *updates*, which is what would expose a mis-weighted sample). RLOO's options each get a run: ``beta`` in the
reward (reference log-probs by packed no-grad passes), ``num_iterations`` 2 (old log-probs by packed no-grad passes,
ratios that clip), the clipping bounds, truncation masks, normalised and clipped rewards, the MoE router aux loss.
The plugin's capabilities each get one too: shared prompts, both layouts, the budget from memory and an
out-of-memory pass, generation chunks, vision-language samples, LoRA. Multi-process runs (DDP, ZeRO-3, balancing,
sequence parallelism) are in ``tests/test_distributed_rloo.py``.
"""

from __future__ import annotations

import logging

import pytest
from trl import RLOOConfig, RLOOTrainer

from hf_dynbsz import DynamicBatchRLOOConfig, DynamicBatchRLOOTrainer
from hf_dynbsz.testing import (
    construction_arguments,
    construction_error,
    overridden_stock_methods,
    positional_trainer,
    relative_difference,
    run_training,
    save_tiny_model,
    signature_mismatches,
    switched_off_mismatches,
    update_difference,
)

# Forces repacking: prompts are 3-18 tokens, completions 0-24, so stock slices of 4 rows get cut up.
SMALL_BUDGET = 40
PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-3
#: The plugin's trainer and config (``run_training``'s first two arguments).
PLUGIN = (DynamicBatchRLOOTrainer, DynamicBatchRLOOConfig)
#: Settings only DynamicBatchRLOOConfig has.
OURS = (
    "max_tokens_per_microbatch",
    "packing_layout",
    "share_prompt_prefix",
    "self_check",
    "per_device_generation_batch_size",
    "max_memory_per_device_mib",
)
#: RLOO's loss metrics, logged per stock slice and averaged by the Trainer: ours must log stock's.
LOSS_METRICS = (
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
)


def compare_with_stock(model_dir, tmp_path, trainer_kwargs=None, **overrides):
    """Stock RLOOTrainer and ours on the same run: same completions, parameters and logged loss metrics."""
    ours_only = {key: overrides.pop(key) for key in list(overrides) if key in OURS}
    ours_only.setdefault("max_tokens_per_microbatch", SMALL_BUDGET)
    overrides.setdefault("beta", 0.0)
    init, stock, stock_completions, stock_history = run_training(
        RLOOTrainer, RLOOConfig, model_dir, str(tmp_path / "stock"), trainer_kwargs=trainer_kwargs, **overrides
    )
    init2, ours, our_completions, history = run_training(
        *PLUGIN, model_dir, str(tmp_path / "ours"), trainer_kwargs=trainer_kwargs, **overrides, **ours_only
    )
    assert our_completions == stock_completions, "generations must be identical for the same seed"
    assert relative_difference(init2, init) == 0.0
    if any("lora_" in name for name in stock):  # LoRA: the adapter's parameters (the base ones do not train)
        stock, ours = ({n: p for n, p in params.items() if "lora_" in n} for params in (stock, ours))
    else:
        assert update_difference(init, ours, stock) <= UPDATE_TOLERANCE
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == overrides.get("max_steps", 2)
    stock_steps = [entry for entry in stock_history if "entropy" in entry]
    for name in [*LOSS_METRICS, "aux_loss", "kl", "reward"]:
        stock_values = [entry[name] for entry in stock_steps if name in entry]
        assert [entry[name] for entry in steps if name in entry] == pytest.approx(stock_values, rel=1e-5, abs=1e-6)
    return steps


RLOO_OPTIONS = {
    "beta_zero": dict(beta=0.0),
    # reference log-probs (packed no-grad passes) in the reward; old log-probs (packed no-grad passes) and ratios
    # that move off 1 and clip in the second iteration
    "beta_and_two_iterations": dict(beta=0.1, num_iterations=2),
    "clipping_bounds_and_truncation_mask": dict(
        epsilon=0.1, epsilon_high=0.3, num_iterations=2, mask_truncated_completions=True, max_completion_length=8
    ),
    "normalised_and_clipped_rewards": dict(normalize_advantages=True, reward_clip_range=(-0.2, 0.3), beta=0.05),
    # generation_batch_size = 2 optimizer steps' worth: slices of one round feed two steps
    "a_round_spans_optimizer_steps": dict(generation_batch_size=16, max_steps=3, num_iterations=2),
}


@pytest.mark.parametrize("options", list(RLOO_OPTIONS))
def test_matches_stock(model_dir, tmp_path, options):
    steps = compare_with_stock(model_dir, tmp_path, **RLOO_OPTIONS[options])
    if RLOO_OPTIONS[options].get("num_iterations", 1) > 1:  # ratios off 1: the clip ratios compared are not all 0
        assert any(step["clip_ratio/region_mean"] > 0 for step in steps)


def test_a_prefix_tree_matches_stock(model_dir, tmp_path):
    """share_prompt_prefix="tree", trusted (no self-check): sampled completions from a 4-character alphabet begin
    alike across prompts, and RLOO's summed log-probs take each sample's terms from the positions it holds."""
    tree = dict(share_prompt_prefix="tree", self_check=False, max_tokens_per_microbatch=120)
    steps = compare_with_stock(model_dir, tmp_path, beta=0.1, num_iterations=2, **tree)
    assert any(step["dynbsz/tree_tokens_saved"] > 0 for step in steps)


def test_shared_prompts_really_happen_in_both_layouts(model_dir, tmp_path):
    shared = compare_with_stock(model_dir, tmp_path / "shared", beta=0.1, num_iterations=2)
    padded = compare_with_stock(model_dir, tmp_path / "padded", beta=0.1, num_iterations=2, packing_layout="padded")
    for step_shared, step_padded in zip(shared, padded):
        assert step_shared["dynbsz/shared_tokens_saved"] > 0 and step_padded["dynbsz/shared_tokens_saved"] == 0
        assert step_shared["dynbsz/padding_fraction"] == 0 < step_padded["dynbsz/padding_fraction"]
        assert step_shared["dynbsz/tokens_per_microbatch_max"] <= SMALL_BUDGET
        assert (
            step_shared["dynbsz/microbatches"] != 2
            or step_shared["dynbsz/computed_tokens"] < (step_shared["dynbsz/stock_computed_tokens"])
        )


def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    assert not switched_off_mismatches((RLOOTrainer, RLOOConfig), PLUGIN, model_dir, str(tmp_path))


def test_plain_rloo_config_is_accepted_and_environment_overrides_apply(model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "33")
    _, stock, _, _ = run_training(RLOOTrainer, RLOOConfig, model_dir, str(tmp_path / "a"))
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, ours, _, history = run_training(DynamicBatchRLOOTrainer, RLOOConfig, model_dir, str(tmp_path / "b"))
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    steps = [entry for entry in history if "dynbsz/budget_tokens" in entry]
    assert steps and all(step["dynbsz/budget_tokens"] == 33 for step in steps)
    assert "hf_dynbsz batch-size plan" in caplog.text and "DIFFU_MAX_TOKENS" in caplog.text


# ---- drop-in: stock's constructor and hook signatures ---------------------------------------------------------------
def test_constructor_and_overridden_hooks_have_stocks_signatures():
    overridden = set(overridden_stock_methods(DynamicBatchRLOOTrainer, RLOOTrainer))
    assert {"__init__", "training_step", "_get_per_token_logps_and_entropies", "_generate_single_turn"} <= overridden
    assert not signature_mismatches(DynamicBatchRLOOTrainer, RLOOTrainer)


@pytest.mark.parametrize("missing", ["reward_funcs", "train_dataset", "args"])
def test_construction_errors_are_stocks(model_dir, tmp_path, missing):
    kwargs = construction_arguments(RLOOConfig, str(tmp_path), missing)
    stock = construction_error(RLOOTrainer, model_dir, **kwargs)
    assert construction_error(DynamicBatchRLOOTrainer, model_dir, **kwargs) == stock


def test_stocks_positional_call_order_works(model_dir, tmp_path):
    trainer, args = positional_trainer(DynamicBatchRLOOTrainer, RLOOConfig, model_dir, str(tmp_path))
    assert trainer.args is args and trainer._dynbsz.enabled and args.max_tokens_per_microbatch is None


def test_one_process_cannot_form_a_sequence_parallel_group(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing import RecordingReward, base_config_kwargs, load_tokenizer, prompt_dataset

    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the 1 processes"):
        DynamicBatchRLOOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=RecordingReward(),
            args=DynamicBatchRLOOConfig(**base_config_kwargs(str(tmp_path), sequence_parallel_size=2)),
            processing_class=load_tokenizer(model_dir),
            train_dataset=prompt_dataset(),
        )


# ---- the plugin's capabilities ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("moe-model")), architecture="qwen3_moe")


def test_moe_router_aux_loss_is_repacked_and_matches_stock(moe_model_dir, tmp_path):
    """RLOO adds ``coef x aux`` of each slice unscaled (the Trainer divides by GA): per sample, from its slice's
    expert counts, and the logged aux_loss is stock's (compared in compare_with_stock)."""
    steps = compare_with_stock(moe_model_dir, tmp_path, router_aux_loss_coef=0.5, num_iterations=2)
    assert all("aux_loss" in step and step["dynbsz/microbatches"] >= 2 for step in steps)


def test_generation_is_chunked_and_deterministic_per_chunk_size(model_dir, tmp_path):
    generated_rows = []

    class Recording(DynamicBatchRLOOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.model.register_forward_pre_hook(  # rows of each generation forward (it has a KV cache)
                lambda module, args, kwargs: (
                    generated_rows.append(kwargs["input_ids"].size(0)) if kwargs.get("use_cache") is not False else None
                ),
                with_kwargs=True,
            )

    _, first, completions_a, _ = run_training(
        Recording, DynamicBatchRLOOConfig, model_dir, str(tmp_path / "a"), per_device_generation_batch_size=3
    )
    assert generated_rows and max(generated_rows) <= 3  # 8 samples per device: chunks of 3, 3, 2
    _, second, completions_b, _ = run_training(
        *PLUGIN, model_dir, str(tmp_path / "b"), per_device_generation_batch_size=3
    )
    assert completions_a == completions_b and relative_difference(first, second) == 0.0


def test_the_budget_from_memory_and_an_out_of_memory_pass_match_stock(model_dir, tmp_path):
    from hf_dynbsz.execution.device_memory import inject_out_of_memory

    inject_out_of_memory("training", "backward", 1)
    steps = compare_with_stock(model_dir, tmp_path, beta=0.1, num_iterations=2, max_memory_per_device_mib=100_000)
    assert sum(step["dynbsz/oom_retries"] for step in steps) == 1
    assert all(step["dynbsz/predicted_peak_memory_mib"] > 0 for step in steps)


def test_lora_with_the_reference_as_the_disabled_adapter_matches_stock(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    steps = compare_with_stock(model_dir, tmp_path, trainer_kwargs={"peft_config": lora}, beta=0.1, num_iterations=2)
    assert any(step["dynbsz/shared_tokens_saved"] > 0 for step in steps)


# ---- vision-language samples ------------------------------------------------------------------------------------
def train_vision(trainer_cls, config_cls, tmp_path, **overrides):
    from hf_dynbsz.testing import (
        RecordingReward,
        base_config_kwargs,
        build_tiny_vision_language_model,
        image_prompt_dataset,
    )

    model, processor = build_tiny_vision_language_model("qwen2_vl")
    model.save_pretrained(tmp_path / "model")  # TRL loads the reference model from the policy's directory
    reward = RecordingReward()
    settings = dict(shuffle_dataset=False, max_steps=2, max_completion_length=16, beta=0.1, num_iterations=2)
    trainer = trainer_cls(
        model=str(tmp_path / "model"),
        reward_funcs=reward,
        args=config_cls(**base_config_kwargs(str(tmp_path / "run"), learning_rate=0.05, **settings, **overrides)),
        train_dataset=image_prompt_dataset([1, 2, 2, 1, 1, 1, 2, 1]),
        processing_class=processor,
    )
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked", "unrepacked_family"])
def test_generated_image_prompts_match_stock(tmp_path, monkeypatch, repacked):
    """Qwen2-VL with its own generations and a reference model; a family outside the repacked ones keeps stock's
    slices for its image steps (stock's loss, divided by GA as the Trainer divides it)."""
    from hf_dynbsz.planning import model_support

    if not repacked:
        monkeypatch.setattr(model_support, "REPACKED_VISION_MODEL_TYPES", ())
    initial, stock, stock_completions, _ = train_vision(RLOOTrainer, RLOOConfig, tmp_path / "stock")
    _, ours, completions, history = train_vision(
        DynamicBatchRLOOTrainer, DynamicBatchRLOOConfig, tmp_path / "ours", max_tokens_per_microbatch=100
    )
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert update_difference(initial, ours, stock) <= UPDATE_TOLERANCE
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == (2 if repacked else 0)
    assert all(step["dynbsz/shared_tokens_saved"] > 0 for step in steps)
    assert relative_difference(stock, initial) > 1e-4  # it trained


# ---- a subset of the model zoo ----------------------------------------------------------------------------------
#: One architecture of each kind the layouts tell apart (tests/test_model_zoo.py trains every one with GRPO): plain
#: attention, sliding windows with soft-capping (eager), multi-head latent attention with MoE, a hybrid with Gated
#: DeltaNet layers (segment recurrence), an MoE with attention sinks and TRL's router aux loss.
RLOO_ZOO = ("llama", "gemma2", "deepseek_v3", "qwen3_5_text", "gpt_oss")


@pytest.mark.parametrize("model_type", RLOO_ZOO)
def test_zoo_architecture_trains_as_stock(model_type, tmp_path):
    """Tiny models built from their default configs, generating their own completions (up to 24 tokens, prompts of
    3-18), two optimizer steps of two iterations (old log-probs, clipped ratios)."""
    import torch

    from hf_dynbsz.testing import (
        RecordingReward,
        base_config_kwargs,
        build_char_tokenizer,
        checkpointing_field,
        prompt_dataset,
    )
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    results, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is many times faster than two on a loaded 2-core machine
    try:
        for trainer_cls, config_cls in ((RLOOTrainer, RLOOConfig), (DynamicBatchRLOOTrainer, DynamicBatchRLOOConfig)):
            model = build_tiny_causal_lm_of_type(model_type, seed=0)
            overrides = {} if model.supports_gradient_checkpointing else {checkpointing_field(): False}
            reward = RecordingReward()
            trainer = trainer_cls(
                model=model,
                reward_funcs=reward,
                args=config_cls(
                    **base_config_kwargs(str(tmp_path / trainer_cls.__name__), beta=0.0, num_iterations=2, **overrides)
                ),
                train_dataset=prompt_dataset(alphabet="abcdefgh"),
                processing_class=build_char_tokenizer(),
            )
            trainer.train()
            params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
            results.append((params, reward.completions, trainer))
    finally:
        torch.set_num_threads(threads)
    (stock, stock_completions, _), (ours, completions, trainer) = results
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert trainer._dynbsz.enabled and any("dynbsz/microbatches" in entry for entry in trainer.state.log_history)
