"""DynamicBatchDPOTrainer equals stock TRL DPOTrainer, single process.

Each comparison trains stock ``trl.DPOTrainer`` and ``DynamicBatchDPOTrainer`` on the same preference pairs from the
same saved tiny model (by path: stock's own default reference, a second copy loaded from the path), with a token
budget small enough that every optimizer step (2 micro-batches of 4 pairs) is cut into passes unlike stock's, and
checks: the same parameters afterwards (relative difference <= 1e-5), the same *updates* (relative difference <= 1e-3,
which is what exposes a mis-weighted pair), and every metric stock logs (``loss``, ``rewards/*``, ``logps/*``,
``logits/*``, ``entropy``, ``mean_token_accuracy``, ``num_tokens``, ``aux_loss``, ...) equal, entry by entry.

Every loss type of TRL 1.16 gets a run, and so do loss lists with weights, ``ld_alpha``, ``use_weighting``, the
f-divergences, label smoothing, precomputed reference log-probs, ``sync_ref_model``, truncation, gradient
accumulation of 1 and 4 micro-batches with a last one smaller, LoRA (the adapter-disabled reference), the padded
layout, a system block common to every prompt (the prefix tree computes it once per pass: asserted), several pairs per
prompt in a budget that cuts a prompt's subtree (pairs stay whole), and pairs whose prompts and responses have very
different lengths. Model families from their configs' defaults (MoE with its router aux loss, a hybrid with linear
attention, sliding windows) are in the family tests below. Multi-process runs are in
``tests/test_distributed_dpo.py``; TRL's own DPO tests, restated offline, in ``tests/test_dpo_trl_suite.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from trl import DPOConfig, DPOTrainer

from hf_dynbsz import DynamicBatchDPOConfig, DynamicBatchDPOTrainer
from hf_dynbsz.testing import (
    DPO_LOSS_SETTINGS,
    DPO_PLUGIN_FIELDS,
    dpo_run,
    logged_metrics,
    metric_mismatches,
    preference_pairs,
    relative_difference,
    runs_against_stock,
    save_tiny_model,
    signature_mismatches,
    spread_positions_collator,
)

#: Pairs of 3-20 prompt tokens and 1-25 response tokens: a pair is 5-70 unique tokens, so passes of 80 hold one to a few
#: pairs, where stock's micro-batches hold 4 (8 rows padded to the longest).
SMALL_BUDGET = 80
PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-3


def compare_with_stock(model_dir, tmp_path, dataset=None, *, trained=True, trainer_kwargs=None, **fields):
    """Stock DPOTrainer and ours on the same pairs: same parameters, updates and logged metrics; returns our logged
    steps (the entries with the plugin's figures) and our trainer."""
    history, stock_history, trainer = runs_against_stock(
        dpo_run, model_dir, tmp_path, dataset, fields, plugin_fields=DPO_PLUGIN_FIELDS, budget=SMALL_BUDGET,
        trainer_kwargs=trainer_kwargs, param_tolerance=PARAM_TOLERANCE, update_tolerance=UPDATE_TOLERANCE,
        trained_by=1e-6 if trained else None,
    )  # fmt: skip
    assert not logged_mismatches(history, stock_history)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == fields.get("max_steps", 2)
    return steps, trainer


def logged_mismatches(history: list[dict], stock_history: list[dict]) -> list[str]:
    """Where our logged metrics differ from stock's (:func:`~hf_dynbsz.testing.metric_mismatches`), but for
    ``rewards/accuracies`` at a step whose rewards are 0 within float noise (the policy is the reference: the first
    step): the count of pairs whose chosen reward beats the rejected one's is then a count of float noise (stock's
    reference and policy forwards of the same padded rows, ours of different passes), so a tie may count either way;
    there the rewards must be 0 within 1e-6 on both sides."""
    ours, stock = logged_metrics(history), logged_metrics(stock_history)
    for our_entry, stock_entry in zip(ours, stock):
        rewards = ("rewards/chosen", "rewards/rejected", "rewards/margins")
        if "rewards/accuracies" in stock_entry and all(abs(stock_entry[name]) < 1e-6 for name in rewards):
            assert all(abs(our_entry[name]) < 1e-6 for name in rewards)
            our_entry.pop("rewards/accuracies"), stock_entry.pop("rewards/accuracies")
    return metric_mismatches(ours, stock)


# ---- every loss type ---------------------------------------------------------------------------------------------
#: Each loss type of TRL 1.16's DPOTrainer, with what it needs (exo_pair: label smoothing > 0; ipo's squared loss at
#: a learning rate that keeps it finite).
LOSS_TYPES = {
    "sigmoid": {},
    "hinge": {},
    "ipo": dict(learning_rate=0.02),
    "exo_pair": dict(label_smoothing=1e-3),
    "nca_pair": {},
    "robust": dict(label_smoothing=0.1),
    "bco_pair": {},
    "sppo_hard": dict(learning_rate=0.05),
    "aot": dict(label_smoothing=0.1),
    "aot_unpaired": {},
    "apo_zero": {},
    "apo_down": {},
    "discopop": dict(discopop_tau=0.5),
    "sft": {},
    "sigmoid_norm": {},
}


#: The loss types the default suite trains (every one's arithmetic is checked against stock's in tests/test_dpo_loss.py;
#: each trains under ``-m long``).
DEFAULT_LOSS_TYPES = ("sigmoid", "ipo", "robust", "aot", "discopop", "sft")


@pytest.mark.parametrize(
    "loss_type", [t if t in DEFAULT_LOSS_TYPES else pytest.param(t, marks=pytest.mark.long) for t in LOSS_TYPES]
)
def test_every_loss_type_matches_stock(model_dir, tmp_path, loss_type):
    steps, _ = compare_with_stock(model_dir, tmp_path, loss_type=[loss_type], **LOSS_TYPES[loss_type])
    for step in steps:
        assert step["dynbsz/microbatches"] > 2  # cut unlike stock's two micro-batches
        assert step["dynbsz/prompt_tokens_saved"] > 0  # each pair's prompt once
        assert step["dynbsz/padding_fraction"] == 0


#: Stock's other loss settings, each a run (:data:`~hf_dynbsz.testing.DPO_LOSS_SETTINGS`: loss lists with weights,
#: LD-DPO, WPO weighting, the f-divergences, a small beta), and the plugin's own.
LOSS_SETTINGS = {
    **DPO_LOSS_SETTINGS,
    # (the plugin's) budgets from a memory limit: the training and the reference's passes sized by the memory model
    "budget_from_memory": dict(max_memory_per_device_mib=100_000, max_tokens_per_microbatch=None),
    # (the plugin's) the other sharing rules: each prompt in its group; nothing shared (a pair's two rows side by side)
    "prompt_groups": dict(share_prompt_prefix="groups"),
    "nothing_shared": dict(share_prompt_prefix=False),
}


DEFAULT_SETTINGS = ("list_with_weights", "ld_alpha_aot", "use_weighting", "alpha_divergence", "budget_from_memory")


@pytest.mark.parametrize(
    "settings",
    [s if s in DEFAULT_SETTINGS else pytest.param(s, marks=pytest.mark.long) for s in LOSS_SETTINGS],
)
def test_loss_settings_match_stock(model_dir, tmp_path, settings):
    compare_with_stock(model_dir, tmp_path, **LOSS_SETTINGS[settings])


# ---- the reference, the schedule, truncation, PEFT ----------------------------------------------------------------
def test_precomputed_reference_log_probs(model_dir, tmp_path):
    """``precompute_ref_log_probs``: stock computes the column at start (its own padded passes) and no reference runs
    in training; ours reads the same column."""
    steps, trainer = compare_with_stock(model_dir, tmp_path, precompute_ref_log_probs=True)
    assert trainer.ref_model is None  # none kept in memory, as stock
    assert all(step["dynbsz/logprob_seconds"] == 0 for step in steps)  # no reference passes


def test_sync_ref_model(model_dir, tmp_path):
    """``sync_ref_model``: TRL's callback mixes the policy into the reference every step; the reference's passes read
    the synced weights."""
    compare_with_stock(model_dir, tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6)


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_truncation(model_dir, tmp_path, truncation_mode):
    """``max_length`` cuts rows as stock's collator does: keep_start drops a response's end, keep_end a prompt's
    start (and a response's, whose first token is then never scored)."""
    dataset = preference_pairs(16, prompt=(3, 30), response=(1, 30), seed=3)
    compare_with_stock(model_dir, tmp_path, dataset, max_length=24, truncation_mode=truncation_mode)


@pytest.mark.parametrize(
    "schedule",
    [
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, gradient_checkpointing=False),
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, max_steps=2),  # last micro-batch: 2 pairs
    ],
    ids=["one_micro_batch", "four_micro_batches_last_smaller"],
)
def test_gradient_accumulation(model_dir, tmp_path, schedule):
    compare_with_stock(model_dir, tmp_path, preference_pairs(22, seed=4), **schedule)


