"""DynamicBatchGRPOTrainer equals stock TRL GRPOTrainer, single process.

Each test trains stock ``trl.GRPOTrainer`` and ``DynamicBatchGRPOTrainer`` from the same saved tiny model
and seed, with a token budget small enough that every optimizer step is cut into micro-batches unlike
stock's fixed slices, and checks: identical completions, and the same parameters afterwards. Parameters
are compared two ways: relative difference of the parameters (<= 1e-5, the requirement) and relative
difference of the parameter *updates*, which is what would expose a mis-weighted sample. Every metric stock logs
(the loss metrics ``entropy``, ``kl``, the clip ratios, ``cispo_clip_ratio``, ``vespo/phi_seq_mean`` among them,
which stock computes per fixed slice) is logged with stock's value within 1e-5 (relative), step by step.
"""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer, OversizeSequenceError
from hf_dynbsz.testing import (
    PREFIX_STRUCTURES,
    checkpointing_field,
    comparison_prefix_rollout,
    construction_arguments,
    construction_error,
    logged_metrics,
    metric_mismatches,
    overridden_stock_methods,
    positional_trainer,
    relative_difference,
    run_training,
    save_tiny_model,
    signature_mismatches,
    switched_off_mismatches,
    update_difference,
)

#: The plugin's trainer and config (``run_training``'s first two arguments).
PLUGIN = (DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig)
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo"]
# Forces repacking: prompts are 3-18 tokens, completions 0-24, so stock slices of 4 rows get cut up.
SMALL_BUDGET = 40
PARAM_TOLERANCE = 1e-5
CHECKPOINTING = checkpointing_field()  # transformers 5 renamed gradient_checkpointing to activation_checkpointing
UPDATE_TOLERANCE = 1e-3
METRIC_TOLERANCE = 1e-5  # relative, every logged metric (absolute: 1e-6)


def compare_with_stock(model_dir, tmp_path, repacked_steps=None, trainer_kwargs=lambda: None, **overrides):
    """Stock and ours from the same model; ours's parameters within the tolerances of stock's, every logged metric
    stock's (timings and the plugin's ``dynbsz/*`` aside). ``repacked_steps``: the steps ours repacks (default: all of
    them); ``trainer_kwargs()``: each run's own constructor arguments."""
    dyn_overrides = {
        key: overrides.pop(key)
        for key in list(overrides)
        if key
        in (
            "max_tokens_per_microbatch",
            "packing_layout",
            "max_tokens_per_microbatch_logprob",
            "oversize_policy",
            "share_prompt_prefix",
            "self_check",
        )
    }
    dyn_overrides.setdefault("max_tokens_per_microbatch", SMALL_BUDGET)
    init, stock, stock_completions, stock_history = run_training(
        GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "stock"), trainer_kwargs=trainer_kwargs(), **overrides
    )
    init2, ours, our_completions, history = run_training(
        *PLUGIN, model_dir, str(tmp_path / "ours"), trainer_kwargs=trainer_kwargs(), **overrides, **dyn_overrides
    )
    assert our_completions == stock_completions, "generations must be identical for the same seed"
    assert relative_difference(init2, init) == 0.0
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert update_difference(init, ours, stock) <= UPDATE_TOLERANCE
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history), rel=METRIC_TOLERANCE)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == (repacked_steps or overrides.get("max_steps", 2))
    return history


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_stock_without_kl(model_dir, tmp_path, loss_type):
    # steps_per_generation == gradient_accumulation_steps: old log-probs are the current ones (TRL skips them)
    compare_with_stock(model_dir, tmp_path, loss_type=loss_type, beta=0.0, num_iterations=1)


