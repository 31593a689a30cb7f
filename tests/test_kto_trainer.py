"""DynamicBatchKTOTrainer equals stock TRL KTOTrainer, single process.

Each comparison trains stock ``trl.KTOTrainer`` and ``DynamicBatchKTOTrainer`` on the same unpaired samples from the
same tiny model, with a token budget small enough that every optimizer step (2 micro-batches of 4 samples) is cut into
passes unlike stock's, and checks: the same parameters afterwards (relative difference <= 1e-5), the same *updates*
(relative difference <= 1e-5: KTO's KL estimate is a micro-batch mean, and stock's own steps cut ``2 x 4`` instead of
``4 x 2`` already move the update by more, :func:`test_a_wrong_micro_batch_shows`), and every metric stock logs
(``loss``, ``kl``, ``entropy``, ``num_tokens``, ``logits/*``, ``rewards/*``, ``logps/*``, ``grad_norm``) equal, entry by
entry.

Most runs take a reference sharper than the policy (:func:`~hf_dynbsz.testing.kto.sharpened_reference`) and
``beta=1``, so that the KL estimate is positive and weighs in the loss (with the policy as its own reference it is
clamped to 0 at the first step, where a wrong estimate would not show); one run is stock's defaults (``beta=0.1``, the
reference loaded from the model's path).
"""

from __future__ import annotations

import logging

import pytest
from trl import KTOConfig, KTOTrainer

from hf_dynbsz import DynamicBatchKTOConfig, DynamicBatchKTOTrainer
from hf_dynbsz.testing import (
    load_tokenizer,
    logged_metrics,
    plan_document,
    relative_difference,
    runs_against_stock,
    signature_mismatches,
    spread_positions_collator,
)
from hf_dynbsz.testing.kto import (
    KTO_BETA,
    KTO_LOSSES,
    KTO_PLUGIN_FIELDS,
    KTO_SHARPNESS,
    kto_metric_mismatches,
    kto_run,
    sharpened_reference,
    unpaired_samples,
)

#: Samples of 3-20 prompt tokens and 1-25 completion tokens: passes of 80 tokens hold one to a few samples, where
#: stock's micro-batches hold 4 (4 rows and 4 KL rows, each padded to the longest).
SMALL_BUDGET = 80
PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-5
#: The runs' KL setting: a reference 10x sharper than the policy, beta 1.
SHARP, BETA = KTO_SHARPNESS, KTO_BETA
#: The longest completion of the runs' samples (tokens, with its EOS): how many token log-probs a sequence sums.
LONGEST = 64


def compare_with_stock(
    model_dir, tmp_path, dataset=None, *, sharp: float | None = SHARP, trainer_kwargs=None, **fields
):
    """Stock KTOTrainer and ours on the same samples (a reference ``sharp`` times sharper than the policy, or stock's
    default reference for None): same parameters, updates and logged metrics; returns our logged steps (the entries
    with the plugin's figures) and our trainer."""
    dataset = dataset if dataset is not None else unpaired_samples(16)
    kwargs = dict(trainer_kwargs or {})

    def run(plugin, model_path, output_dir, data, trainer_kwargs=None, **config):
        reference = sharpened_reference(model_path, sharp) if sharp is not None else None
        return kto_run(plugin, model_path, output_dir, data, ref_model=reference, trainer_kwargs=trainer_kwargs,
                       **config)  # fmt: skip

    fields = {"beta": BETA, **fields} if sharp is not None else fields
    history, stock_history, trainer = runs_against_stock(
        run, model_dir, tmp_path, dataset, fields, plugin_fields=KTO_PLUGIN_FIELDS, budget=SMALL_BUDGET,
        trainer_kwargs=kwargs, param_tolerance=PARAM_TOLERANCE, update_tolerance=UPDATE_TOLERANCE,
    )  # fmt: skip
    beta = fields.get("beta", 0.1)
    assert not kto_metric_mismatches(logged_metrics(history), logged_metrics(stock_history), beta, LONGEST)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == fields.get("max_steps", 2)
    return steps, trainer


# ---- the losses -----------------------------------------------------------------------------------------------------
LOSSES = KTO_LOSSES


