"""DynamicBatchRewardTrainer equals stock TRL RewardTrainer, single process.

Each comparison trains stock ``trl.RewardTrainer`` and ``DynamicBatchRewardTrainer`` on the same preference pairs from
the same tiny model (a saved causal LM loaded as a sequence classifier of one label, its score head from a fixed seed),
with a token budget small enough that every optimizer step (2 micro-batches of 4 pairs) is cut into passes unlike
stock's, and checks: the same parameters afterwards (relative difference <= 1e-5), the same *updates* (relative
difference <= 1e-3, which is what exposes a mis-weighted pair), and every metric stock logs (``loss``, ``num_tokens``,
``min_reward``, ``mean_reward``, ``max_reward``, ``accuracy``, ``margin``, ``grad_norm``) equal, entry by entry.

Runs: the default Bradley-Terry loss (with stock's default gradient checkpointing), a ``margin`` column,
``center_rewards_coefficient``, gradient accumulation of 4 micro-batches cut into other passes, a system block common
to every prompt (the prefix tree computes it once per pass), the padded layout, the sequence classifiers of other
families (MoE, hybrid state-space, sliding-window; more under ``-m long``), and what runs stock's micro-batches (dynamic
batching off; a custom collator; a model whose classifier is not the generic last-token one: GPT-2, Zamba2).
"""

from __future__ import annotations

import logging

import pytest
from trl import RewardConfig, RewardTrainer

from hf_dynbsz import DynamicBatchRewardConfig, DynamicBatchRewardTrainer
from hf_dynbsz.testing import (
    logged_metrics,
    metric_mismatches,
    plan_document,
    preference_pairs,
    relative_difference,
    runs_against_stock,
    signature_mismatches,
)
from hf_dynbsz.testing.reward import REWARD_PLUGIN_FIELDS, reward_run, with_margins

#: Pairs of 3-20 prompt tokens and 1-25 response tokens: a pair is 5-70 unique tokens, so passes of 80 hold one to a few
#: pairs, where stock's micro-batches hold 4 (8 rows padded to the longest).
SMALL_BUDGET = 80
PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-3


def compare_with_stock(model_dir, tmp_path, dataset=None, *, trainer_kwargs=None, **fields):
    """Stock RewardTrainer and ours on the same pairs: same parameters, updates and logged metrics; returns our logged
    steps (the entries with the plugin's figures) and our trainer."""
    dataset = dataset if dataset is not None else preference_pairs(16)
    history, stock_history, trainer = runs_against_stock(
        reward_run, model_dir, tmp_path, dataset, fields, plugin_fields=REWARD_PLUGIN_FIELDS, budget=SMALL_BUDGET,
        trainer_kwargs=trainer_kwargs, param_tolerance=PARAM_TOLERANCE, update_tolerance=UPDATE_TOLERANCE,
    )  # fmt: skip
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history))
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == fields.get("max_steps", 2)
    return steps, trainer


@pytest.mark.parametrize(
    "case",
    ["bradley_terry", "margin", "center_rewards", "margin_and_center_rewards"],
)
def test_losses_match_stock(model_dir, tmp_path, case):
    dataset = preference_pairs(16)
    if "margin" in case:
        dataset = with_margins(dataset)
    fields = dict(center_rewards_coefficient=0.05) if "center" in case else {}
    steps, trainer = compare_with_stock(model_dir, tmp_path, dataset, **fields)
    assert trainer._dynbsz.enabled
    for step in steps:
        assert step["dynbsz/microbatches"] > 2  # cut unlike stock's two micro-batches
        assert step["dynbsz/prompt_tokens_saved"] > 0  # each pair's prompt once
        assert step["dynbsz/padding_fraction"] == 0
        assert step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"]