def test_lora_reference_is_the_adapter_disabled_policy(model_dir, tmp_path):
    """LoRA without a ``ref_model``: the reference's passes run the policy with its adapter disabled, as stock's."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    steps, trainer = compare_with_stock(model_dir, tmp_path, trainer_kwargs=dict(peft_config=lora))
    assert trainer.ref_model is None
    assert all(step["dynbsz/logprob_seconds"] > 0 for step in steps)


# ---- shared prefixes ----------------------------------------------------------------------------------------------
def test_pairs_sharing_a_prompt_stay_whole_when_the_prompts_subtree_is_cut(model_dir, tmp_path):
    """Four pairs per prompt (a prompt with several ranked responses), in a budget that cannot hold a prompt's four
    pairs: the prompt's subtree is cut into pieces, each pair kept whole in one of them."""
    dataset = preference_pairs(16, pairs_per_prompt=4, prompt=(20, 30), response=(5, 20), seed=6)
    steps, _ = compare_with_stock(model_dir, tmp_path, dataset, max_tokens_per_microbatch=90)
    assert all(step["dynbsz/microbatches"] >= 4 for step in steps)


@pytest.mark.parametrize(
    "lengths",
    [dict(prompt=(2, 120), response=(1, 8)), dict(prompt=(2, 6), response=(20, 100))],
    ids=["long_prompts_short_responses", "short_prompts_long_responses"],
)
def test_prompts_and_responses_of_very_different_lengths(model_dir, tmp_path, lengths):
    dataset = preference_pairs(16, seed=7, **lengths)
    steps, _ = compare_with_stock(model_dir, tmp_path, dataset, max_tokens_per_microbatch=220)
    assert all(step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"] for step in steps)


# ---- drop-in -------------------------------------------------------------------------------------------------------
def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    _, stock, stock_history, _ = dpo_run(False, model_dir, str(tmp_path / "stock"))
    _, ours, history, _ = dpo_run(True, model_dir, str(tmp_path / "ours"), dynamic_batching=False)
    assert relative_difference(ours, stock) == 0.0
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history), rel=0, abs=0)