# luspo sums its loss over tokens instead of averaging, so its gradients are ~10x the others' (grad norm ~40 at
# step 3): at the common learning rate of 0.5 this run is chaotic, and stock against stock with the initial
# parameters perturbed by 1e-7 (relative) already ends 1.1e-5 apart. At 0.1 that noise floor is 1e-7 again.
CHAOS_FREE_LEARNING_RATE = {"luspo": 0.1}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_stock_with_kl_and_two_iterations(model_dir, tmp_path, loss_type):
    # beta > 0: reference log-probs (packed no-grad passes) from the model loaded by path;
    # num_iterations=2: old-policy log-probs (packed no-grad passes) and a PPO ratio that moves off 1.
    compare_with_stock(
        model_dir,
        tmp_path,
        loss_type=loss_type,
        beta=0.1,
        num_iterations=2,
        max_steps=3,
        learning_rate=CHAOS_FREE_LEARNING_RATE.get(loss_type, 0.5),
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_matches_stock_when_a_round_spans_optimizer_steps(model_dir, tmp_path, loss_type):
    # generation_batch_size = 2 optimizer steps' worth: slices of one round feed two steps
    compare_with_stock(model_dir, tmp_path, loss_type=loss_type, generation_batch_size=16, max_steps=3)


@pytest.mark.parametrize("layout", ["padding_free", "padded"])
def test_matches_stock_in_both_layouts(model_dir, tmp_path, layout):
    compare_with_stock(model_dir, tmp_path, loss_type="bnpo", beta=0.05, packing_layout=layout, num_iterations=2)


#: The plugin's settings of the prefix-tree runs: the tree, kept by the self-check (a run that stepped down to prompt
#: groups logs no tree_tokens_saved), a budget a step's tree fits in.
TREE = dict(share_prompt_prefix="tree", max_tokens_per_microbatch=160)


@pytest.mark.parametrize("structure", PREFIX_STRUCTURES)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_a_prefix_tree_matches_stock(model_dir, tmp_path, structure, loss_type):
    """share_prompt_prefix="tree", kept by the self-check on these samples: shared blocks across prompts and shared
    trunks and branches of completions (loss terms of several samples at one position) give stock's parameters,
    old-policy and reference passes included."""
    rollout = lambda: {"rollout_func": comparison_prefix_rollout(structure)}  # noqa: E731 - one per run
    history = compare_with_stock(
        model_dir, tmp_path, trainer_kwargs=rollout, loss_type=loss_type, beta=0.05, num_iterations=2, **TREE
    )
    assert all(saved > 0 for saved in tree_tokens_saved(history))  # beyond what prompt groups share


#: What a statistic over sample-tokens reads: top_entropy_quantile's quantile, the entropy bonus and its metric, clip
#: ratios, the loss normalisers (dapo's and grpo's); sequence-level importance sampling's mean log-ratio per sample.
STATISTICS = {
    "dapo, top_entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.4, entropy_coef=0.02),
    "grpo, top_entropy_quantile": dict(loss_type="grpo", top_entropy_quantile=0.4, entropy_coef=0.02),
    "grpo, sequence importance sampling": dict(loss_type="grpo", importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("statistics", STATISTICS)
def test_a_prefix_tree_counts_a_shared_token_once_per_sample_in_every_statistic(model_dir, tmp_path, statistics):
    """A trunk's positions are loss terms of every sample holding them: every statistic over sample-tokens counts
    each once per sample, as stock's separate sequences do (the second iteration's ratios move off 1 and clip)."""
    statistics = dict(STATISTICS[statistics], num_iterations=2)
    history = compare_with_stock(
        model_dir, tmp_path, trainer_kwargs=lambda: {"rollout_func": comparison_prefix_rollout("tree rollout")},
        **statistics, **TREE,
    )  # fmt: skip
    assert all(saved > 0 for saved in tree_tokens_saved(history))  # the trunks shared: the tree ran, not groups


def tree_tokens_saved(history: list[dict]) -> list[float]:
    """Per repacked step of ``history``, the tokens the prefix tree saved beyond prompt groups (0 where the run
    logged none: sharing by prompt groups, after a step-down or from the start)."""
    return [entry.get("dynbsz/tree_tokens_saved", 0) for entry in history if "dynbsz/microbatches" in entry]


def test_a_prefix_tree_of_sampled_completions_matches_stock(model_dir, tmp_path):
    """Completions the model samples from a 4-character alphabet often begin alike, across prompts too: the tree
    shares those positions, and training still equals stock."""
    history = compare_with_stock(
        model_dir, tmp_path, share_prompt_prefix="tree", self_check=False, loss_type="dapo", beta=0.05, num_iterations=2
    )
    assert any(saved > 0 for saved in tree_tokens_saved(history))  # completions that begin alike, shared


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_padded_span_calls_match_stock(model_dir, tmp_path, monkeypatch, loss_type):
    """Segment attention's padded calls (spans of several shapes sharing a call, as on CUDA) forced on this CPU: the
    run with shared prompts and old-policy passes still equals stock."""
    from hf_dynbsz.execution import attention

    monkeypatch.setitem(attention.SPAN_CALLS_PER_LAYER, "cpu", 2)
    calls, build = [], attention.SegmentLayout._build_span_calls

    def recording(layout, device, max_calls):  # the real build, its calls kept for the checks below
        built = build(layout, device, max_calls)
        calls.append(built[0])
        return built

    monkeypatch.setattr(attention.SegmentLayout, "_build_span_calls", recording)
    history = compare_with_stock(model_dir, tmp_path, loss_type=loss_type, beta=0.05, num_iterations=2)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert all(step["dynbsz/shared_tokens_saved"] > 0 for step in steps)  # the self-check kept shared prompts
    assert calls and all(len(layer_calls) <= 2 for layer_calls in calls)
    assert any(call.padded for layer_calls in calls for call in layer_calls)  # spans of several shapes did share


def test_matches_stock_with_sequence_importance_sampling_and_truncation_mask(model_dir, tmp_path):
    compare_with_stock(
        model_dir,
        tmp_path,
        loss_type="grpo",
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
        max_completion_length=8,
        num_iterations=2,
    )


def test_matches_stock_with_entropy_bonus_and_off_policy_mask(model_dir, tmp_path):
    compare_with_stock(
        model_dir,
        tmp_path,
        loss_type="dr_grpo",
        entropy_coef=0.01,
        off_policy_mask_threshold=0.0,
        num_iterations=2,
        delta=1.5,
    )


def test_matches_stock_with_pad_to_multiple_of_and_odd_accumulation(model_dir, tmp_path):
    compare_with_stock(
        model_dir,
        tmp_path,
        loss_type="bnpo",
        pad_to_multiple_of=8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_generations=3,
        max_tokens_per_microbatch=48,
    )


def test_one_sequence_per_budget_still_matches(model_dir, tmp_path):
    # A budget below most sequences: each gets a micro-batch of its own (oversize_policy="warn").
    with pytest.warns(UserWarning, match="micro-batch of their own"):
        compare_with_stock(model_dir, tmp_path, loss_type="grpo", max_tokens_per_microbatch=8)


def test_repacking_really_happens_and_is_logged(model_dir, tmp_path):
    # the padded layout: what "auto" resolved to on sdpa before segment attention made padding-free rows cheap there
    history = compare_with_stock(model_dir, tmp_path, loss_type="dapo", packing_layout="padded")
    step = next(entry for entry in history if "dynbsz/microbatches" in entry)
    assert step["dynbsz/tokens_per_microbatch_max"] <= SMALL_BUDGET
    assert step["dynbsz/microbatches"] != 2  # stock would run 2 fixed slices per step
    assert 0.0 <= step["dynbsz/padding_fraction"] < 1.0
    assert step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"]
    for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_max", "step_time"):
        assert key in step


def test_shared_prompts_really_happen_and_match_stock(model_dir, tmp_path):
    # auto = padding-free rows through segment attention on sdpa; each prompt's 4 completions share it
    shared = compare_with_stock(model_dir, tmp_path / "shared", loss_type="dapo", beta=0.1, num_iterations=2)
    alone = compare_with_stock(
        model_dir, tmp_path / "alone", loss_type="dapo", beta=0.1, num_iterations=2, share_prompt_prefix=False
    )
    for step_shared, step_alone in zip(*[[e for e in h if "dynbsz/microbatches" in e] for h in (shared, alone)]):
        assert step_shared["dynbsz/shared_tokens_saved"] > 0 and step_alone["dynbsz/shared_tokens_saved"] == 0
        assert step_shared["dynbsz/computed_tokens"] < step_alone["dynbsz/computed_tokens"]
        assert step_shared["dynbsz/tokens_per_microbatch_max"] <= SMALL_BUDGET


def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    assert not switched_off_mismatches((GRPOTrainer, GRPOConfig), PLUGIN, model_dir, str(tmp_path))


def test_plain_grpo_config_is_accepted(model_dir, tmp_path):
    init, stock, _, _ = run_training(GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "a"), loss_type="bnpo")
    _, ours, _, history = run_training(
        DynamicBatchGRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "b"), loss_type="bnpo"
    )
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert any("dynbsz/microbatches" in entry for entry in history)


def test_oversize_error_policy_raises_before_any_update(model_dir, tmp_path):
    with pytest.raises(OversizeSequenceError, match="max_tokens_per_microbatch=4"):
        run_training(*PLUGIN, model_dir, str(tmp_path / "b"), max_tokens_per_microbatch=4, oversize_policy="error")


# ---------------------------------------------------------------- memory knobs reach the code paths
def record_backbone_calls(trainer_cls):
    """A subclass recording, per backbone forward: batch rows, whether it is a generation forward (with a KV
    cache; log-prob passes run through TRL's fused head with use_cache=False), TRL's token tile size at call
    time and whether gradients are on (all read inside the real forward, not from the config)."""
    import trl.kernels.chunked_logprob as kernel

    calls = []

    class Recording(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            backbone = self.model.model

            def hook(module, args, kwargs):
                ids = kwargs.get("input_ids", args[0] if args else None)
                generating = kwargs.get("use_cache") is not False
                calls.append((ids.shape[0], generating, kernel.TOKEN_CHUNK_SIZE, torch.is_grad_enabled()))

            backbone.register_forward_pre_hook(hook, with_kwargs=True)

    return Recording, calls


def test_generation_is_chunked_and_deterministic_per_chunk_size(model_dir, tmp_path):
    Recording, calls = record_backbone_calls(DynamicBatchGRPOTrainer)
    _, first, completions_a, _ = run_training(
        Recording, DynamicBatchGRPOConfig, model_dir, str(tmp_path / "a"), per_device_generation_batch_size=3
    )
    generate_rows = {rows for rows, generating, _, _ in calls if generating}
    assert generate_rows and max(generate_rows) <= 3  # 8 samples per device -> chunks of 3, 3, 2
    _, second, completions_b, _ = run_training(
        *PLUGIN, model_dir, str(tmp_path / "b"), per_device_generation_batch_size=3
    )
    assert completions_a == completions_b
    assert relative_difference(first, second) == 0.0


def test_generation_chunk_at_least_the_share_is_stock(model_dir, tmp_path):
    _, stock, stock_completions, _ = run_training(GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "a"))
    _, ours, our_completions, _ = run_training(
        *PLUGIN,
        model_dir,
        str(tmp_path / "b"),
        per_device_generation_batch_size=8,
        max_tokens_per_microbatch=SMALL_BUDGET,
    )
    assert our_completions == stock_completions
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE


def test_diffu_variables_reach_the_code_paths(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "5")
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "2")
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "33")
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "2")
    Recording, calls = record_backbone_calls(DynamicBatchGRPOTrainer)
    # arguments say otherwise; the environment wins
    _, _, completions, history = run_training(
        Recording,
        GRPOConfig,
        model_dir,
        str(tmp_path / "a"),
        per_device_train_batch_size=4,
        max_steps=1,
    )
    packed_tiles = {tile for _, generating, tile, _ in calls if not generating}  # training/log-prob passes
    assert packed_tiles == {5}
    generate_rows = {rows for rows, generating, _, _ in calls if generating}
    assert max(generate_rows) <= 2
    step = next(entry for entry in history if "dynbsz/budget_tokens" in entry)
    assert step["dynbsz/budget_tokens"] == 33
    assert len(completions) == 2 * 2  # per_device_train_batch_size=2 x gradient_accumulation_steps=2