def test_gradient_accumulation_cut_into_other_passes(model_dir, tmp_path):
    """4 micro-batches of 3 pairs (the last of a step's 11 pairs smaller at the end of the data), cut into passes of
    up to 100 tokens: pair weights 1 / (B GA) with each pair's own micro-batch's B."""
    dataset = preference_pairs(22, seed=4)
    fields = dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, gradient_checkpointing=False)
    steps, _ = compare_with_stock(model_dir, tmp_path, dataset, max_tokens_per_microbatch=100, **fields)
    for step in steps:
        assert step["dynbsz/microbatches"] >= 2 and step["dynbsz/microbatches"] != 4
        assert step["dynbsz/prompt_tokens_saved"] > 0


# ---- model families -------------------------------------------------------------------------------------------------
#: Sequence classifiers of other families from their default configs made tiny (stock's RewardTrainer adds no router
#: aux loss), each with its comparison's settings: Llama, Mistral (sliding windows), Qwen3-MoE (its experts routed per
#: token), Jamba (Mamba layers beside attention, and routed experts), Gemma-3 (sliding and full attention layers
#: alternating). The Gemma families learn at 0.05: at 0.5 their parameters move by 240% in 2 steps, where stock's own
#: padding (``pad_to_multiple_of=64``) moves them by 2.6e-6 (ours: 5.5e-6, against the tolerance of 1e-5); at 0.05 by
#: 10%, stock's padding 1e-7.
FAMILIES = {"llama": {}, "mistral": {}, "qwen3_moe": {}, "jamba": {}, "gemma3_text": dict(learning_rate=0.05)}
#: Under ``-m long``: Gemma-2 (alternating windows, soft-capped attention logits), Mixtral (MoE), GPT-OSS (MoE,
#: alternating windows, attention sinks), and the hybrids with linear attention: Qwen3-Next and Qwen3.5 (Gated
#: DeltaNet), MiniMax (lightning attention). The pure state-space families (Mamba, Mamba-2, FalconMamba) have no
#: sequence classifier in transformers.
LONG_FAMILIES = {
    "gemma2": dict(learning_rate=0.05),
    **dict.fromkeys(["mixtral", "gpt_oss", "qwen3_next", "qwen3_5_text", "minimax"], {}),
}


@pytest.mark.parametrize(
    "family", [*FAMILIES, *(pytest.param(family, marks=pytest.mark.long) for family in LONG_FAMILIES)]
)
def test_other_model_families(family_dir, tmp_path, family):
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    settings = {**FAMILIES, **LONG_FAMILIES}[family]
    steps, trainer = compare_with_stock(family_dir, tmp_path, with_margins(preference_pairs(16, seed=2)), **settings)
    assert trainer._dynbsz.enabled
    assert type(trainer.model).__name__ == MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[family]
    assert all(step["dynbsz/prompt_tokens_saved"] > 0 for step in steps)


# ---- drop-in and stock's micro-batches ---------------------------------------------------------------------------
def test_constructor_and_config_are_stocks():
    assert not signature_mismatches(DynamicBatchRewardTrainer, RewardTrainer)  # the constructor and every override
    assert issubclass(DynamicBatchRewardTrainer, RewardTrainer) and issubclass(DynamicBatchRewardConfig, RewardConfig)
    assert set(RewardConfig.__dataclass_fields__) <= set(DynamicBatchRewardConfig.__dataclass_fields__)
    with pytest.raises(ValueError, match="sequence_parallel_size=2"):
        DynamicBatchRewardConfig(output_dir="unused", sequence_parallel_size=2, use_cpu=True, report_to="none")


def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    dataset = preference_pairs(16)
    _, stock, stock_history, _ = reward_run(False, model_dir, str(tmp_path / "stock"), dataset)
    _, ours, history, _ = reward_run(True, model_dir, str(tmp_path / "ours"), dataset, dynamic_batching=False)
    assert relative_difference(ours, stock) == 0.0
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history), rel=0, abs=0)


