"""Specification of hf_dynbsz.execution.router_loss: stock's MoE router aux loss, repacked per sample, equals stock's.

Stock TRL adds, per fixed slice, ``coef x aux(slice) / GA`` with the load-balancing loss its fused LM head computes.
The plugin computes each sample's share of it in whatever pass the sample runs in, from the expert counts of its
stock slice (one no-grad router pass per optimizer step). Checked against stock: the value and gradients of one
slice's aux loss, split over passes; the parameters after training and the logged ``aux_loss`` with a coefficient
large enough that a mis-weighted aux loss shows; and a run whose samples take another slice's counts fails.
"""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution.attention import segment_attention, use_segments
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.execution.router_loss import RouterAuxLoss, captured_router_logits, router_statistics
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.testing import (
    PrefixRollout,
    RecordingReward,
    ScriptedRollout,
    base_config_kwargs,
    build_char_tokenizer,
    build_trainer,
    grpo_batch,
    prefix_batch,
    prompt_dataset,
    relative_difference,
    snapshot_parameters,
    update_difference,
)
from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

PAD = 0
#: Large enough that the aux loss moves the parameters far more than the tolerance (stock's default is 0.001).
COEF = 1.0
#: The plugin's trainer and config (``train``'s first two arguments).
PLUGIN = (DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig)


@pytest.mark.parametrize(
    ("model_type", "sharing"), [("qwen3_moe", "groups"), ("mixtral", "groups"), ("qwen3_moe", "tree")]
)
def test_one_slices_aux_loss_split_over_passes_has_stocks_value_and_gradient(model_type, sharing):
    """A stock slice of 6 samples (left-padded prompts, prompt groups): the aux loss TRL's fused head computes on its
    padded forward, against the plugin's: counts from one no-grad pass, then the per-sample terms of three
    padding-free passes with shared prompts, each holding some of the slice's samples. With a prefix tree the prompts
    also share a block, and each prompt's completions a trunk: a token routed once counts once per sample holding
    it, as stock computes it once per sample."""
    model = build_tiny_causal_lm_of_type(model_type)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    experts, top_k = model.config.num_experts if model_type != "mixtral" else model.config.num_local_experts, 2
    if sharing == "tree":
        batch = prefix_batch([7, 3, 11], [5, 9, 2, 14, 1, 6], [3, 2, 1], shared=6, trunk=3, token_high=60)
    else:
        batch = grpo_batch([7, 3, 11], [5, 9, 2, 14, 1, 6], [3, 2, 1], token_high=60)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None and "gate" in name}

    stock = model(
        input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, output_router_logits=True
    ).aux_loss
    expected = gradients(stock)

    table = SequenceTable.from_padded(prompt_ids, prompt_mask, completion_ids, completion_mask)
    keys = table.prefix_keys(sharing)
    aux = RouterAuxLoss(
        coef=1.0, num_experts=experts, top_k=top_k, num_slices=1, gradient_accumulation_steps=1, device="cpu"
    )

    def run(indices, grad):
        mb = build_microbatch(table, indices, layout="padding_free", pad_token_id=PAD, attention="sdpa", keys=keys)
        with segment_attention(model), captured_router_logits(model) as captured, torch.set_grad_enabled(grad):
            use_segments(mb.segments)
            model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True, output_router_logits=True)
        return mb, captured[-1]

    everyone = list(range(len(table)))
    mb, logits = run(everyone, grad=False)
    counts, _ = router_statistics(logits, *mb.token_rows, len(everyone), top_k, experts)
    tokens = torch.bincount(mb.token_rows[1], minlength=len(everyone)).double().unsqueeze(1)
    aux.add_counts(torch.zeros(len(everyone), dtype=torch.long), torch.cat([counts, tokens], 1))
    assert int(tokens.sum()) == int(attention_mask.sum())  # each sample counts its prompt, as stock's mask does
    assert mb.real_tokens < int(attention_mask.sum())  # though the pass routed shared tokens once
    total = torch.zeros(())
    for part in ([0, 3], [1, 4, 5], [2]):  # siblings split across passes
        mb, logits = run(part, grad=True)
        total = total + aux.term(logits, mb.token_rows, torch.zeros(len(part), dtype=torch.long))
    assert torch.allclose(total, stock, rtol=1e-5, atol=0)
    got = gradients(total)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-4, atol=1e-7), name


