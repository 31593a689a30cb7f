"""What the DPO, reward-model and KTO trainers' tests check alike, each a test parametrized over the three: the run
against stock is each trainer's own (``compare_with_stock`` of tests/test_dpo_trainer.py, tests/test_reward_trainer.py
and tests/test_kto_trainer.py: the same parameters, updates and logged metrics as stock's)."""

from __future__ import annotations

import pytest
import test_dpo_trainer
import test_kto_trainer
import test_reward_trainer

from hf_dynbsz.testing import preference_pairs
from hf_dynbsz.testing.kto import unpaired_samples

TRAINERS = {"dpo": test_dpo_trainer, "reward": test_reward_trainer, "kto": test_kto_trainer}


def system_block_samples(trainer: str):
    """16 pairs (16 unpaired samples for KTO) whose prompts all open with the same 40-token block."""
    if trainer == "kto":
        return unpaired_samples(16, system=40, prompt=(3, 12), completion=(1, 12), seed=5)
    return preference_pairs(16, system=40, prompt=(3, 12), response=(1, 12), seed=5)


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_padded_layout(model_dir, tmp_path, trainer):
    """The padded layout (each pair whole in one pass, for DPO and the reward model) equals stock and pads."""
    steps, _ = TRAINERS[trainer].compare_with_stock(model_dir, tmp_path, packing_layout="padded")
    assert all(step["dynbsz/padding_fraction"] > 0 for step in steps)


@pytest.mark.parametrize("trainer, budget, fraction", [("dpo", 160, 3), ("reward", 160, 3), ("kto", 200, 2)])
def test_a_system_block_common_to_every_prompt_is_computed_once_per_pass(
    model_dir, tmp_path, trainer, budget, fraction
):
    """A 40-token block opens every prompt: the prefix tree computes it once per pass (across pairs, tokens saved
    beyond each pair's own prompt: ``tree_tokens_saved``; for KTO, training and no-grad passes), and each pair's prompt
    once for its two responses: under ``1 / fraction`` of stock's computed tokens."""
    steps, _ = TRAINERS[trainer].compare_with_stock(
        model_dir, tmp_path, system_block_samples(trainer), max_tokens_per_microbatch=budget
    )
    for step in steps:
        assert step["dynbsz/tree_tokens_saved"] >= 39  # the block (but the token keyed on what follows) at least once
        assert step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"] / fraction