class _OwnCollator:
    """A collator that is not DataCollatorForPreference (it delegates to one)."""

    def __init__(self, pad_token_id: int) -> None:
        from trl.trainer.reward_trainer import DataCollatorForPreference

        self.inner = DataCollatorForPreference(pad_token_id=pad_token_id)

    def __call__(self, examples):
        return self.inner(examples)


def test_a_custom_collator_runs_stocks_micro_batches_with_one_logged_reason(model_dir, tmp_path, caplog):
    dataset = preference_pairs(16)
    kwargs = dict(trainer_kwargs=dict(data_collator=_OwnCollator(0)))
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, stock, _, _ = reward_run(False, model_dir, str(tmp_path / "stock"), dataset, **kwargs)
        _, ours, history, _ = reward_run(True, model_dir, str(tmp_path / "ours"), dataset, **kwargs)
    assert relative_difference(ours, stock) == 0.0
    reasons = [r.getMessage() for r in caplog.records if "stock RewardTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and "_OwnCollator" in reasons[0]
    assert not any("dynbsz/microbatches" in entry for entry in history)


def assert_stocks_micro_batches(model_dir, tmp_path, caplog, classifier: str) -> None:
    """Stock's run and ours from ``model_dir`` equal to the bit, with one logged reason naming ``classifier``."""
    dataset = preference_pairs(16)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, stock, _, _ = reward_run(False, model_dir, str(tmp_path / "stock"), dataset)
        _, ours, _, trainer = reward_run(True, model_dir, str(tmp_path / "ours"), dataset)
    assert relative_difference(ours, stock) == 0.0 and not trainer._dynbsz.enabled
    reasons = [r.getMessage() for r in caplog.records if "stock RewardTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and classifier in reasons[0]


def test_a_classifier_that_is_not_the_generic_one_runs_stocks_micro_batches(tmp_path, caplog):
    """GPT-2's sequence classifier has its own forward: stock's micro-batches, with one logged reason."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from hf_dynbsz.testing import TEST_ALPHABET, build_char_tokenizer

    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, num_labels=1, pad_token_id=0)
    path = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert_stocks_micro_batches(str(path), tmp_path, caplog, "GPT2ForSequenceClassification")


@pytest.mark.long
def test_a_hybrid_whose_classifier_is_not_the_generic_one_runs_stocks_micro_batches(tmp_path_factory, tmp_path, caplog):
    """Zamba2 (Mamba-2 layers and a shared attention block) from its default config: its sequence classifier has its
    own forward, so stock's micro-batches run, with one logged reason."""
    from hf_dynbsz.testing.zoo import save_tiny_families

    model_dir = save_tiny_families(tmp_path_factory, ["zamba2"])["zamba2"]
    assert_stocks_micro_batches(model_dir, tmp_path, caplog, "Zamba2ForSequenceClassification")


def test_padding_with_the_eos_token_reads_each_reward_before_it(model_dir, tmp_path):
    """``pad_token`` the EOS token (stock's fallback for a tokenizer without one): every sequence ends with a token
    equal to ``pad_token_id``, so stock's classifier reads each reward at the token before it; ours too."""
    steps, trainer = compare_with_stock(model_dir, tmp_path, pad_token="<eos>")
    assert trainer.processing_class.pad_token_id == trainer.processing_class.eos_token_id
    assert all(step["dynbsz/prompt_tokens_saved"] > 0 for step in steps)


def test_a_layout_the_self_check_fails_runs_stocks_micro_batches_with_one_logged_reason(
    model_dir, tmp_path, caplog, monkeypatch
):
    """Passes without segment attention (packed sequences then see each other): the first step's self-check compares a
    few pairs' rewards with each sequence alone, finds them off, and stock's micro-batches run, with one logged
    reason."""
    import contextlib

    from hf_dynbsz.execution.device_pass import DevicePass

    monkeypatch.setattr(DevicePass, "segments", lambda self, model, *args: contextlib.nullcontext())
    dataset = preference_pairs(16)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, stock, stock_history, _ = reward_run(False, model_dir, str(tmp_path / "stock"), dataset)
        _, ours, history, trainer = reward_run(True, model_dir, str(tmp_path / "ours"), dataset)
    assert relative_difference(ours, stock) <= 1e-6 and not trainer._dynbsz.enabled
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history))
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_dynbsz"]
    reasons = [m for m in messages if "stock RewardTrainer math runs" in m]
    assert len(reasons) == 1 and "self-check" in reasons[0]
    assert not any("image inputs" in m for m in messages)


