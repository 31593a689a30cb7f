"""Specification of hf_dynbsz.execution.dpo_loss: DPO's per-pair losses and weights, and its per-slice metrics.

Checked against stock TRL, not against a formula written again: a real ``trl.DPOTrainer`` computes each micro-batch's
loss with its own ``_compute_loss`` (the Trainer divides it by the accumulation steps, as its ``loss_is_scaled_for_ga``
says) and logs its metrics; the step's pairs (:func:`dpo_step_batch`), their reference log-probs from packed no-grad
passes of the reference model and, for the sorted losses, their coefficients from a packed no-grad pass of the policy,
cut at random into packed passes of whole pairs (prefix-tree rows through segment attention, as the trainer runs them),
must give stock's total loss, gradients and logged metrics, for every loss type and setting. The pair arithmetic of
``dpo_loss.py``'s table is exercised through the same passes: a pair's sequence log-prob (LD-DPO's weights), its
scores, its losses, its weight ``1 / (B GA)``, the SFT term's token weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_dynbsz.execution.attention import segment_attention, use_segments
from hf_dynbsz.execution.dpo_loss import (
    METRIC_KEYS,
    DPOSettings,
    coupled_coefficients,
    dpo_pass_loss,
    dpo_step_batch,
    sequence_logps,
    sft_coefficients,
)
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.packing import build_microbatch
from hf_dynbsz.testing import (
    dpo_config,
    load_tokenizer,
    pair_step_outcome,
    pair_steps_against_stock,
    preference_pairs,
    stock_micro_batches,
    stock_pair_step,
    whole_pair_passes,
)

GA, PAIRS = 2, 4  # an optimizer step of 2 stock micro-batches of 4 pairs


def stock_trainer(model_dir, tmp_path, **fields):
    """A real stock DPOTrainer in training mode, its reference another model (so rewards are not all 0)."""
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.mul_(1.1)
    args = dpo_config(str(tmp_path), plugin=False, per_device_train_batch_size=PAIRS, gradient_accumulation_steps=GA,
                      gradient_checkpointing=False, **fields)  # fmt: skip
    trainer = DPOTrainer(
        model=model_dir,
        ref_model=reference,
        args=args,
        train_dataset=preference_pairs(GA * PAIRS, prompt=(2, 15), response=(1, 14), pairs_per_prompt=2, seed=3),
        processing_class=load_tokenizer(model_dir),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = GA
    return trainer


def micro_batches(trainer) -> list[dict]:
    return stock_micro_batches(trainer, GA, PAIRS)


def stock_step(trainer, window):
    """Stock's loss of the step (each micro-batch's ``_compute_loss`` / GA), its gradients and its logged metrics."""
    return stock_pair_step(trainer, window, lambda inputs: trainer._compute_loss(trainer.model, inputs, False) / GA)


def packed_outputs(model, table, indices, names):
    """The fused head's ``names`` outputs of one packed pass (prefix-tree rows through sdpa segment attention),
    completion-aligned."""
    mb = build_microbatch(
        table, indices, layout="padding_free", pad_token_id=0, attention="sdpa", keys=table.prefix_keys("tree")
    )
    unwrapped = model
    with segment_attention(unwrapped, True):
        use_segments(mb.segments)
        out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
        values = {name: mb.to_completion_layout(getattr(out, name).float() if name == "is_top1" else getattr(out, name))
                  for name in names}  # fmt: skip
    return mb, values


def no_grad_logps(model, batch, settings, seed):
    """Each sample's sequence log-prob from no-grad packed passes of ``model`` (their own random cut)."""
    seq = torch.zeros(len(batch))
    with torch.no_grad():
        for group in whole_pair_passes(len(batch), seed):
            _, values = packed_outputs(model, batch.table, group, ("log_probs",))
            rows = batch.rows(group, values["log_probs"].size(1))
            seq[group] = sequence_logps(values["log_probs"], rows.mask, rows.per_token["shared"], settings.ld_alpha)
    return seq


