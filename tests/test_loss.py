"""Specification of hf_dynbsz.execution.loss: per-sample weights that reproduce stock's normalisation, for every loss
type.

Checked against stock TRL, not against a formula written again: a real ``trl.GRPOTrainer`` computes each
slice's loss with its own ``_compute_loss`` on the same tensors, and the sum of our weighted per-sample losses
over the slice must equal it. Then the same samples are re-partitioned at random into packed micro-batches
(the trainer's forward path): the total must not move, and the loss metrics stock logs per slice (``entropy``,
``kl``, the clip ratios, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``), which
:class:`hf_dynbsz.execution.metrics.StepMetrics` makes of the passes' tensors, must be stock's slice by slice. The
weight table in ``loss.py``'s docstring is evaluated and compared with :func:`sample_weights`, so the documentation
cannot drift from the code.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz.execution import loss as loss_module
from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.loss import (
    CLIPPED_LOSSES,
    EntropyBonus,
    LossSettings,
    metric_keys,
    microbatch_loss,
    per_token_policy_loss,
    sample_weights,
)
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.testing import base_config_kwargs, random_passes, training_mode_trainer

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo"]
SLICES, ROWS, GA = 3, 4, 3  # an optimizer step of 3 stock slices of 4 samples
MAX_COMPLETION = 12
#: The slices' step: GA slices of ROWS samples (2 completions per prompt) per optimizer step.
STEP = dict(gradient_accumulation_steps=GA, steps_per_generation=GA, per_device_train_batch_size=ROWS)
STEP.update(max_completion_length=MAX_COMPLETION, num_generations=2)


def stock_trainer(model_dir, tmp_path, **config) -> GRPOTrainer:
    """A real stock trainer in training mode, its accumulation count set as the Trainer loop sets it."""
    config = {**STEP, **config}
    return training_mode_trainer(GRPOConfig(**base_config_kwargs(str(tmp_path), **config)), model_dir, GA)


def completion_logps(trainer, inputs, compute_entropy=True):
    """Stock's per-token log-probs and entropies of a slice (its own forward, gradients on)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=compute_entropy
    )
    return logps, entropies


def make_slices(trainer, *, seed=0, old=False, ref=False, sequence_ratio=False):
    """Stock-shaped slices (left-padded prompts, right-padded completions, some empty), as _prepare_inputs gives."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    slices, total_tokens = [], 0
    for _ in range(SLICES):
        prompt_lengths = torch.randint(1, 9, (ROWS,), generator=generator)
        completion_lengths = torch.randint(0, MAX_COMPLETION + 1, (ROWS,), generator=generator)
        completion_lengths[0] = MAX_COMPLETION  # every slice as wide as the round
        prompt_ids = torch.randint(3, vocab, (ROWS, 8), generator=generator)
        prompt_mask = (torch.arange(8) >= 8 - prompt_lengths.unsqueeze(1)).long()
        completion_ids = torch.randint(3, vocab, (ROWS, MAX_COMPLETION), generator=generator)
        completion_mask = (torch.arange(MAX_COMPLETION) < completion_lengths.unsqueeze(1)).long()
        slices.append(
            {
                "prompt_ids": prompt_ids * prompt_mask,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids * completion_mask,
                "completion_mask": completion_mask,
                "advantages": torch.randn(ROWS, generator=generator),
            }
        )
        total_tokens += int(completion_mask.sum())
    for inputs in slices:
        inputs["num_items_in_batch"] = torch.tensor(float(total_tokens))
        with torch.no_grad():
            logps, _ = completion_logps(trainer, inputs, compute_entropy=False)
        noise = lambda shape=logps.shape: 0.3 * torch.randn(shape, generator=generator)  # noqa: E731 - ratios move off 1
        if old:
            inputs["old_per_token_logps"] = (logps + noise()) * inputs["completion_mask"]
        if ref:
            inputs["ref_per_token_logps"] = (logps + noise()) * inputs["completion_mask"]
        if sequence_ratio:
            inputs["importance_sampling_ratio"] = torch.rand(ROWS, 1, generator=generator) + 0.5
    return slices


def our_slice_losses(trainer, slices, batch: StepBatch, bonus=None):
    """Per slice, the sum of our weighted per-sample losses, with the slice's own stock forward."""
    settings = LossSettings.from_trainer(trainer)
    losses = []
    for slice_id, inputs in enumerate(slices):
        logps, entropies = completion_logps(trainer, inputs)
        rows = batch.rows(list(range(slice_id * ROWS, (slice_id + 1) * ROWS)), logps.size(1))
        loss, _ = microbatch_loss(settings, logps, entropies, rows, bonus)
        losses.append(loss)
    return torch.stack(losses)