def test_tensor_batch_size_tiles_training_and_matches_stock(model_dir, tmp_path):
    compare_with_stock(model_dir, tmp_path, loss_type="dapo", beta=0.1, num_iterations=2)  # default tile: 1024
    Recording, calls = record_backbone_calls(DynamicBatchGRPOTrainer)
    run_training(Recording, DynamicBatchGRPOConfig, model_dir, str(tmp_path / "c"), tensor_batch_size=3, max_steps=1)
    assert {tile for _, _, tile, grad in calls if grad} == {3}


# ---------------------------------------------------------------- entropy-dependent features
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_matches_stock_with_top_entropy_quantile(model_dir, tmp_path, loss_type):
    # stock takes the quantile per fixed slice across ranks; we reproduce it from a no-grad entropy pass
    compare_with_stock(
        model_dir, tmp_path, loss_type=loss_type, top_entropy_quantile=0.4, entropy_coef=0.02, num_iterations=2
    )


def test_matches_stock_with_adaptive_entropy_controller(model_dir, tmp_path):
    history = compare_with_stock(
        model_dir,
        tmp_path,
        loss_type="dr_grpo",
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=10.0,
        entropy_coef_delta=0.005,
        max_steps=3,
    )
    steps = [entry for entry in history if "entropy_coef" in entry]
    assert [round(step["entropy_coef"], 6) for step in steps] == [0.015, 0.02, 0.025]  # entropy < target: grows