def test_constructor_and_config_are_stocks():
    assert not signature_mismatches(DynamicBatchDPOTrainer, DPOTrainer)  # the constructor and every override
    assert issubclass(DynamicBatchDPOTrainer, DPOTrainer) and issubclass(DynamicBatchDPOConfig, DPOConfig)
    stock_fields = set(DPOConfig.__dataclass_fields__)
    assert stock_fields <= set(DynamicBatchDPOConfig.__dataclass_fields__)
    with pytest.raises(ValueError, match="sequence_parallel_size=2"):
        DynamicBatchDPOConfig(output_dir="unused", sequence_parallel_size=2, use_cpu=True, report_to="none")


@pytest.mark.parametrize(
    "fields, error",
    [
        (dict(loss_type=["exo_pair"]), ValueError),  # label smoothing 0
        (dict(loss_type=["aot"], use_weighting=True), NotImplementedError),
        (dict(loss_type=["bco_pair"], f_divergence_type="forward_kl"), ValueError),
        (dict(loss_type=["sigmoid", "hinge"], loss_weights=[1.0]), ValueError),
    ],
    ids=["exo_pair_without_smoothing", "aot_weighting", "bco_pair_forward_kl", "weights_of_another_length"],
)
def test_stocks_errors(model_dir, tmp_path, fields, error):
    """What stock refuses, ours refuses with the same error (from stock's own checks, before any work)."""
    messages = []
    for plugin in (False, True):
        with pytest.raises(error) as raised:
            dpo_run(plugin, model_dir, str(tmp_path / str(plugin)), **fields)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_sft_with_weighting_runs_stocks_micro_batches_with_one_logged_reason(model_dir, tmp_path, caplog):
    """``sft`` with ``use_weighting`` couples a micro-batch's pairs through their weights: stock's micro-batches run,
    with one logged reason, and fail as stock's do (TRL 1.16 scales the SFT term's expanded scalar in place)."""
    messages = []
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        for plugin in (False, True):
            with pytest.raises(RuntimeError) as raised:
                fields = dict(loss_type=["sigmoid", "sft"], use_weighting=True)
                dpo_run(plugin, model_dir, str(tmp_path / str(plugin)), **fields)
            messages.append(str(raised.value))
    assert messages[0] == messages[1]
    reasons = [r.getMessage() for r in caplog.records if "stock DPOTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and "use_weighting" in reasons[0]


# ---- what stock accepts and the plugin does not reproduce: refused before any work, or stock's micro-batches --------
#: The fix each refusal below names, by the setting refused. A LOMO optimizer updates the parameters in each backward
#: (transformers' Trainer passes it the learning rate), so its update depends on how a step is cut into backwards.
REFUSAL_FIXES = {
    "parallelism_config": "Set cp_size, sp_size and tp_size to 1",
    "use_weighting": "Set use_weighting=False",
    "optim": "Choose another optimizer (e.g. optim='adamw_torch'), or set dynamic_batching=False",
}


@pytest.mark.parametrize(
    "fields, refused",
    [
        (dict(parallelism_config=dict(tp_size=2)), "parallelism_config with tp_size=2: "),
        (dict(parallelism_config=dict(cp_size=2)), "parallelism_config with cp_size=2: "),
        (dict(parallelism_config=dict(sp_size=2, sp_backend="deepspeed")), "parallelism_config with sp_size=2: "),
        (dict(loss_type=["hinge"], use_weighting=True), "loss_type=['hinge'] with use_weighting=True: "),
        (dict(optim="lomo"), "optim='lomo' with dynamic_batching=True: "),
        (dict(optim="adalomo"), "optim='adalomo' with dynamic_batching=True: "),
    ],
    ids=["tensor_parallel", "context_parallel", "sequence_parallel", "hinge_weighting", "lomo", "adalomo"],
)
def test_settings_the_passes_do_not_reproduce_are_refused_before_any_work(model_dir, tmp_path, fields, refused):
    """The plugin's config refuses them, and its trainer given stock's config (stock accepts each), before any
    forward; the message names the setting, its value and the fix."""
    import re

    from accelerate.parallelism_config import ParallelismConfig
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing import CPU_RUN_FIELDS, load_tokenizer

    if "parallelism_config" in fields:
        fields = dict(fields, parallelism_config=ParallelismConfig(**fields["parallelism_config"]))
    fix = next(text for name, text in REFUSAL_FIXES.items() if name in fields)
    fields = dict(output_dir=str(tmp_path), **CPU_RUN_FIELDS, **fields)
    with pytest.raises(ValueError, match=re.escape(refused)) as raised:
        DynamicBatchDPOConfig(**fields)
    assert fix in str(raised.value)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=re.escape(refused)):
        DynamicBatchDPOTrainer(
            model=model, ref_model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            args=DPOConfig(**fields), train_dataset=preference_pairs(), processing_class=load_tokenizer(model_dir),
        )  # fmt: skip
    assert not forwards