def prepare(trainer, slices) -> StepBatch:
    """The trainer's step batch: flattened slices, high-entropy mask (as the trainer does) and weights."""
    batch = StepBatch.from_slices(slices)
    if trainer.top_entropy_quantile < 1.0:
        high = torch.zeros_like(batch.loss_mask)
        for slice_id, inputs in enumerate(slices):
            with torch.no_grad():
                _, entropies = completion_logps(trainer, inputs)
            rows = slice(slice_id * ROWS, (slice_id + 1) * ROWS)
            high[rows] = trainer.get_high_entropy_mask(
                entropies, batch.loss_mask[rows], 1 - trainer.top_entropy_quantile
            ).long()
        batch.high_entropy = high
    batch.policy_weights, batch.entropy_weights = sample_weights(
        LossSettings.from_trainer(trainer),
        batch.loss_tokens,
        batch.slice_ids,
        batch.slice_rows,
        batch.num_items,
        gradient_accumulation_steps=GA,
        steps_per_generation=trainer.args.steps_per_generation,
        num_processes=1,
        entropy_tokens=batch.bonus_mask.sum(dim=1),
    )
    return batch


def assert_matches_stock(trainer, slices, bonus_enabled=False):
    batch = prepare(trainer, slices)
    stock = torch.stack([trainer._compute_loss(trainer.model, inputs) for inputs in slices])
    bonus = EntropyBonus(trainer, SLICES, "cpu") if bonus_enabled else None
    ours = our_slice_losses(trainer, slices, batch, bonus)
    assert torch.allclose(ours, stock, rtol=1e-5, atol=1e-7), (ours, stock)
    assert stock.abs().min() > 1e-4  # a comparison of zeros would prove nothing
    return batch, stock


# ---- against stock, per loss type ----------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_reproduce_stock_slice_losses(model_dir, tmp_path, loss_type):
    trainer = stock_trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.05)
    assert_matches_stock(trainer, make_slices(trainer, old=True, ref=True))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "luspo"])
def test_sequence_level_importance_sampling_matches_stock(model_dir, tmp_path, loss_type):
    trainer = stock_trainer(model_dir, tmp_path, loss_type=loss_type, importance_sampling_level="sequence")
    assert_matches_stock(trainer, make_slices(trainer, old=True))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_entropy_bonus_and_top_entropy_quantile_match_stock(model_dir, tmp_path, loss_type):
    trainer = stock_trainer(model_dir, tmp_path, loss_type=loss_type, entropy_coef=0.05, top_entropy_quantile=0.5)
    batch, _ = assert_matches_stock(trainer, make_slices(trainer, old=True), bonus_enabled=True)
    assert 0 < int(batch.high_entropy.sum()) < int(batch.loss_mask.sum())  # the mask really selects


def test_vespo_with_importance_ratios_matches_stock(model_dir, tmp_path):
    trainer = stock_trainer(model_dir, tmp_path, loss_type="vespo")
    assert_matches_stock(trainer, make_slices(trainer, old=True, sequence_ratio=True))