# ---------------------------------------------------------------- drop-in: stock's constructor and hook signatures
def test_constructor_and_overridden_hooks_have_stocks_signatures():
    overridden = overridden_stock_methods(DynamicBatchGRPOTrainer, GRPOTrainer)
    assert {"__init__", "training_step", "_get_per_token_logps_and_entropies", "_generate_single_turn"} <= set(
        overridden
    )
    assert not signature_mismatches(DynamicBatchGRPOTrainer, GRPOTrainer)


@pytest.mark.parametrize("missing", ["reward_funcs", "train_dataset", "args"])
def test_construction_errors_are_stocks(model_dir, tmp_path, missing):
    kwargs = construction_arguments(GRPOConfig, str(tmp_path), missing)
    stock = construction_error(GRPOTrainer, model_dir, **kwargs)
    assert construction_error(DynamicBatchGRPOTrainer, model_dir, **kwargs) == stock
    assert stock[0] is ValueError
    if missing == "reward_funcs":
        assert "No reward source provided" in stock[1]


def test_stocks_positional_call_order_works(model_dir, tmp_path):
    from hf_dynbsz.testing import RecordingReward, prompt_dataset

    trainer, args = positional_trainer(DynamicBatchGRPOTrainer, GRPOConfig, model_dir, str(tmp_path))
    assert trainer.args is args and trainer._dynbsz.enabled
    assert args.max_tokens_per_microbatch is None  # the plain GRPOConfig got the plugin's fields
    with pytest.raises(TypeError):
        DynamicBatchGRPOTrainer(
            trainer.model,
            RecordingReward(),
            args,
            prompt_dataset(),
            None,
            None,
            None,
            None,
            (None, None),
            None,
            None,
            None,
            None,
            None,
            "one too many",
        )