def our_step(trainer, window, seed):
    """Our loss of the step, its gradients and its metrics, from whole-pair packed passes cut at ``seed``."""
    settings = DPOSettings.from_trainer(trainer)
    batch = dpo_step_batch(window)
    pairs = batch.slice_rows.double()[batch.slice_ids] / 2
    batch.policy_weights = 1.0 / (pairs * GA)
    batch.entropy_weights = torch.zeros_like(batch.policy_weights)
    batch.per_token["ref_logps"] = no_grad_logps(trainer.ref_model, batch, settings, seed + 5).unsqueeze(1)
    sft = "sft" in settings.loss_types
    if sft:
        batch.per_token["sft"] = sft_coefficients(settings, batch, GA).unsqueeze(1)
    if settings.coupled:
        seq = no_grad_logps(trainer.model, batch, settings, seed + 7)
        coefficient, offset = coupled_coefficients(
            settings, seq, batch.per_token["ref_logps"].squeeze(1), batch.slice_ids, GA
        )
        batch.per_token["coefficient"], batch.per_token["offset"] = coefficient.unsqueeze(1), offset.unsqueeze(1)
    trainer.model.zero_grad()
    metrics = StepMetrics(GA, "cpu", METRIC_KEYS)
    total = 0.0
    for group in whole_pair_passes(len(batch), seed):
        mb, values = packed_outputs(trainer.model, batch.table, group, settings.outputs)
        rows = batch.rows(group, values["log_probs"].size(1))
        loss, pass_metrics = dpo_pass_loss(settings, values, rows, sft)
        loss.backward()
        total += loss.item()
        metrics.add_pass(0, 0, pass_metrics, values["entropy"].detach(), rows.mask, rows.slice_ids)
    return pair_step_outcome(trainer.model, total, metrics)


#: Metrics that are ``beta`` times a difference of sequence log-probs (stock's ``beta * (logps - ref_logps)``), with
#: the sides each difference takes.
REWARD_SIDES = {
    "rewards/chosen": ("chosen",),
    "rewards/rejected": ("rejected",),
    "rewards/margins": ("chosen", "rejected"),
}


def reward_rounding(key: str, slice_index: int, stock_metrics: dict, beta: float, window: list[dict]) -> float:
    """How far fp32 rounding alone can move a reward metric of slice ``slice_index`` (0 for other metrics).

    A reward is ``beta`` times the difference of two sequence log-probs (the policy's and the reference's), each a
    fp32 sum of up to ``n`` token log-probs that the packed pass adds in another order than stock's padded rows:
    pairwise summation bounds each sum's rounding by ``ceil(log2 n)`` ulps of its magnitude, and the difference
    cancels the magnitudes but not their rounding. The reference log-prob is not logged; it is ``logps - rewards /
    beta``. (With beta 0.7 and sums near -19, one ulp of each already exceeds an absolute 1e-6.)"""
    if key not in REWARD_SIDES:
        return 0.0
    longest = max(int(inputs["completion_mask"].sum(dim=1).max()) for inputs in window)
    roundings = math.ceil(math.log2(max(longest, 2)))
    eps = torch.finfo(torch.float32).eps
    bound = 0.0
    for side in REWARD_SIDES[key]:
        policy = stock_metrics[f"logps/{side}"][slice_index]
        reference = policy - stock_metrics[f"rewards/{side}"][slice_index] / beta
        bound += beta * roundings * eps * (abs(policy) + abs(reference))
    return bound