# ---- invariance under any re-partition -----------------------------------------------------------------------
#: What stock's _compute_loss logs besides the loss metrics (the entropy bonus's bookkeeping, EntropyBonus's).
BONUS_METRICS = ("policy_loss", "entropy_coef")


def repartitioned(trainer, slices, layout: str, seed: int):
    """The step's samples cut at random into packed passes (the trainer's forward path): their total loss and the
    loss metrics :class:`StepMetrics` logs from them, one value per stock slice."""
    batch = prepare(trainer, slices)
    settings = LossSettings.from_trainer(trainer)
    total, bonus = 0.0, EntropyBonus(trainer, SLICES, "cpu")
    metrics = StepMetrics(SLICES, "cpu", metric_keys(settings))
    for mb, logps, entropies, rows in random_passes(trainer.model, batch, layout, seed):
        loss, loss_metrics = microbatch_loss(settings, logps, entropies, rows, bonus)
        metrics.add_pass(mb.real_tokens, mb.computed_tokens, loss_metrics, entropies, rows.mask, rows.slice_ids)
        total = total + loss
    store = defaultdict(list)
    metrics.publish_slices(store)
    return total, store


def assert_repartitions_match_stock(trainer, slices, layout: str = "padding_free") -> dict:
    """Any re-partition: stock's total loss, and each loss metric stock logs with stock's value slice by slice."""
    trainer._metrics["train"].clear()
    stock_total = sum(trainer._compute_loss(trainer.model, inputs) for inputs in slices)
    stock = {name: values for name, values in trainer._metrics["train"].items() if name not in BONUS_METRICS}
    for seed in range(2):
        total, logged = repartitioned(trainer, slices, layout, seed)
        assert float(total.detach()) == pytest.approx(float(stock_total.detach()), rel=2e-5, abs=1e-7)
        assert sorted(logged) == sorted(stock)
        for name, values in stock.items():  # one value per stock slice, as stock's _compute_loss appends them
            assert logged[name] == pytest.approx(values, rel=1e-5, abs=1e-7, nan_ok=True), name
    return stock


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("layout", ["padding_free", "padded"])
def test_any_repartition_into_packed_passes_gives_stocks_total_and_metrics(model_dir, tmp_path, loss_type, layout):
    trainer = stock_trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.05, entropy_coef=0.02)
    stock = assert_repartitions_match_stock(trainer, make_slices(trainer, old=True, ref=True), layout)
    assert {"entropy", "kl"} <= set(stock)
    if loss_type in CLIPPED_LOSSES:  # the slices' extremes differ from the step's: a step-wide value would show
        assert len(set(stock["clip_ratio/high_max"])) > 1


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_sequence_level_ratios_and_entropy_mask_repartition_with_stocks_metrics(model_dir, tmp_path, loss_type):
    """One clip flag per sequence (stock counts sequences, not tokens), with top_entropy_quantile's mask, and rows
    without loss tokens (stock's masked_seq_mean is NaN there and nanmin/nanmax leave them out)."""
    trainer = stock_trainer(
        model_dir, tmp_path, loss_type=loss_type, importance_sampling_level="sequence", top_entropy_quantile=0.5
    )
    stock = assert_repartitions_match_stock(trainer, make_slices(trainer, old=True))
    assert ("clip_ratio/low_mean" if loss_type == "grpo" else "cispo_clip_ratio") in stock


def test_weights_do_not_depend_on_the_order_of_samples():
    settings = LossSettings("bnpo", 0.0, 0.2, 0.2, None, "token", None, False, False, 1.0, 1.0, (2, 3, 3, 2), 12)
    tokens, slice_ids = torch.tensor([3, 0, 7, 5, 2, 9]), torch.tensor([0, 0, 0, 1, 1, 1])
    kwargs = dict(gradient_accumulation_steps=2, steps_per_generation=2, num_processes=1)
    policy, _ = sample_weights(settings, tokens, slice_ids, torch.tensor([3, 3]), torch.full((6,), 26.0), **kwargs)
    permutation = torch.tensor([4, 0, 5, 2, 1, 3])
    permuted, _ = sample_weights(
        settings, tokens[permutation], slice_ids[permutation], torch.tensor([3, 3]), torch.full((6,), 26.0), **kwargs
    )
    assert torch.equal(permuted, policy[permutation])