def test_hf_dynbsz_plan_trainer_reward(tmp_path, capsys):
    """``hf-dynbsz plan --trainer reward`` takes RewardConfig's options: pairs per optimizer step, no generation or
    reference rows; ``--lengths`` of ``PROMPT CHOSEN REJECTED`` simulates each pair's two sequences in one pass; a
    value stock's config refuses exits 2."""
    from hf_dynbsz.cli import main

    pairs = "20 30 50\n400 10 900\n12 300 20\n600 40 35\n30 30 30\n80 200 400\n15 15 15\n900 60 50\n"
    common, document = plan_document(tmp_path, capsys, "reward", pairs, 2500)
    assert [len(step["lengths"]) for step in document["steps"]] == [8, 8]
    assert all(index ^ 1 in group for step in document["steps"] for group in step["microbatches"] for index in group)
    assert main(common) == 0
    table = capsys.readouterr().out
    assert "pairs per optimizer step" in table
    assert "max_tokens_per_microbatch_logprob" not in table and "num_generations" not in table
    with pytest.raises(SystemExit) as refused:
        main([*common, "--center_rewards_coefficient", "not-a-number"])
    assert refused.value.code == 2


def test_lora_with_a_trained_score_head(model_dir, tmp_path):
    """LoRA (``task_type="SEQ_CLS"``: PEFT trains a copy of the score head beside the adapters): the rewards read off
    the head PEFT runs, the adapters and the head's copy trained as stock trains them."""
    from peft import LoraConfig

    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    dataset = with_margins(preference_pairs(16, seed=6))
    _, stock, stock_history, _ = reward_run(
        False, model_dir, str(tmp_path / "stock"), dataset, trainer_kwargs=dict(peft_config=lora)
    )
    _, ours, history, trainer = reward_run(
        True, model_dir, str(tmp_path / "ours"), dataset, trainer_kwargs=dict(peft_config=lora),
        max_tokens_per_microbatch=SMALL_BUDGET,
    )  # fmt: skip
    assert trainer._dynbsz.enabled
    trained = [name for name in stock if "lora_B" in name or "modules_to_save" in name]
    assert trained and relative_difference({n: ours[n] for n in trained}, {n: stock[n] for n in trained}) <= 1e-5
    assert any("score" in n for n in trained)  # PEFT's copy of the score head
    assert all(float(stock[n].abs().max()) > 0 for n in trained if "lora_B" in n)  # (they start at 0)
    assert not metric_mismatches(logged_metrics(history), logged_metrics(stock_history))
    assert all(entry["dynbsz/microbatches"] > 2 for entry in history if "dynbsz/microbatches" in entry)


@pytest.mark.parametrize("sharing", ["tree", "groups", False])
def test_a_sequence_that_is_a_prefix_of_its_pair_s_other(model_dir, tmp_path, sharing):
    """With the pad token the EOS token each reward is read before the EOS: where one response extends the other (or
    equals it), one sequence is a prefix of the other, all of it "prompt"; under every sharing rule its reward is read
    at its own last token."""
    from datasets import Dataset

    base = preference_pairs(16, seed=9)
    rows = {"prompt": base["prompt"], "chosen": [], "rejected": []}
    for k, (chosen, rejected) in enumerate(zip(base["chosen"], base["rejected"])):
        rows["chosen"].append(chosen)
        rows["rejected"].append([chosen + rejected, chosen, rejected][k % 3])  # extends, equals, differs
    steps, _ = compare_with_stock(model_dir, tmp_path, Dataset.from_dict(rows), pad_token="<eos>",
                                  share_prompt_prefix=sharing)  # fmt: skip
    assert all(step["dynbsz/microbatches"] > 2 for step in steps)


