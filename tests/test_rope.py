"""Rotary embeddings that depend on the forward's width: LongRoPE exact per sample, dynamic NTK refused at start.

Specification of :mod:`hf_dynbsz.execution.rope` (each token takes the LongRoPE factors of the stock micro-batch that
holds its sample), of the rope widths a sample carries (:func:`~hf_dynbsz.planning.model_support.rope_width`, read
from stock's padded width, moved with the sample, splitting prompt groups and prefix trees) and of the trainer on tiny
Llama and Phi-3 models with LongRoPE: parameters after training equal stock GRPOTrainer's when steps cross the
original length after a first step that does not (the self-check passes on that first step), when no step crosses,
and when one generation round of a step crosses and the other does not. A dynamic-NTK model trains stock's math,
with the reason logged once.
"""

from __future__ import annotations

import logging

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.execution.rope import stock_rope, use_rope_widths
from hf_dynbsz.planning.model_support import ModelSupport, rope_width
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.testing import (
    ScriptedRollout,
    build_tiny_rope_lm,
    relative_difference,
    run_training,
    save_tiny_model,
    update_difference,
)
from hf_dynbsz.testing.fixtures import TEST_ALPHABET, build_char_tokenizer

ORIGINAL = 64  # llama_longrope's original_max_position_embeddings (phi3_longrope's: 48)


# ---------------------------------------------------------------------------------------------- what is decided
def test_a_samples_rope_width_is_the_least_width_past_the_same_original_lengths():
    assert rope_width(40, (64,)) == 0  # stock's forward of width 40 takes the short factors
    assert rope_width(64, (64,)) == 0  # max(position_ids) + 1 = 64 is not past 64
    assert rope_width(65, (64,)) == rope_width(300, (64,)) == 65  # the long factors, whatever the width past
    assert [rope_width(w, (48, 64)) for w in (40, 50, 64, 70)] == [0, 49, 49, 65]  # a student's and a teacher's


def test_longrope_is_read_from_the_config_and_dynamic_ntk_is_refused_at_start():
    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    for family, original in (("llama", 64), ("phi3", 48)):
        support = ModelSupport.of(model=build_tiny_rope_lm(tokenizer, family=family, original=original))
        assert support.long_rope == (original,) and support.repacking_blocker is None
        assert support.layouts()[0][0].sharing is SharePrefix.TREE  # every layout stays available
    dynamic = ModelSupport.of(model=build_tiny_rope_lm(tokenizer, rope_type="dynamic"))
    layouts, notes = dynamic.layouts()
    assert layouts == [] and dynamic.long_rope == ()
    assert notes == [f"dynamic batching is off, stock TRL math runs: {dynamic.repacking_blocker}"]
    assert "dynamic NTK (rope_type='dynamic')" in notes[0]
    assert ModelSupport.of(build_tiny_rope_lm(tokenizer).config).long_rope == (64,)  # the planner, from the config


def test_a_longrope_config_whose_modules_are_not_dynamic_rope_update_trains_stock_math():
    model = build_tiny_rope_lm(build_char_tokenizer(TEST_ALPHABET))
    model.model.rotary_emb.rope_type = "default"  # as a model with a rotary embedding of its own would read
    support = ModelSupport.of(model=model)
    assert "no rotary module picks its factors through transformers' dynamic_rope_update" in support.repacking_blocker
    assert support.layouts()[0] == []


# ---------------------------------------------------------------------------------------------- each token's factors
def rotary(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.size(-1), model.config.hidden_size)
    return model.model.rotary_emb(x, positions)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_each_token_takes_the_factors_of_its_samples_stock_width(family):
    """A row of two samples, positions 0..29 each, of stock widths 40 (short factors) and 100 (long): inside
    stock_rope the first sample's cos/sin are the model's own in a forward 30 wide, the second's those of a forward
    whose widest position passes the original length; outside it, the model's own pick for the row."""
    model = build_tiny_rope_lm(build_char_tokenizer(TEST_ALPHABET), family=family, original=ORIGINAL)
    positions = torch.arange(30).repeat(2).unsqueeze(0)
    short = rotary(model, torch.arange(30).unsqueeze(0))
    long = [value[:, :30] for value in rotary(model, torch.arange(ORIGINAL + 1).unsqueeze(0))]
    widths = torch.tensor([0] * 30 + [ORIGINAL + 1] * 30).unsqueeze(0)
    with stock_rope(model):
        use_rope_widths(widths)
        cos, sin = rotary(model, positions)
        use_rope_widths(None)
        own = rotary(model, positions)
    assert torch.equal(cos[:, :30], short[0]) and torch.equal(sin[:, :30], short[1])
    assert torch.equal(cos[:, 30:], long[0]) and torch.equal(sin[:, 30:], long[1])
    assert not torch.allclose(long[0], short[0])  # the factors differ
    assert torch.equal(own[0][:, 30:], short[0])  # the row alone picks the short factors for both
    assert "forward" not in vars(model.model.rotary_emb)  # the model's own module again