# ---------------------------------------------------------------- gradient checkpointing off, PEFT LoRA
def test_matches_stock_without_gradient_checkpointing(model_dir, tmp_path):
    # TRL turns activation checkpointing on by default; segment attention must be exact without recomputation too
    compare_with_stock(model_dir, tmp_path, loss_type="grpo", beta=0.1, num_iterations=2, **{CHECKPOINTING: False})


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_matches_stock_with_peft_lora(model_dir, tmp_path, loss_type):
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)

    # beta > 0: the reference model is the base model with the adapter disabled (TRL's PEFT path)
    overrides = dict(loss_type=loss_type, beta=0.1, num_iterations=2)
    init, stock, stock_completions, stock_history = run_training(
        GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "stock"), trainer_kwargs={"peft_config": lora()}, **overrides
    )
    _, ours, completions, history = run_training(
        *PLUGIN,
        model_dir,
        str(tmp_path / "ours"),
        trainer_kwargs={"peft_config": lora()},
        max_tokens_per_microbatch=SMALL_BUDGET,
        **overrides,
    )
    assert completions == stock_completions
    lora_names = [name for name in stock if "lora_" in name]
    assert lora_names and set(lora_names) == {name for name in ours if "lora_" in name}
    assert any(stock[n].abs().sum() > 0 for n in lora_names if "lora_B" in n)  # LoRA B starts at zero: it trained
    assert relative_difference({n: ours[n] for n in lora_names}, {n: stock[n] for n in lora_names}) <= PARAM_TOLERANCE
    assert any(entry.get("dynbsz/shared_tokens_saved", 0) > 0 for entry in history)  # shared prompts under PEFT