def test_a_float16_model_trains_in_float16(model_dir, tmp_path, monkeypatch):
    """TRL's own ``test_train_model_dtype``: the classifier's weights in float16 (learning rate 0.1): the plugin's
    passes run (the self-check passes at half precision's tolerance), the weights stay float16, and the parameters end
    within half precision's rounding of stock's (2e-5 here, against a 2e-3 move)."""
    import torch

    from hf_dynbsz.testing import reward as reward_testing

    loaded = reward_testing.reward_model
    monkeypatch.setattr(reward_testing, "reward_model", lambda *args: loaded(*args).to(torch.float16))
    dataset = preference_pairs(16)
    init, stock, _, _ = reward_run(False, model_dir, str(tmp_path / "stock"), dataset, learning_rate=0.1)
    _, ours, _, trainer = reward_run(
        True, model_dir, str(tmp_path / "ours"), dataset, learning_rate=0.1, max_tokens_per_microbatch=SMALL_BUDGET
    )
    assert trainer._dynbsz.enabled and trainer.model.dtype == torch.float16
    as_float = [{name: value.float() for name, value in params.items()} for params in (init, stock, ours)]
    moved = relative_difference(as_float[1], as_float[0])
    assert moved > 1e-3 and relative_difference(as_float[2], as_float[1]) < 0.05 * moved


def test_conversational_pairs(tmp_path):
    """Chat messages (TRL's ``conversational_preference``): stock applies the chat template to the prompt with each
    response; the pair's common prefix (the templated prompt) is shared, each reward read at its own last token."""
    from datasets import Dataset

    from hf_dynbsz.testing import save_tiny_model

    chat_dir = save_tiny_model(str(tmp_path / "chat"), chat=True)
    pairs = preference_pairs(16, seed=12)
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": text}] for text in pairs["prompt"]],
            "chosen": [[{"role": "assistant", "content": text}] for text in pairs["chosen"]],
            "rejected": [[{"role": "assistant", "content": text}] for text in pairs["rejected"]],
        }
    )
    steps, _ = compare_with_stock(chat_dir, tmp_path, dataset, max_tokens_per_microbatch=160)
    assert all(step["dynbsz/prompt_tokens_saved"] > 0 for step in steps)


def test_evaluation_is_stocks(model_dir, tmp_path):
    """``evaluate`` after training (stock's ``prediction_step``, on a raw dataset as TRL's own test passes it): the
    same metrics as stock's, from the same trained parameters."""
    dataset = preference_pairs(16)
    results = []
    for plugin in (False, True):
        fields = dict(max_tokens_per_microbatch=SMALL_BUDGET) if plugin else {}
        *_, trainer = reward_run(plugin, model_dir, str(tmp_path / str(plugin)), dataset, **fields)
        results.append(trainer.evaluate(eval_dataset=preference_pairs(6, seed=13)))
    timings = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    stock, ours = ({k: v for k, v in metrics.items() if k not in timings} for metrics in results)
    assert sorted(stock) == sorted(ours) and "eval_loss" in stock
    assert all(ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6) for name, value in stock.items())


def test_context_sequence_or_tensor_parallelism_is_refused_before_any_work():
    """A ``parallelism_config`` with cp/sp/tp: the passes train every process as a data-parallel replica."""
    from accelerate.parallelism_config import ParallelismConfig

    refused = r"parallelism_config with cp_size=2: DynamicBatchRewardTrainer .* trl\.RewardTrainer"
    with pytest.raises(ValueError, match=refused):
        DynamicBatchRewardConfig(
            output_dir="unused", parallelism_config=ParallelismConfig(cp_size=2), use_cpu=True, report_to="none"
        )