# ---- the documented table is what the code does --------------------------------------------------------------
def documented_weights() -> dict[str, tuple[str, str]]:
    """loss type -> (stock normaliser, weight expression), read from the table of loss.py's docstring."""
    lines = inspect.getdoc(loss_module).splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    spans, position = [], 0
    for run in lines[rules[0]].split(" "):
        if run:
            start = lines[rules[0]].index(run, position)
            spans.append((start, start + len(run)))
            position = start + len(run)
    table, pending = {}, []
    for line in lines[rules[1] + 1 : rules[2]]:
        cells = [line[start : end if i < len(spans) - 1 else None].strip() for i, (start, end) in enumerate(spans)]
        names = [name.strip() for name in cells[0].split(",") if name.strip()]
        if cells[2]:
            pending = names
            for name in names:
                table[name] = (cells[1], cells[2])
        else:  # a continuation line of the loss-type column
            for name in names:
                table[name] = table[pending[0]]
    return table


def test_documented_weight_table_is_what_sample_weights_computes():
    table = documented_weights()
    assert set(LOSS_TYPES) | {"entropy bonus"} == set(table)
    loss_tokens = torch.tensor([3, 0, 7, 5, 2, 9, 4])
    slice_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    slice_rows = torch.tensor([3, 4])
    entropy_tokens = torch.tensor([1, 0, 2, 5, 0, 3, 1])
    ga, spg, processes, n_items, max_completion = 3, 6, 4, 123.0, 12
    for loss_type in LOSS_TYPES:
        settings = LossSettings(
            loss_type, 0.0, 0.2, 0.2, None, "token", None, False, False, 1.0, 1.0, (2, 3, 3, 2), max_completion
        )
        policy, entropy = sample_weights(
            settings,
            loss_tokens,
            slice_ids,
            slice_rows,
            torch.full((7,), n_items),
            gradient_accumulation_steps=ga,
            steps_per_generation=spg,
            num_processes=processes,
            entropy_tokens=entropy_tokens,
        )
        for i in range(7):
            members = slice_ids == slice_ids[i]
            names = {
                "B": int(slice_rows[slice_ids[i]]),
                "GA": ga,
                "n_i": int(loss_tokens[i]),
                "n_slice": int(loss_tokens[members].sum()),
                "max_completion_length": max_completion,
                "N_items": n_items,
                "P": processes,
                "spg": spg,
                "e_slice": int(entropy_tokens[members].sum()),
                "max": max,
            }
            expected = eval(table[loss_type][1], {"__builtins__": {}}, names)  # noqa: S307 - our own docstring
            assert math.isclose(float(policy[i]), expected, rel_tol=1e-12), (loss_type, i)
            bonus = eval(table["entropy bonus"][1], {"__builtins__": {}}, names)  # noqa: S307
            assert math.isclose(float(entropy[i]), bonus, rel_tol=1e-12), (loss_type, i)


def test_unknown_loss_type_is_refused():
    settings = LossSettings("ppo", 0.0, 0.2, 0.2, None, "token", None, False, False, 1.0, 1.0, (2, 3, 3, 2), 12)
    with pytest.raises(ValueError, match="Unknown loss type: ppo"):
        sample_weights(
            settings,
            torch.tensor([1]),
            torch.tensor([0]),
            torch.tensor([1]),
            torch.tensor([1.0]),
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_processes=1,
        )
    with pytest.raises(ValueError, match="Unknown loss type: ppo"):
        per_token_policy_loss(settings, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1), None, None, None, None)