def long_rope_table(widths: list[int]) -> SequenceTable:
    """Four samples, two of each prompt, with the rope widths ``widths`` (one per sample)."""
    prompts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 6, 8]])
    completions = torch.tensor([[3, 4], [3, 9], [3, 4], [3, 4]])
    table = SequenceTable.from_padded(prompts, torch.ones_like(prompts), completions, torch.ones_like(completions))
    table.rope_widths = torch.tensor(widths)
    return table


def test_samples_of_other_rope_widths_share_no_position():
    table = long_rope_table([0, 65, 0, 0])
    assert table.prompt_groups() == [0, 1, 2, 2]  # the same prompt, other factors: another prompt
    # samples 2 and 3 are one path; sample 0 shares its first position with them (a key is a token and the next);
    # sample 1, of the long factors, shares nothing with sample 0 though their first four tokens are the same
    assert table.prefix_tree("tree").tokens() == 5 + 5 + 4
    # all of one width: samples 0 and 1 share [5 6 7] too, long or short
    assert long_rope_table([0, 0, 0, 0]).prefix_tree("tree").tokens() == 3 + 2 + 2 + 4
    assert long_rope_table([65, 65, 65, 65]).prefix_tree("tree").tokens() == 3 + 2 + 2 + 4
    other_first = long_rope_table([65, 65, 65, 65])
    other_first.tokens[2] = torch.tensor([9, 6, 8, 3, 4])  # another first token: nothing shared
    assert other_first.prefix_tree("tree").tokens() == 3 + 2 + 2 + 4 + 5  # sample 3 shares [5] with 0 and 1


def test_a_table_carries_the_rope_width_of_stocks_padded_width():
    def table(prompt_width: int, long_rope=()) -> SequenceTable:
        prompts, completions = torch.full((1, prompt_width), 5), torch.full((1, 5), 3)
        mask = torch.ones(1, prompt_width)
        mask[0, :2] = 0  # left padding counts: stock's forward runs the padded width
        return SequenceTable.from_padded(prompts, mask, completions, torch.ones(1, 5), long_rope=long_rope)

    assert table(60).rope_widths is None  # no LongRoPE model
    assert table(59, (64,)).rope_widths.tolist() == [0]  # 59 + 5 = 64, not past 64
    assert table(60, (64,)).rope_widths.tolist() == [65]


@pytest.mark.parametrize("layout", ["padding_free", "padded"])
def test_a_micro_batch_names_each_positions_rope_width(layout):
    table = long_rope_table([0, 65, 0, 65])
    keys = table.prefix_keys("tree") if layout == "padding_free" else None
    mb = build_microbatch(
        table, [0, 1, 2, 3], layout=layout, pad_token_id=0, attention="sdpa" if keys else None, keys=keys,
        pad_to_multiple_of=8,
    )  # fmt: skip
    widths = mb.rope_widths
    assert widths.shape == mb.model_inputs["input_ids"].shape
    flat, (positions, rows) = widths.reshape(-1), mb.token_rows
    for row, sample in enumerate(mb.indices):  # every position a sample counts carries its width
        assert set(flat[positions[rows == row]].tolist()) == {int(table.rope_widths[sample])}
    if layout == "padding_free":  # the rounding padding: 0
        assert flat[mb.real_tokens :].tolist() == [0] * (mb.computed_tokens - mb.real_tokens)


# ---------------------------------------------------------------------------------------------- against stock TRL
class RoundLengths:
    """Completion lengths per generation round: the first ``short_rounds`` rounds 2-30 tokens (their stock width
    stays under the original length), then 2-30 with a ``crossing`` share of 70-120 (the round's stock width passes
    it). Each trainer gets its own (rounds counted per trainer)."""

    def __init__(self, short_rounds: int, crossing: float):
        self.short_rounds, self.crossing, self.rounds = short_rounds, crossing, 0

    def __call__(self, rng, n, rank):
        lengths = rng.integers(2, 31, n)
        if self.rounds >= self.short_rounds:
            long = rng.random(n) < self.crossing
            lengths[long] = rng.integers(70, 121, int(long.sum()))
        self.rounds += 1
        return lengths


def rope_rollout(short_rounds: int, crossing: float) -> ScriptedRollout:
    return ScriptedRollout(
        RoundLengths(short_rounds, crossing), lambda rng: rng.integers(3, 11), max_completion_length=120, seed=3
    )