def train(trainer_cls, config_cls, model_type, output_dir, coef=COEF, prefixes=None, **overrides):
    """A run with the router aux loss; ``prefixes``: the rollout's prefix structure
    (:class:`~hf_dynbsz.testing.PrefixRollout`), None: prompts of their own."""
    lengths, prompt_length = (lambda rng, n, rank: rng.geometric(0.1, n)), (lambda rng: rng.integers(3, 12))
    scripted = dict(max_completion_length=24, seed=0, token_high=60)
    if prefixes is None:
        rollout = ScriptedRollout(lengths, prompt_length, **scripted)
    else:
        rollout = PrefixRollout(lengths, prompt_length, **scripted, **prefixes)
    model = build_tiny_causal_lm_of_type(model_type)
    args = config_cls(**base_config_kwargs(output_dir, router_aux_loss_coef=coef, **overrides))
    tokenizer, reward = build_char_tokenizer(), RecordingReward()
    trainer = build_trainer(
        args, model, tokenizer, dataset=prompt_dataset(), reward=reward, rollout=rollout, trainer_cls=trainer_cls
    )
    initial = snapshot_parameters(model)
    trainer.train()
    return initial, snapshot_parameters(trainer.model), trainer.state.log_history, trainer


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("model_type", "loss_type", "num_iterations"),
    [
        ("qwen3_moe", "grpo", 1),
        ("qwen3_moe", "dapo", 2),
        ("qwen3_moe", "bnpo", 1),
        ("mixtral", "dapo", 1),
        ("olmoe", "grpo", 2),
        ("gpt_oss", "bnpo", 1),
    ],
)
def test_training_with_the_router_aux_loss_equals_stock(model_type, loss_type, num_iterations, tmp_path):
    settings = dict(loss_type=loss_type, num_iterations=num_iterations, max_steps=3)
    initial, stock, stock_history, _ = train(GRPOTrainer, GRPOConfig, model_type, str(tmp_path / "s"), **settings)
    _, ours, history, trainer = train(
        *PLUGIN, model_type, str(tmp_path / "o"), max_tokens_per_microbatch=48, **settings
    )
    assert trainer._dynbsz.enabled and trainer._dynbsz.capabilities.router_aux
    assert trainer._dynbsz.scheduler.sharing  # padding-free rows with shared prompts
    assert any(entry.get("dynbsz/microbatches", 0) >= 2 for entry in history)  # really repacked
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    stock_aux = [entry["aux_loss"] for entry in stock_history if "aux_loss" in entry]
    our_aux = [entry["aux_loss"] for entry in history if "aux_loss" in entry]
    assert len(our_aux) == len(stock_aux) == 3 and our_aux == pytest.approx(stock_aux, rel=1e-5)


@pytest.mark.parametrize(("model_type", "loss_type"), [("qwen3_moe", "dapo"), ("olmoe", "grpo")])
def test_a_prefix_tree_with_the_router_aux_loss_equals_stock(model_type, loss_type, tmp_path):
    """share_prompt_prefix="tree" (trusted, no self-check) with a block every prompt begins with and completions
    sharing a trunk and branches: parameters and the logged aux loss are stock's."""
    prefixes = dict(shared=10, trunk=4, branches=2, branch=3)
    settings = dict(loss_type=loss_type, num_iterations=2, max_steps=3, prefixes=prefixes)
    initial, stock, stock_history, _ = train(GRPOTrainer, GRPOConfig, model_type, str(tmp_path / "s"), **settings)
    _, ours, history, trainer = train(
        *PLUGIN, model_type, str(tmp_path / "o"), max_tokens_per_microbatch=160, share_prompt_prefix="tree",
        self_check=False, **settings,
    )  # fmt: skip
    assert trainer._dynbsz.capabilities.router_aux and trainer._dynbsz.scheduler.sharing is SharePrefix.TREE
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert steps and all(step["dynbsz/tree_tokens_saved"] > 0 for step in steps)  # the block and trunks shared
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    stock_aux = [entry["aux_loss"] for entry in stock_history if "aux_loss" in entry]
    our_aux = [entry["aux_loss"] for entry in history if "aux_loss" in entry]
    assert len(our_aux) == len(stock_aux) == 3 and our_aux == pytest.approx(stock_aux, rel=1e-5)


def test_the_aux_loss_moves_the_parameters_and_a_wrong_slices_counts_are_caught(tmp_path, monkeypatch):
    """The comparison is sensitive: without the aux loss, or with each sample weighted by the next slice's counts,
    the parameters leave stock's by far more than the tolerance."""
    settings = dict(loss_type="dapo", max_steps=2)
    initial, stock, _, _ = train(GRPOTrainer, GRPOConfig, "qwen3_moe", str(tmp_path / "s"), **settings)
    _, without, _, _ = train(GRPOTrainer, GRPOConfig, "qwen3_moe", str(tmp_path / "n"), coef=0.0, **settings)
    assert update_difference(initial, without, stock) > 1e-2
    weights = RouterAuxLoss.weights
    monkeypatch.setattr(
        RouterAuxLoss, "weights", lambda self, slice_ids: weights(self, (slice_ids + 1) % self.counts.size(0))
    )
    _, wrong, _, _ = train(
        DynamicBatchGRPOTrainer,
        DynamicBatchGRPOConfig,
        "qwen3_moe",
        str(tmp_path / "w"),
        max_tokens_per_microbatch=48,
        **settings,
    )
    assert relative_difference(wrong, stock) > 1e-4
    assert update_difference(initial, wrong, stock) > 1e-3