#: Every loss type (with what it needs) and the settings that change the pair arithmetic.
CASES = {
    "sigmoid": {},
    "hinge": dict(loss_type=["hinge"]),
    "ipo": dict(loss_type=["ipo"]),
    "exo_pair": dict(loss_type=["exo_pair"], label_smoothing=1e-3),
    "nca_pair": dict(loss_type=["nca_pair"]),
    "robust": dict(loss_type=["robust"], label_smoothing=0.2),
    "bco_pair": dict(loss_type=["bco_pair"]),
    "sppo_hard": dict(loss_type=["sppo_hard"]),
    "aot": dict(loss_type=["aot"], label_smoothing=0.1),
    "aot_unpaired": dict(loss_type=["aot_unpaired"]),
    "apo_zero": dict(loss_type=["apo_zero"]),
    "apo_down": dict(loss_type=["apo_down"]),
    "discopop": dict(loss_type=["discopop"], discopop_tau=0.3),
    "sft": dict(loss_type=["sft"]),
    "sigmoid_norm": dict(loss_type=["sigmoid_norm"]),
    "weighted_list": dict(loss_type=["sigmoid", "aot", "sft"], loss_weights=[0.5, 2.0, 0.3]),
    "ld_alpha": dict(loss_type=["sigmoid", "aot_unpaired"], ld_alpha=0.4),
    "use_weighting": dict(loss_type=["sigmoid", "ipo", "apo_down"], use_weighting=True),  # (hinge: below)
    "forward_kl": dict(f_divergence_type="forward_kl", loss_type=["sigmoid", "ipo"]),
    "js_divergence": dict(f_divergence_type="js_divergence"),
    "alpha_divergence": dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    "beta": dict(beta=0.7, loss_type=["sigmoid", "sppo_hard", "nca_pair"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_whole_pair_passes_give_stocks_loss_gradients_and_metrics(model_dir, tmp_path, case):
    trainer = stock_trainer(model_dir, tmp_path, **CASES[case])
    window = micro_batches(trainer)
    for metrics, stock_metrics in pair_steps_against_stock(trainer, window, stock_step, our_step):
        for key in ("entropy", *METRIC_KEYS):
            for k, (value, expected) in enumerate(zip(metrics[key], stock_metrics[key], strict=True)):
                atol = max(1e-6, reward_rounding(key, k, stock_metrics, trainer.beta, window))
                assert value == pytest.approx(expected, rel=1e-5, abs=atol), (key, k)


def test_a_step_of_pairs_keeps_each_pair_adjacent_and_together(model_dir, tmp_path):
    """:func:`dpo_step_batch`: chosen then rejected per pair, their ``together`` id shared, the prompt the tokens before
    the first scored one, stock's unshifted response length and LD-DPO's shared length per sample."""
    trainer = stock_trainer(model_dir, tmp_path)
    window = micro_batches(trainer)
    batch = dpo_step_batch(window, rank=1, num_processes=2)
    assert batch.table.together == [k // 2 for k in range(2 * GA * PAIRS)]
    assert batch.per_token["side"].squeeze(1).tolist() == [1.0, 0.0] * (GA * PAIRS)
    assert batch.slice_rows.tolist() == [0, 0, 2 * PAIRS, 2 * PAIRS]  # slices numbered over the processes
    for k, inputs in enumerate(window):
        for j in range(PAIRS):
            for side, row in enumerate((j, PAIRS + j)):
                i = 2 * (k * PAIRS + j) + side
                real = int(inputs["attention_mask"][row].sum())
                assert batch.table.tokens[i].tolist() == inputs["input_ids"][row, :real].tolist()
                scored = int(inputs["completion_mask"][row, 1:real].sum())
                assert int(batch.table.completion_lengths[i]) == scored == int(batch.loss_mask[i].sum())
                assert batch.per_token["response"][i, 0] == inputs["completion_mask"][row].sum()
            shared = min(int(batch.table.completion_lengths[2 * (k * PAIRS + j) + s]) for s in (0, 1))
            assert batch.per_token["shared"][2 * (k * PAIRS + j), 0] == shared
    assert batch.stock_microbatch_tokens == max(inputs["input_ids"].numel() for inputs in window)


def test_hinge_with_weighting_fails_in_stock_and_is_refused_here_before_any_work(model_dir, tmp_path):
    """TRL 1.16 scales the per-pair loss by the WPO weights in place (``per_sequence_loss *= ...``): on hinge's relu
    output, which its backward needs, stock's first backward fails. The plugin's passes would train it (they compute
    the same formula without writing over it), so drop-in means refusing it, at start: its config refuses it, and so
    does its trainer given stock's config, before any forward. (If stock ever trains it, compare the two here.)"""
    from trl import DPOConfig

    from hf_dynbsz import DynamicBatchDPOConfig, DynamicBatchDPOTrainer
    from hf_dynbsz.testing import CPU_RUN_FIELDS

    trainer = stock_trainer(model_dir, tmp_path, loss_type=["hinge"], use_weighting=True)
    window = micro_batches(trainer)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stock_step(trainer, window)
    refused = r"loss_type=\['sigmoid', 'hinge'\] with use_weighting=True: stock DPOTrainer .* Set use_weighting=False"
    fields = dict(output_dir=str(tmp_path), loss_type=["sigmoid", "hinge"], use_weighting=True, **CPU_RUN_FIELDS)
    with pytest.raises(ValueError, match=refused):
        DynamicBatchDPOConfig(**fields)
    forwards = []
    trainer.model.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=refused):
        DynamicBatchDPOTrainer(
            model=trainer.model, ref_model=trainer.ref_model, args=DPOConfig(**fields),
            train_dataset=preference_pairs(), processing_class=load_tokenizer(model_dir),
        )  # fmt: skip
    assert not forwards