def test_a_lomo_optimizer_with_dynamic_batching_off_is_stocks_to_run(tmp_path):
    """The refusal above is the plugin's: with ``dynamic_batching=False`` (stock's trainer, which passes LOMO its
    learning rate in each backward) the config takes a LOMO optimizer."""
    from hf_dynbsz.testing import CPU_RUN_FIELDS

    config = DynamicBatchDPOConfig(output_dir=str(tmp_path), **CPU_RUN_FIELDS, optim="lomo", dynamic_batching=False)
    assert config.optim == "lomo"


def cache_clearings(train) -> list[str]:
    """The calls of accelerate's ``clear_device_cache`` (what transformers' ``Trainer.training_step`` empties the
    device cache with) while ``train()`` runs, each as ``file:function`` of its caller: seen by a profiler hook on the
    function's code, nothing replaced (on CPU the function itself does nothing)."""
    import sys
    from pathlib import Path

    from accelerate.utils.memory import clear_device_cache

    calls = []

    def observe(frame, event, arg):
        if event == "call" and frame.f_code is clear_device_cache.__code__:
            caller = frame.f_back.f_code
            calls.append(f"{Path(caller.co_filename).name}:{caller.co_name}")

    sys.setprofile(observe)
    try:
        train()
    finally:
        sys.setprofile(None)
    return calls


def test_torch_empty_cache_steps_empties_the_cache_as_stock(model_dir, tmp_path):
    """``torch_empty_cache_steps=2`` over 3 steps of 2 micro-batches: stock's ``Trainer.training_step`` empties the
    cache after each micro-batch of the steps numbered 0 and 2 (4 calls), the plugin's step after each training call
    of the same steps."""
    fields = dict(max_steps=3, torch_empty_cache_steps=2, max_tokens_per_microbatch=SMALL_BUDGET)
    stock = cache_clearings(lambda: dpo_run(False, model_dir, str(tmp_path / "stock"), **fields))
    ours = cache_clearings(lambda: dpo_run(True, model_dir, str(tmp_path / "ours"), **fields))
    released = ["memory.py:release_memory"]  # accelerate's free_memory as training starts, with or without it
    assert stock == released + ["trainer.py:training_step"] * 4
    assert ours == released + ["hooks.py:empty_cache_as_trainer"] * 4


