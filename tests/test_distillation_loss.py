"""Specification of hf_dynbsz.execution.distillation_loss: the table of its docstring against stock's own
``DistillationTrainer._compute_loss``.

A slice of four padded rows (prompts of different lengths, one completion empty) is scored by stock and, sample by
sample in packed rows, by :func:`pass_divergence` with the weights of :func:`distillation_sample_weights`: the loss and
every parameter's gradient must be stock's, for each ``beta`` and temperatures on both sides of 1, with the
normaliser of one process and of a share of two. (The per-slice entropy it logs: ``tests/test_metrics.py``.)
"""

from __future__ import annotations

import pytest
import torch

from hf_dynbsz.execution.batch import SampleRows
from hf_dynbsz.execution.distillation_loss import (
    DivergenceSettings,
    backbone_hidden_states,
    distillation_pass_loss,
    distillation_sample_weights,
    logit_scale,
    pass_divergence,
)
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.testing import distillation_trainer

PROMPTS = [[3, 4, 5], [6, 5, 4, 3, 6, 5], [4], [5, 6, 3, 4]]
COMPLETIONS = [[4, 4, 6, 1], [3], [5, 6, 4, 3, 5, 6, 1], []]


def padded_slice(num_items: int) -> dict:
    """Stock's inputs of one slice: prompts left-padded, completions right-padded (pad id 0)."""
    width_p, width_c = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[0] * (width_p - len(p)) + p for p in PROMPTS])
    completion_ids = torch.tensor([c + [0] * (width_c - len(c)) for c in COMPLETIONS])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": (torch.arange(width_p) >= torch.tensor([width_p - len(p) for p in PROMPTS])[:, None]).long(),
        "completion_ids": completion_ids,
        "completion_mask": (torch.arange(width_c) < torch.tensor([len(c) for c in COMPLETIONS])[:, None]).long(),
        "num_items_in_batch": torch.tensor(num_items),
    }


@pytest.fixture(scope="module")
def trainer(model_dir, tmp_path_factory):
    """A stock DistillationTrainer (its ``beta`` and ``temperature`` set per test: ``_compute_loss`` reads them)."""
    return distillation_trainer("distillation_stock", str(tmp_path_factory.mktemp("out")), model_dir=model_dir)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def ours(trainer, inputs: dict, num_processes: int) -> torch.Tensor:
    """The slice's loss as the plugin computes it: every sample in a pass of its own (a padding-free row), weighted
    ``P / N``, summed (and backpropagated)."""
    student, teacher = trainer.model, trainer.teacher_model
    settings = DivergenceSettings.of(trainer.beta, trainer.temperature, student.config, teacher.config)
    table = SequenceTable.from_padded(
        inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
    )
    weights = distillation_sample_weights(inputs["num_items_in_batch"].expand(len(table)).float(), num_processes)
    total = torch.zeros(())
    for index in range(len(table)):
        mb = build_microbatch(table, [index], layout="padding_free", pad_token_id=0)
        valid = mb.completion_mask.bool()
        with torch.no_grad():
            teacher_hidden = backbone_hidden_states(teacher, mb.model_inputs).reshape(-1, teacher.config.hidden_size)
        divergence, _ = pass_divergence(
            settings, student, teacher, mb.model_inputs, mb.gather_index[valid], teacher_hidden[mb.gather_index[valid]]
        )
        per_token = torch.zeros(valid.shape).masked_scatter(valid, divergence)
        rows = SampleRows(
            mask=mb.completion_mask, advantages=torch.zeros(1), per_token={}, entropy_mask=None,
            bonus_mask=mb.completion_mask, policy_weights=weights[[index]], entropy_weights=torch.zeros(1),
            slice_ids=torch.zeros(1, dtype=torch.long),
        )  # fmt: skip
        loss, _ = distillation_pass_loss(per_token, rows)
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 1.4])
@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_loss_and_gradients_of_a_slice_are_stocks(trainer, beta, temperature, num_processes):
    trainer.beta, trainer.temperature = beta, temperature
    global_items = 30 * num_processes  # the loss tokens of every process's slices (this slice has 12)
    inputs = padded_slice(global_items)
    stock_loss, entropy_sum, tokens = trainer._compute_loss(trainer.model, inputs, global_items / num_processes)
    stock_loss.backward()
    stock = gradients(trainer.model)
    loss = ours(trainer, inputs, num_processes)
    assert float(tokens) == 12 and float(entropy_sum) > 0
    # a divergence near 0 (a tiny model's near-uniform distributions) is a difference of terms near 2: fp32 rounding
    # of the packed rows' logits shows at 1e-6 of it
    assert float(loss) == pytest.approx(float(stock_loss), rel=1e-5)
    ours_gradients = gradients(trainer.model)
    assert set(ours_gradients) == set(stock)
    for name, expected in stock.items():
        scale = float(expected.abs().max()) or 1.0
        assert torch.allclose(ours_gradients[name], expected, rtol=1e-5, atol=1e-6 * scale), name


def test_the_weight_of_a_token_is_the_processes_over_the_global_loss_tokens():
    weights = distillation_sample_weights(torch.tensor([40.0, 40.0, 0.0]), num_processes=4)
    assert weights.dtype == torch.float64
    assert weights.tolist() == [0.1, 0.1, 4.0]  # N = 0 is read as 1, as stock clamps it


def test_the_logit_scale_is_read_as_stock_reads_it():
    from types import SimpleNamespace

    def config(**fields):
        return SimpleNamespace(model_type=fields.pop("model_type", "llama"), **fields)

    assert logit_scale(config()) == 1.0
    assert logit_scale(config(logit_scale=0.25, output_multiplier=3.0)) == 0.25
    assert logit_scale(config(output_multiplier=3.0)) == 3.0
    assert logit_scale(config(lm_head_multiplier=2.0)) == 2.0
    assert logit_scale(config(logits_scaling=4.0)) == 0.25  # Granite, MiniCPM3: a divisor
    assert logit_scale(config(logits_scaling=4.0, model_type="hyperclovax")) == 4.0
