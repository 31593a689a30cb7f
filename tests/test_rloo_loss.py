"""Specification of hf_dynbsz.execution.rloo_loss: RLOO's per-sample loss and weights, and its per-slice metrics.

Checked against stock TRL, not against a formula written again: a real ``trl.RLOOTrainer`` computes each slice's loss
with its own ``_compute_loss`` (and the Trainer divides it by the accumulation steps, as its ``loss_is_scaled_for_ga``
says), and the sum of our weighted per-sample losses over the slice must equal it. Then the same samples are
re-partitioned at random into packed passes (the trainer's forward path): the total, and the logged entropy and clip
ratios, must not move. The weight row of ``rloo_loss.py``'s docstring is evaluated against the code.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict

import pytest
import torch
from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

from hf_dynbsz.execution import rloo_loss as rloo_module
from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.rloo_loss import METRIC_KEYS, RLOOSettings, rloo_pass_loss, rloo_sample_weights
from hf_dynbsz.testing import base_config_kwargs, random_passes, training_mode_trainer

SLICES, ROWS, GA = 3, 4, 3  # an optimizer step of 3 stock slices of 4 samples
MAX_COMPLETION = 12
#: The slices' step: GA slices of ROWS samples (2 completions per prompt) per optimizer step.
STEP = dict(gradient_accumulation_steps=GA, steps_per_generation=GA, per_device_train_batch_size=ROWS)
STEP.update(max_completion_length=MAX_COMPLETION, num_generations=2)
METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max")


def stock_trainer(model_dir, tmp_path, **config) -> RLOOTrainer:
    """A real stock trainer in training mode, its accumulation count set as the Trainer loop sets it."""
    config = {**STEP, "beta": 0.0, **config}
    return training_mode_trainer(RLOOConfig(**base_config_kwargs(str(tmp_path), **config)), model_dir, GA)


def completion_logps(trainer, inputs):
    """Stock's per-token log-probs and entropies of a slice (its own forward, gradients on)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True
    )
    return logps, entropies