def dropout_model(kind: str, vocab_size: int):
    """A tiny model that drops out in training: GPT-2 with dropout modules (``resid_pdrop`` and kin), or Qwen2 with
    ``attention_dropout`` (applied in the attention function)."""
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

    small = dict(vocab_size=vocab_size, num_hidden_layers=2, num_attention_heads=2)
    if kind == "modules":
        config = GPT2Config(n_embd=32, n_positions=256, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **small)
    else:
        config = Qwen2Config(
            hidden_size=32, intermediate_size=64, num_key_value_heads=2, attention_dropout=0.1, **small
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "kind, disable_dropout, refused",
    [
        ("modules", False, "loss_type=['aot'] with disable_dropout=False: "),
        ("modules", True, None),  # TRL zeroes the dropout modules
        ("attention", True, "loss_type=['aot'] with attention_dropout=0.1 in the model's config: "),
    ],
    ids=["dropout_modules_kept", "dropout_modules_disabled", "attention_dropout"],
)
def test_a_sorted_loss_on_a_model_that_drops_out_is_refused_before_any_work(
    model_dir, tmp_path, kind, disable_dropout, refused
):
    """``aot`` sorts a micro-batch's pairs by log-ratios from a no-grad pass before the training passes: exact only
    when that pass repeats the training forward, which dropout breaks. Refused at construction, naming the setting,
    its value and the fix; with the dropout modules disabled (stock's default) the trainer is built."""
    import re

    from hf_dynbsz.testing import dpo_config, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model, reference = (dropout_model(kind, len(tokenizer)) for _ in range(2))
    args = dpo_config(str(tmp_path), plugin=True, loss_type=["aot"], disable_dropout=disable_dropout)
    build = dict(
        model=model, ref_model=reference, args=args, train_dataset=preference_pairs(), processing_class=tokenizer
    )
    if refused is None:
        assert DynamicBatchDPOTrainer(**build)._dynbsz.enabled
        return
    fix = "Set disable_dropout=True" if kind == "modules" else "Set the model config's attention_dropout=0"
    with pytest.raises(ValueError, match=re.escape(refused)) as raised:
        DynamicBatchDPOTrainer(**build)
    assert fix in str(raised.value)