@pytest.mark.parametrize("case", list(LOSSES))
def test_losses_match_stock(model_dir, tmp_path, case):
    dataset = unpaired_samples(16, desirable=0.3 if "unequal" in case else 0.5)
    steps, trainer = compare_with_stock(model_dir, tmp_path, dataset, **LOSSES[case])
    assert trainer._dynbsz.enabled
    if LOSSES[case]["loss_type"] == "kto":
        assert steps[0]["kl"] > 0.01  # the estimate weighs in the loss
    for step in steps:
        assert step["dynbsz/microbatches"] > 2  # cut unlike stock's two micro-batches
        assert step["dynbsz/padding_fraction"] == 0
        assert step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"]


def test_stock_defaults(model_dir, tmp_path):
    """Stock's default KTO run (``beta=0.1``, the reference loaded from the model's path, gradient checkpointing)."""
    steps, trainer = compare_with_stock(model_dir, tmp_path, sharp=None)
    assert trainer._dynbsz.enabled and trainer.args.gradient_checkpointing


def test_a_wrong_micro_batch_shows(model_dir, tmp_path):
    """What the comparisons' update tolerance sees: stock's own run cut ``2 x 4`` instead of ``4 x 2`` (other KL
    estimates) moves the update by far more than it."""
    dataset = unpaired_samples(16)
    fields = dict(beta=BETA)
    init, stock, _, _ = kto_run(False, model_dir, str(tmp_path / "a"), dataset,
                                ref_model=sharpened_reference(model_dir, SHARP), **fields)  # fmt: skip
    _, other, _, _ = kto_run(
        False, model_dir, str(tmp_path / "b"), dataset, ref_model=sharpened_reference(model_dir, SHARP),
        per_device_train_batch_size=2, gradient_accumulation_steps=4, **fields,
    )  # fmt: skip
    update = {name: stock[name] - init[name] for name in init}
    other_update = {name: other[name] - init[name] for name in init}
    assert relative_difference(other_update, update) > 100 * UPDATE_TOLERANCE


def test_gradient_accumulation_cut_into_other_passes(model_dir, tmp_path):
    """4 micro-batches of 3 samples (the data's last micro-batch smaller), cut into passes of up to 60 tokens: each
    sample's weight 1 / (B GA) with its own micro-batch's B, each micro-batch's own KL estimate."""
    fields = dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, gradient_checkpointing=False)
    steps, _ = compare_with_stock(model_dir, tmp_path, unpaired_samples(22, seed=4), max_tokens_per_microbatch=60,
                                  **fields)  # fmt: skip
    assert all(step["dynbsz/microbatches"] > 4 for step in steps)


def test_precomputed_reference_log_probs(model_dir, tmp_path):
    """``precompute_ref_log_probs``: stock computes both columns at start; no reference runs during training."""
    steps, trainer = compare_with_stock(model_dir, tmp_path, precompute_ref_log_probs=True)
    assert trainer._dynbsz.loss.reference.precomputed


