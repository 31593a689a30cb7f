"""Specification of hf_dynbsz.execution.reward_loss: a reward model's per-pair loss and weights, its passes' rewards
and its per-slice metrics.

Checked against stock TRL, not against a formula written again: a real ``trl.RewardTrainer`` computes each
micro-batch's loss with its own ``compute_loss`` (divided by the accumulation steps, as the Trainer divides it) and
logs its metrics; the step's pairs (:func:`reward_step_batch`), cut at random into packed passes of whole pairs
(prefix-tree rows through segment attention, as the trainer runs them), each sequence's reward read from the score
head's output at its own last position (:func:`read_positions`), must give stock's total loss, gradients and logged
metrics, with and without margins and the centering term.
"""

from __future__ import annotations

import pytest
import torch

from hf_dynbsz.execution.attention import segment_attention, use_segments
from hf_dynbsz.execution.packing import build_microbatch
from hf_dynbsz.execution.reward_loss import (
    RewardMetrics,
    RewardSettings,
    captured_scores,
    read_position,
    read_positions,
    reward_pass_loss,
    reward_step_batch,
)
from hf_dynbsz.testing import load_tokenizer, preference, preference_pairs
from hf_dynbsz.testing.reward import reward_config, reward_model

GA, PAIRS = 2, 4  # an optimizer step of 2 stock micro-batches of 4 pairs


def stock_trainer(model_dir, tmp_path, margins: bool, **fields):
    """A real stock RewardTrainer in training mode, on pairs sharing prompts two by two (with a margin column)."""
    from trl import RewardTrainer

    dataset = preference_pairs(GA * PAIRS, prompt=(2, 15), response=(1, 14), pairs_per_prompt=2, seed=3)
    if margins:
        dataset = dataset.add_column("margin", [0.5 * k - 1.0 for k in range(len(dataset))])
    args = reward_config(str(tmp_path), plugin=False, per_device_train_batch_size=PAIRS, gradient_accumulation_steps=GA,
                         gradient_checkpointing=False, **fields)  # fmt: skip
    trainer = RewardTrainer(
        model=reward_model(model_dir), args=args, train_dataset=dataset, processing_class=load_tokenizer(model_dir)
    )
    with torch.no_grad():  # rewards far from 0 (the fresh head's are ~1e-2): the metrics compare real values
        trainer.model.score.weight.mul_(30.0)
    trainer.model.train()
    return trainer


def micro_batches(trainer) -> list[dict]:
    return preference.stock_micro_batches(trainer, GA, PAIRS)


def stock_step(trainer, window):
    """Stock's loss of the step (each micro-batch's ``compute_loss`` / GA), its gradients and its logged metrics."""
    return preference.stock_pair_step(
        trainer, window, lambda inputs: trainer.compute_loss(trainer.model, dict(inputs)) / GA
    )


def our_step(trainer, window, seed: int):
    """Our loss of the step, its gradients and its metrics, from whole-pair packed passes cut at ``seed``."""
    settings = RewardSettings.from_trainer(trainer)
    batch = reward_step_batch(window, trainer.processing_class.pad_token_id)
    batch.policy_weights = 1.0 / (batch.slice_rows.double()[batch.slice_ids] / 2 * GA)
    batch.entropy_weights = torch.zeros_like(batch.policy_weights)
    model = trainer.model
    model.zero_grad()
    metrics, total = RewardMetrics(GA, "cpu"), 0.0
    for group in preference.whole_pair_passes(len(batch), seed):
        mb = build_microbatch(batch.table, group, layout="padding_free", pad_token_id=0, attention="sdpa",
                              keys=batch.table.prefix_keys("tree"))  # fmt: skip
        with segment_attention(model, True), captured_scores(model) as captured:
            use_segments(mb.segments)
            model(**mb.model_inputs, use_cache=False)
            rewards = captured[-1].reshape(-1)[read_positions(mb)]
            rows = batch.rows(group, mb.gather_index.size(1))
            loss, pass_metrics = reward_pass_loss(settings, rewards, rows)
            loss.backward()
        total += loss.item()
        metrics.add_pass(0, 0, pass_metrics, None, rows.mask, rows.slice_ids)
    return preference.pair_step_outcome(model, total, metrics)


CASES = {
    "bradley_terry": dict(margins=False),
    "margin": dict(margins=True),
    "center_rewards": dict(margins=False, center_rewards_coefficient=0.1),
    "margin_and_center_rewards": dict(margins=True, center_rewards_coefficient=0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_whole_pair_passes_give_stocks_loss_gradients_and_metrics(model_dir, tmp_path, case):
    trainer = stock_trainer(model_dir, tmp_path, **CASES[case])
    window = micro_batches(trainer)
    for metrics, stock_metrics in preference.pair_steps_against_stock(trainer, window, stock_step, our_step):
        for key in ("min_reward", "mean_reward", "max_reward", "accuracy", "margin"):
            assert metrics[key] == pytest.approx(stock_metrics[key], rel=1e-5, abs=1e-6), key


def test_a_step_of_pairs_keeps_each_pair_adjacent_and_cut_after_its_read_token(model_dir, tmp_path):
    """:func:`reward_step_batch`: chosen then rejected per pair, their ``together`` id shared, each sequence its row's
    tokens through its read position, its prompt the prefix the pair shares, the row's attention-mask tokens kept."""
    trainer = stock_trainer(model_dir, tmp_path, margins=True)
    window = micro_batches(trainer)
    batch = reward_step_batch(window, trainer.processing_class.pad_token_id, rank=1, num_processes=2)
    assert batch.table.together == [k // 2 for k in range(2 * GA * PAIRS)]
    assert batch.per_token["side"].squeeze(1).tolist() == [1.0, 0.0] * (GA * PAIRS)
    assert batch.slice_rows.tolist() == [0, 0, 2 * PAIRS, 2 * PAIRS]  # slices numbered over the processes
    for k, inputs in enumerate(window):
        for j in range(PAIRS):
            chosen, rejected = (batch.table.tokens[2 * (k * PAIRS + j) + side] for side in (0, 1))
            prompt = int(batch.table.prompt_lengths[2 * (k * PAIRS + j)])
            assert chosen[:prompt].tolist() == rejected[:prompt].tolist()
            assert prompt == min(len(chosen), len(rejected)) or chosen[prompt] != rejected[prompt]
            for side, row in enumerate((j, PAIRS + j)):
                i = 2 * (k * PAIRS + j) + side
                real = int(inputs["attention_mask"][row].sum())
                assert batch.table.tokens[i].tolist() == inputs["input_ids"][row, :real].tolist()  # pad != eos
                assert batch.per_token["tokens"][i, 0] == real
                assert batch.per_token["margin"][i, 0] == pytest.approx(float(inputs["margin"][j]))
    assert batch.stock_microbatch_tokens == max(inputs["input_ids"].numel() for inputs in window)


@pytest.mark.parametrize(
    "ids, real, pad, expected",
    [([5, 6, 7, 0, 0], 3, 0, 2), ([5, 1, 6, 1], 4, 1, 2), ([1, 1], 2, 1, 0), ([5, 6], 2, None, 1)],
    ids=["right_padding", "pad_inside", "all_pad", "no_pad_token"],
)
def test_read_position_is_stocks_rightmost_token_that_is_not_padding(ids, real, pad, expected):
    assert read_position(torch.tensor(ids), real, pad) == expected