def make_slices(trainer, *, seed=0, noise=0.6):
    """Stock-shaped slices (left-padded prompts, right-padded completions, some empty) as RLOO's ``_prepare_inputs``
    gives them, their summed old log-probs moved off the current ones by ``noise`` so that ratios clip both ways."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    slices = []
    for _ in range(SLICES):
        prompt_lengths = torch.randint(1, 9, (ROWS,), generator=generator)
        completion_lengths = torch.randint(0, MAX_COMPLETION + 1, (ROWS,), generator=generator)
        completion_lengths[0] = MAX_COMPLETION  # every slice as wide as the round
        prompt_mask = (torch.arange(8) >= 8 - prompt_lengths.unsqueeze(1)).long()
        completion_mask = (torch.arange(MAX_COMPLETION) < completion_lengths.unsqueeze(1)).long()
        inputs = {
            "prompt_ids": torch.randint(3, vocab, (ROWS, 8), generator=generator) * prompt_mask,
            "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(3, vocab, (ROWS, MAX_COMPLETION), generator=generator) * completion_mask,
            "completion_mask": completion_mask,
            "advantages": torch.randn(ROWS, generator=generator),
        }
        with torch.no_grad():
            logps, _ = completion_logps(trainer, inputs)
        inputs["old_logps"] = (logps * completion_mask).sum(1) + noise * torch.randn(ROWS, generator=generator)
        slices.append(inputs)
    return slices


def prepare(slices) -> StepBatch:
    batch = StepBatch.from_slices(slices)
    batch.policy_weights = rloo_sample_weights(batch.slice_ids, batch.slice_rows, gradient_accumulation_steps=GA)
    batch.entropy_weights = torch.zeros_like(batch.policy_weights)
    return batch


def stock_slice_losses(trainer, slices):
    """Each slice's loss as stock's Trainer backpropagates it: ``_compute_loss``, divided by GA unless the trainer
    says its loss is scaled for gradient accumulation."""
    losses = torch.stack([trainer._compute_loss(trainer.model, inputs) for inputs in slices])
    return losses if trainer.loss_is_scaled_for_ga else losses / GA


# ---- against stock --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_weights_reproduce_stock_slice_losses(model_dir, tmp_path, epsilon_high):
    trainer = stock_trainer(model_dir, tmp_path, epsilon=0.2, epsilon_high=epsilon_high)
    slices = make_slices(trainer)
    batch = prepare(slices)
    settings = RLOOSettings.from_trainer(trainer)
    ours, clipped = [], 0.0
    for slice_id, inputs in enumerate(slices):
        logps, _ = completion_logps(trainer, inputs)
        rows = batch.rows(list(range(slice_id * ROWS, (slice_id + 1) * ROWS)), logps.size(1))
        loss, metrics = rloo_pass_loss(settings, logps, rows)
        ours.append(loss)
        clipped += float(metrics["clip_ratio/low"].sum() + metrics["clip_ratio/high"].sum())
    stock = stock_slice_losses(trainer, slices)
    assert torch.allclose(torch.stack(ours), stock, rtol=1e-5, atol=1e-7), (ours, stock)
    assert stock.abs().min() > 1e-4  # a comparison of zeros would prove nothing
    assert 0 < clipped < SLICES * ROWS  # some sequences are clipped, not all


def test_rloo_loss_is_not_scaled_for_gradient_accumulation_by_stock():
    """What the weights' 1/GA stands for: the Trainer divides RLOO's loss (GRPO scales its own)."""
    assert RLOOTrainer.loss_is_scaled_for_ga is False
    assert GRPOTrainer.loss_is_scaled_for_ga is True


@pytest.mark.parametrize("layout", ["padding_free", "padded"])
def test_any_repartition_into_packed_passes_gives_stocks_total_and_metrics(model_dir, tmp_path, layout):
    trainer = stock_trainer(model_dir, tmp_path)
    slices = make_slices(trainer, seed=1)
    batch = prepare(slices)
    trainer._metrics["train"].clear()
    stock_total = stock_slice_losses(trainer, slices).sum()
    stock_metrics = {name: trainer._metrics["train"][name] for name in METRICS}
    settings = RLOOSettings.from_trainer(trainer)
    for seed in range(2):
        total, metrics = 0.0, StepMetrics(SLICES, "cpu", METRIC_KEYS)
        for mb, logps, entropies, rows in random_passes(trainer.model, batch, layout, seed):
            loss, loss_metrics = rloo_pass_loss(settings, logps, rows)
            metrics.add_pass(mb.real_tokens, mb.computed_tokens, loss_metrics, entropies, rows.mask, rows.slice_ids)
            total = total + loss
        assert float(total.detach()) == pytest.approx(float(stock_total.detach()), rel=2e-5, abs=1e-7)
        store = defaultdict(list)
        metrics.publish_slices(store)
        for name in METRICS:  # one entry per stock slice, as stock's _compute_loss logs them
            assert store[name] == pytest.approx(stock_metrics[name], rel=1e-5, abs=1e-7), name
    assert 0 < sum(stock_metrics["clip_ratio/low_mean"]) + sum(stock_metrics["clip_ratio/high_mean"])


def test_slice_extremes_are_per_slice_not_per_step():
    """Stock logs each slice's extreme: a step whose one slice has every sequence clipped low logs low_min 1 for that
    slice and 0 for the others (a step-wide minimum would log 0)."""
    metrics = StepMetrics(2, "cpu", METRIC_KEYS)
    low, high = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    loss_metrics = {"clip_ratio/low": low, "clip_ratio/high": high}
    metrics.add_pass(6, 6, loss_metrics, torch.ones(3, 2), torch.ones(3, 2), torch.tensor([0, 0, 1]))
    store = defaultdict(list)
    metrics.publish_slices(store)
    assert store["clip_ratio/low_min"] == [1.0, 0.0]
    assert store["clip_ratio/high_max"] == [0.0, 1.0]
    assert store["clip_ratio/region_mean"] == [1.0, 1.0]


# ---- the documented table is what the code does ---------------------------------------------------------------
def documented_weight() -> str:
    """The weight expression of the ``weight of sample i`` row of rloo_loss.py's docstring table."""
    row = next(line for line in inspect.getdoc(rloo_module).splitlines() if line.startswith("weight of sample i"))
    return row.removeprefix("weight of sample i").strip()


def test_documented_weight_is_what_rloo_sample_weights_computes():
    slice_ids, slice_rows = torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([3, 2, 1])
    weights = rloo_sample_weights(slice_ids, slice_rows, gradient_accumulation_steps=4)
    expression = documented_weight()
    for i in range(len(slice_ids)):
        names = {"B": int(slice_rows[slice_ids[i]]), "GA": 4}
        expected = eval(expression.replace("B GA", "B * GA"), {"__builtins__": {}}, names)  # noqa: S307 - our docstring
        assert math.isclose(float(weights[i]), expected, rel_tol=1e-12), i