#: Each stock slice is its own generation round (steps_per_generation=1): a step holds two rounds, each of its own
#: stock width, so a step's passes mix samples of both rope widths.
ROUND_PER_SLICE = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=1, num_generations=4
)


@pytest.fixture(scope="module", params=["llama_longrope", "phi3_longrope"])
def long_rope_model(request, tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp(request.param)), architecture=request.param)


def crossing_rounds(rollout: ScriptedRollout, original: int) -> list[bool]:
    """Per generation round of ``rollout``, whether stock's width (longest prompt + longest completion) passed
    ``original``."""
    return [max(p for p, _ in r["lengths"]) + max(c for _, c in r["lengths"]) > original for r in rollout.rounds]


def compare(model_dir, tmp_path, rollout, **overrides) -> tuple[list[dict], list[bool]]:
    """Stock and ours (budget 120 tokens) on ``rollout()``'s rounds: the same completions and parameters, every step
    repacked. Returns ours's repacked steps' logs and, per round, whether it crossed the original length."""
    settings = {**ROUND_PER_SLICE, "max_completion_length": 120, "max_steps": 4, "beta": 0.1, **overrides}
    init, stock, stock_completions, _ = run_training(
        GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "stock"), trainer_kwargs={"rollout_func": rollout()},
        **settings,
    )  # fmt: skip
    ours_rollout = rollout()
    _, ours, completions, history = run_training(
        DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, model_dir, str(tmp_path / "ours"),
        trainer_kwargs={"rollout_func": ours_rollout}, max_tokens_per_microbatch=120, **settings,
    )  # fmt: skip
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(init, ours, stock) <= 1e-3
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert len(steps) == settings["max_steps"]  # every step repacked
    from transformers import AutoConfig

    original = AutoConfig.from_pretrained(model_dir).rope_parameters["original_max_position_embeddings"]
    return steps, crossing_rounds(ours_rollout, original)


def test_steps_that_cross_the_original_length_after_a_clean_first_step_match_stock(long_rope_model, tmp_path, caplog):
    """The first step's two rounds stay under the original length (the self-check runs on them and passes); the later
    rounds have ~20% of completions that take their round's stock width past it, and a step's two rounds may differ."""
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        steps, crossed = compare(long_rope_model, tmp_path, lambda: rope_rollout(short_rounds=2, crossing=0.2))
    assert "self-check passed" in caplog.text
    assert crossed[:2] == [False, False]  # the first step (its two rounds): under the original length
    steps_crossing = [crossed[round_] + crossed[round_ + 1] for round_ in range(2, len(crossed), 2)]
    assert 1 in steps_crossing and 2 in steps_crossing  # a step of each rope width, and a step of both
    assert max(step["dynbsz/microbatches"] for step in steps) > 2  # more passes than stock's slices: repacked


def test_steps_that_never_cross_match_stock(long_rope_model, tmp_path):
    _, crossed = compare(long_rope_model, tmp_path, lambda: rope_rollout(short_rounds=10, crossing=0.0), max_steps=2)
    assert not any(crossed)


def test_a_first_step_that_crosses_keeps_the_check_clean_and_matches_stock(long_rope_model, tmp_path, caplog):
    """Rounds that cross from the first step on: the self-check compares each sample alone with the factors of its
    stock micro-batch, as the passes run it, and passes."""
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        _, crossed = compare(long_rope_model, tmp_path, lambda: rope_rollout(short_rounds=0, crossing=0.3), max_steps=2)
    assert crossed[0] or crossed[1]
    assert "self-check passed" in caplog.text


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("llama_dynamic")), architecture="llama_dynamic")


def test_a_dynamic_ntk_model_trains_stock_math_with_the_reason_logged(dynamic_model, tmp_path, caplog):
    rollout = lambda: rope_rollout(short_rounds=1, crossing=0.3)  # noqa: E731
    settings = dict(ROUND_PER_SLICE, max_completion_length=120, max_steps=2)
    init, stock, stock_completions, _ = run_training(
        GRPOTrainer, GRPOConfig, dynamic_model, str(tmp_path / "stock"), trainer_kwargs={"rollout_func": rollout()},
        **settings,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        _, ours, completions, history = run_training(
            DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, dynamic_model, str(tmp_path / "ours"),
            trainer_kwargs={"rollout_func": rollout()}, max_tokens_per_microbatch=120, **settings,
        )  # fmt: skip
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5 and update_difference(init, ours, stock) <= 1e-3
    assert not [entry for entry in history if "dynbsz/microbatches" in entry]  # stock's math, every step
    assert caplog.text.count("dynamic NTK (rope_type='dynamic')") == 1