# ---- hybrid models: layers that carry state along a sequence (Gated DeltaNet) ----------------------------------


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("hybrid-model")), architecture="qwen3_next")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_hybrid_model_trains_padding_free_with_shared_prompts_and_matches_stock(hybrid_model_dir, tmp_path, loss_type):
    # Its Gated DeltaNet layers run per sequence of the row (segment recurrence), each completion from its prompt's
    # final state: padding-free rows with shared prompts, equal to stock's per-sample padded forward.
    history = compare_with_stock(
        hybrid_model_dir, tmp_path, loss_type=loss_type, beta=0.1, num_iterations=2, router_aux_loss_coef=0.0
    )
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert steps and all(entry["dynbsz/padding_fraction"] == 0 for entry in steps)  # padding-free rows
    assert any(entry["dynbsz/shared_tokens_saved"] > 0 for entry in steps)  # shared prompts


# ---- mixture-of-experts models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("moe-model")), architecture="qwen3_moe")


def test_moe_model_without_router_aux_loss_is_repacked_and_matches_stock(moe_model_dir, tmp_path):
    history = compare_with_stock(
        moe_model_dir, tmp_path, loss_type="dapo", beta=0.1, router_aux_loss_coef=0.0, max_tokens_per_microbatch=24
    )
    assert any(entry.get("dynbsz/microbatches", 0) > 2 for entry in history)


def test_moe_router_aux_loss_is_repacked_and_matches_stock(moe_model_dir, tmp_path):
    # The aux loss of each stock micro-batch, per sample, from its expert counts (tests/test_router_loss.py has more).
    history = compare_with_stock(moe_model_dir, tmp_path, loss_type="dapo", router_aux_loss_coef=0.5)
    assert any("aux_loss" in entry for entry in history)
    assert all(entry.get("dynbsz/microbatches", 0) >= 2 for entry in history if "dynbsz/microbatches" in entry)


# ---- long runs ---------------------------------------------------------------------------------------------------
def footprint(value, seen=None) -> int:
    """Elements held by ``value``, counted through containers and objects' attributes (shared objects once)."""
    from transformers import Trainer

    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return 0
    if isinstance(value, Trainer):  # the executor's back-reference: TRL's own state (its log history) is stock's
        return 0
    seen.add(id(value))
    if isinstance(value, dict):
        return len(value) + sum(footprint(item, seen) for pair in value.items() for item in pair)
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) + sum(footprint(item, seen) for item in value)
    if hasattr(value, "__dict__") and type(value).__module__.startswith("hf_dynbsz"):
        return footprint(vars(value), seen)
    return 0


def test_nothing_the_trainer_keeps_grows_with_the_steps(model_dir, tmp_path):
    """Everything the plugin keeps on the trainer (its _dynbsz_* state, and what that references), after 3 and after
    9 optimizer steps: the same size, so a long run cannot accumulate it (the automatic budget: no oversize warning
    to remember on one run and not the other)."""
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing import RecordingReward, base_config_kwargs, load_tokenizer, prompt_dataset

    sizes = []
    for steps in (3, 9):
        args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path / str(steps)), max_steps=steps))
        trainer = DynamicBatchGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=RecordingReward(),
            args=args,
            train_dataset=prompt_dataset(64),
            processing_class=load_tokenizer(model_dir),
        )
        trainer.train()
        state = {name: value for name, value in vars(trainer).items() if name.startswith("_dynbsz")}
        sizes.append(footprint(state))
    assert sizes[0] == sizes[1] > 0, sizes


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_varlen_attn_rows_match_stock(model_dir, tmp_path, monkeypatch, loss_type):
    """The run a capable GPU gets on sdpa (torch's varlen_attn, one call per layer; shared prompts gathered in front
    of each completion), on this CPU with the reference kernel of varlen_attn's contract standing in for torch's:
    shared prompts, old-policy and reference passes, parameters after training equal stock's."""
    from hf_dynbsz.testing import varlen_attn_standin

    calls = varlen_attn_standin(monkeypatch)
    history = compare_with_stock(model_dir, tmp_path, loss_type=loss_type, beta=0.05, num_iterations=2)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert all(step["dynbsz/shared_tokens_saved"] > 0 for step in steps)  # the self-check kept shared prompts
    assert calls and all(call["enable_gqa"] and call["window_size"] == (-1, 0) for call in calls)