def test_a_collator_that_adds_model_inputs_runs_stocks_micro_batches_with_one_logged_reason(
    model_dir, tmp_path, caplog
):
    """A subclass of ``DataCollatorForPreference`` that adds a model input (position ids spread out, which stock's
    forward receives and which change its log-probs): the passes would drop it, so the run trains stock's
    micro-batches from its first step, says so once, and equals stock."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from hf_dynbsz.testing import load_tokenizer

    def collator():
        pad = load_tokenizer(model_dir).pad_token_id
        return dict(data_collator=spread_positions_collator(DataCollatorForPreference, pad))

    _, stock, stock_history, _ = dpo_run(False, model_dir, str(tmp_path / "stock"), trainer_kwargs=collator())
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, ours, history, _ = dpo_run(
            True, model_dir, str(tmp_path / "ours"), trainer_kwargs=collator(), max_tokens_per_microbatch=SMALL_BUDGET
        )
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert not logged_mismatches(history, stock_history)
    reasons = [r.getMessage() for r in caplog.records if "stock DPOTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and "SpreadPositions" in reasons[0] and "(position_ids)" in reasons[0], reasons


def test_pairs_stay_together_in_every_training_pass(model_dir, tmp_path, monkeypatch):
    """Every training pass holds whole pairs, each chosen row followed by its rejected row (what the loss reads)."""
    from hf_dynbsz.execution import executor as executor_module

    seen = []
    original = executor_module.PassExecutor._train

    def recording(self, model, aux, state, schedule, group, last):
        sides = state.batch.per_token["side"].squeeze(1)[group].tolist()
        seen.append(sides)
        return original(self, model, aux, state, schedule, group, last)

    monkeypatch.setattr(executor_module.PassExecutor, "_train", recording)
    dataset = preference_pairs(16, pairs_per_prompt=2, seed=8)
    dpo_run(True, model_dir, str(tmp_path / "ours"), dataset, max_tokens_per_microbatch=60)
    assert len(seen) > 4
    assert all(sides == [1.0, 0.0] * (len(sides) // 2) for sides in seen)
    assert torch.tensor([len(s) for s in seen]).min() >= 2


# ---- model families from their configs' defaults -------------------------------------------------------------------
#: Families from their default configs made tiny (``hf_dynbsz.testing.zoo``): an MoE with its router aux loss on (the
#: config's own coefficient: stock adds ``coef x aux`` per micro-batch and logs ``aux_loss``), a hybrid whose linear
#: attention carries state along a row (segment recurrence: each node of a pair's tree from its parent's state), and
#: sliding-window attention (windows of 8 tokens, shorter than the pairs).
FAMILIES = {
    "qwen3_moe": dict(),
    "qwen3_next": dict(),
    "mistral": dict(),
    "gemma2": dict(),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_families_from_their_default_configs(family_dir, tmp_path, family):
    steps, trainer = compare_with_stock(family_dir, tmp_path, **FAMILIES[family])
    if family == "qwen3_moe":
        assert trainer.aux_loss_enabled and all("aux_loss" in step for step in steps)
    assert all(step["dynbsz/prompt_tokens_saved"] > 0 for step in steps)


def test_a_pair_over_the_budget_runs_whole_in_a_pass_of_its_own(model_dir, tmp_path):
    """Pairs of 10 prompt and 15 + 15 response tokens in a budget of 30: each sequence fits, the pair (40 unique
    tokens) does not, and runs alone, whole, with one warning naming its pass's size; the step equals stock's."""
    dataset = preference_pairs(16, prompt=(10, 11), response=(15, 16), seed=9)
    with pytest.warns(UserWarning, match=r"longer than the token budget \(30 tokens; longest (4\d)\)"):
        steps, _ = compare_with_stock(model_dir, tmp_path, dataset, max_tokens_per_microbatch=30)
    assert all(step["dynbsz/microbatches"] == 8 for step in steps)  # one pass per pair


def test_longrope_pairs_take_the_factors_of_their_micro_batch(tmp_path, monkeypatch):
    """A Phi-3 LongRoPE model (original length 48): stock's forward picks the long or short factors by its padded
    micro-batch's width; each pair takes its micro-batch's in the passes (``rope_widths``), whatever it shares a pass
    with. Micro-batches both under and over 48 tokens wide. (Without the widths the self-check finds every layout off
    by 1e-2 and stock's math runs.)"""
    from hf_dynbsz.trainers import dpo as dpo_module

    widths, step_batch = set(), dpo_module.dpo_step_batch

    def recording(*args):
        batch = step_batch(*args)
        widths.update(batch.table.rope_widths.tolist())
        return batch

    monkeypatch.setattr(dpo_module, "dpo_step_batch", recording)
    model_dir = save_tiny_model(str(tmp_path / "phi3"), architecture="phi3_longrope")
    dataset = preference_pairs(16, prompt=(3, 30), response=(1, 30), seed=10)
    steps, trainer = compare_with_stock(model_dir, tmp_path, dataset, max_tokens_per_microbatch=120)
    assert trainer._dynbsz.capabilities.support.long_rope == (48,)
    assert widths == {0, 49}  # short factors (under 48 tokens wide) and long ones


# ---- a memory cap that binds ---------------------------------------------------------------------------------------
def test_a_memory_cap_under_the_steps_one_pass_peak_cuts_more_passes_and_matches_stock(model_dir, tmp_path):
    """The cap is set 20 MiB under the peak a roomy cap's run predicted for its passes (the whole step in one pass,
    this process's held memory included; on CPU the held memory is most of it, and may move by a few MiB between
    runs): the budget from memory shrinks to pairs alone, the step runs in more passes, and the run still equals
    stock. (A cap of 100,000 MiB, as in ``budget_from_memory``,
    never binds.)"""
    roomy = dict(max_memory_per_device_mib=100_000, max_tokens_per_microbatch=None)
    _, _, history, _ = dpo_run(True, model_dir, str(tmp_path / "roomy"), **roomy)
    roomy_steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    cap = int(min(entry["dynbsz/predicted_peak_memory_mib"] for entry in roomy_steps)) - 20
    steps, _ = compare_with_stock(model_dir, tmp_path, max_memory_per_device_mib=cap, max_tokens_per_microbatch=None)
    assert min(step["dynbsz/microbatches"] for step in steps) > max(step["dynbsz/microbatches"] for step in roomy_steps)