def test_lora_reference_is_the_adapter_disabled_policy(model_dir, tmp_path):
    """LoRA without a reference: the reference (of the samples and of the KL sequences) is the policy with its adapter
    disabled; the adapter's parameters and update equal stock's."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    steps, trainer = compare_with_stock(
        model_dir, tmp_path, sharp=None, trainer_kwargs=dict(peft_config=lora), beta=BETA
    )
    assert trainer._dynbsz.loss.reference.adapter


# ---- model families -------------------------------------------------------------------------------------------------
#: Other families from their default configs made tiny (``hf_dynbsz.testing.zoo``), each with its comparison's
#: settings: Llama, Mistral (sliding windows), Qwen3-MoE (its router aux loss, which stock's KTOTrainer adds), Bamba
#: (Mamba-2 layers beside attention) and Mamba (state-space layers alone). The state-space families take a
#: reference 1.5x sharper: at 10x their tiny models' KL estimate (~120) saturates every sigmoid and stock barely trains
#: (its parameters move by 2e-7); Bamba's update at 10x is 9.8e-6 from stock's, at the tolerance, where stock's own
#: padding (``pad_to_multiple_of=64``) moves it by 4.8e-6 (Mamba-2's chunked scan rounds with the row's length).
FAMILIES = {"llama": {}, "mistral": {}, "qwen3_moe": {}, "bamba": dict(sharp=1.5), "mamba": dict(sharp=1.5)}
#: Under ``-m long``: the hybrids Jamba (Mamba and attention layers, routed experts with their aux loss), Falcon-H1
#: (Mamba-2 and attention in parallel), Nemotron-H (Mamba-2, attention and MoE layers), LFM2 (short convolutions and
#: attention), Qwen3-Next (Gated DeltaNet and attention, MoE); state-space layers alone: FalconMamba, Mamba-2; MoE with
#: aux loss: Mixtral, OLMoE, GPT-OSS (also sliding and full attention layers alternating, attention sinks); sliding and
#: full attention layers alternating: Gemma-2 (soft-capped logits), Gemma-3, learning at 0.05 (at 0.5 their parameters
#: move by 75% and 150% in 2 steps, and float rounding with them; at 0.05 Gemma-2's update is still 6.6e-6 from stock's,
#: where stock's own padding, ``pad_to_multiple_of=64``, moves it by 3.2e-6).
LONG_FAMILIES = {
    **dict.fromkeys(["jamba", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next"], {}),
    **dict.fromkeys(["falcon_mamba", "mamba2"], dict(sharp=1.5)),
    **dict.fromkeys(["mixtral", "olmoe", "gpt_oss"], {}),
    **dict.fromkeys(["gemma2", "gemma3_text"], dict(learning_rate=0.05)),
}
#: The families whose router aux loss stock adds (their configs' coefficients).
AUX_LOSS_FAMILIES = ("qwen3_moe", "jamba", "qwen3_next", "mixtral", "olmoe", "gpt_oss")


@pytest.mark.parametrize(
    "family", [*FAMILIES, *(pytest.param(family, marks=pytest.mark.long) for family in LONG_FAMILIES)]
)
def test_other_model_families(family_dir, tmp_path, family):
    settings = {**FAMILIES, **LONG_FAMILIES}[family]
    steps, trainer = compare_with_stock(family_dir, tmp_path, unpaired_samples(16, seed=2), **settings)
    assert trainer._dynbsz.enabled and trainer.aux_loss_enabled == (family in AUX_LOSS_FAMILIES)
    if trainer.aux_loss_enabled:
        assert all("aux_loss" in step for step in steps)


def test_the_kl_estimate_is_compared_within_its_sums_rounding():
    """The logged ``kl`` is a mean of differences of two fp32 sums of token log-probs (a KL sequence's, the policy's
    and the reference's, ~30 each here), added in another order by a packed pass: Bamba's 3e-6 off a ``kl`` of 0.23
    passes (the bound: ``ceil(log2 64)`` ulps of both sums, 5e-5), 1e-3 shows."""
    entry = {"kl": 0.2256, "logps/chosen": -33.9, "logps/rejected": -25.6, "rewards/chosen": 0.22}
    entry.update({"rewards/rejected": 0.2, "rewards/margins": 0.02})
    assert not kto_metric_mismatches([dict(entry, kl=0.2256 + 3e-6)], [entry], BETA, LONGEST)
    far = kto_metric_mismatches([dict(entry, kl=0.2256 + 1e-3)], [entry], BETA, LONGEST)
    assert len(far) == 1 and far[0].startswith("entry 0: kl ")


# ---- drop-in and stock's micro-batches ---------------------------------------------------------------------------
def test_constructor_and_config_are_stocks():
    assert not signature_mismatches(DynamicBatchKTOTrainer, KTOTrainer)  # the constructor and every override
    assert issubclass(DynamicBatchKTOTrainer, KTOTrainer) and issubclass(DynamicBatchKTOConfig, KTOConfig)
    assert set(KTOConfig.__dataclass_fields__) <= set(DynamicBatchKTOConfig.__dataclass_fields__)
    from accelerate.parallelism_config import ParallelismConfig

    refused = {  # refused before any work: the error, the setting that gives it
        "sequence_parallel_size=2": dict(sequence_parallel_size=2),
        r"parallelism_config with cp_size=2: DynamicBatchKTOTrainer .* trl\.KTOTrainer": dict(
            parallelism_config=ParallelismConfig(cp_size=2)
        ),
    }
    for message, fields in refused.items():
        with pytest.raises(ValueError, match=message):
            DynamicBatchKTOConfig(output_dir="unused", use_cpu=True, report_to="none", **fields)


def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    dataset = unpaired_samples(16)
    _, stock, _, _ = kto_run(False, model_dir, str(tmp_path / "stock"), dataset)
    _, ours, _, _ = kto_run(True, model_dir, str(tmp_path / "ours"), dataset, dynamic_batching=False)
    assert relative_difference(ours, stock) == 0.0


def test_a_collator_that_adds_model_inputs_runs_stocks_micro_batches_with_one_logged_reason(
    model_dir, tmp_path, caplog
):
    """A subclass of ``DataCollatorForUnpairedPreference`` that adds a model input (position ids spread out, which
    stock's forward receives): the run trains stock's micro-batches from its first step, says so once, equals stock.
    (``apo_zero_unpaired``: with ``kto`` stock passes the input to its KL sequences' forward too, whose rows have
    another width, and fails.)"""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    def collator():
        pad = load_tokenizer(model_dir).pad_token_id
        return dict(data_collator=spread_positions_collator(DataCollatorForUnpairedPreference, pad))

    dataset, apo = unpaired_samples(16), dict(loss_type="apo_zero_unpaired")
    _, stock, stock_history, _ = kto_run(False, model_dir, str(tmp_path / "stock"), dataset,
                                         trainer_kwargs=collator(), **apo)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, ours, history, _ = kto_run(True, model_dir, str(tmp_path / "ours"), dataset, trainer_kwargs=collator(),
                                      max_tokens_per_microbatch=SMALL_BUDGET, **apo)  # fmt: skip
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    assert not kto_metric_mismatches(logged_metrics(history), logged_metrics(stock_history), 0.1, LONGEST)
    reasons = [r.getMessage() for r in caplog.records if "stock KTOTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and "SpreadPositions" in reasons[0] and "(position_ids)" in reasons[0], reasons


def test_a_custom_collator_runs_stocks_micro_batches_with_one_logged_reason(model_dir, tmp_path, caplog):
    """A collator that is not stock's (its rows are not read by the passes): stock's micro-batches, one reason."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    pad = load_tokenizer(model_dir).pad_token_id

    def collate(examples):
        return DataCollatorForUnpairedPreference(pad_token_id=pad)(examples)

    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, _, _, trainer = kto_run(True, model_dir, str(tmp_path / "ours"), trainer_kwargs=dict(data_collator=collate),
                                   max_steps=1)  # fmt: skip
    assert not trainer._dynbsz.enabled
    reasons = [r.getMessage() for r in caplog.records if "stock KTOTrainer math runs" in r.getMessage()]
    assert len(reasons) == 1 and "custom data collator (function)" in reasons[0], reasons


def test_hf_dynbsz_plan_trainer_kto(tmp_path, capsys):
    """``hf-dynbsz plan --trainer kto`` takes KTOConfig's options: samples per optimizer step, no generation rows, the
    no-grad budget of the KL sequences and the reference; ``--lengths`` of ``PROMPT COMPLETION`` simulates the
    samples; a value stock's config refuses exits 2."""
    from hf_dynbsz.cli import main

    samples = "20 30\n400 10\n12 300\n600 40\n30 30\n80 200\n15 15\n900 60\n"
    common, document = plan_document(tmp_path, capsys, "kto", samples, 1000)
    assert [len(step["lengths"]) for step in document["steps"]] == [4, 4]
    assert main(common) == 0
    table = capsys.readouterr().out
    assert "the KL sequences' policy log-probs" in table and "num_generations" not in table
    with pytest.raises(SystemExit) as refused:
        main([*common, "--desirable_weight", "not-a-number"])
    assert refused.value.code == 2