class _LabelClock:
    """A pass takes the seconds its layout's name says (the layout timing's clock, faked)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.per_pass, self.labels = seconds, []

    def start(self, label):
        self.labels.append(label)
        return label

    def stop(self, token) -> None:
        pass

    def seconds(self, token) -> float:
        return self.per_pass[token]


@pytest.mark.parametrize("winner", ["padded", "stock"])
def test_the_measured_layout_choice_matches_stock(model_dir, tmp_path, monkeypatch, caplog, winner):
    """The layout timing of a GPU run on this CPU (a fake clock: padded rows 100x faster a pass than the sdpa spans):
    from the second step some passes run padded, the others padding-free, and after the choice
    the run keeps padded rows (or, when stock's slices are predicted fastest, turns dynamic batching off); the
    parameters after training equal stock's either way."""
    from hf_dynbsz.execution import device_pass, executor, layout_timing, self_check

    monkeypatch.setattr(layout_timing, "MEASURED_DEVICE_TYPES", ["cuda", "cpu"])
    monkeypatch.setattr(self_check, "MEASURED_DEVICE_TYPES", ["cuda", "cpu"])
    clock = _LabelClock({"spans": 1.0, "padded": 0.01})
    monkeypatch.setattr(self_check, "pass_clock", lambda device: clock)
    built_layouts, build, finish = [], device_pass.build_microbatch, executor.PassExecutor._finish_layout_timing

    def recording(*args, **kwargs):  # the layout of every training pass (with gradients), and where the choice is
        if torch.is_grad_enabled():
            built_layouts.append(kwargs["layout"])
        return build(*args, **kwargs)

    def finishing(self, *args):
        finish(self, *args)
        if self.layout_timing.decision is not None and "step end" not in built_layouts:
            built_layouts.append("step end")

    monkeypatch.setattr(device_pass, "build_microbatch", recording)
    monkeypatch.setattr(executor.PassExecutor, "_finish_layout_timing", finishing)
    if winner == "stock":
        decide = layout_timing.LayoutTiming._decide

        def stock_wins(self, step_units, stock):
            decide(self, step_units, stock)
            self.decision["chosen"] = "stock"
            return None

        monkeypatch.setattr(layout_timing.LayoutTiming, "_decide", stock_wins)
    with caplog.at_level("INFO", logger="hf_dynbsz"):
        history = compare_with_stock(
            model_dir, tmp_path, 2 if winner == "stock" else None, loss_type="dapo", beta=0.05, num_iterations=2,
            max_steps=4,
            max_tokens_per_microbatch=45, share_prompt_prefix=False,  # passes of a few samples: padded ones fit
        )  # fmt: skip
    assert "layout timing: spans, padded pass the self-check" in caplog.text
    assert {"spans", "padded"} <= set(clock.labels)  # both ran timed passes
    steps = [entry for entry in history if "dynbsz/microbatches" in entry or "loss" in entry]
    decided = [i for i, step in enumerate(steps) if "dynbsz/layout_timing_overhead_seconds" in step]
    assert len(decided) == 1 and decided[0] >= 1  # chosen after a measuring step, published once
    assert {"padding_free", "padded"} <= set(built_layouts[: built_layouts.index("step end")])  # a pass padded
    assert (
        steps[decided[0]]["dynbsz/layout_predicted_seconds/padded"]
        < steps[decided[0]]["dynbsz/layout_predicted_seconds/spans"]
    )
    after = steps[decided[0] + 1 :]
    if winner == "padded":
        assert "keeps padded" in caplog.text
        assert after and set(built_layouts[built_layouts.index("step end") + 1 :]) == {"padded"}
    else:
        assert after and not any("dynbsz/microbatches" in step for step in after)  # stock's own steps
