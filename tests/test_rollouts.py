"""Drop-in for TRL's other rollouts: multi-turn rollouts with an environment mask, and environments that own the
reward and the data. Both train through the repacking path and must end where stock GRPOTrainer ends."""

from __future__ import annotations

import pytest
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.testing import (
    CountingEnvironment,
    MultiTurnRollout,
    relative_difference,
    run_training,
    save_tiny_model,
    update_difference,
)

LOSS_TYPES = ["grpo", "dapo", "bnpo"]


def multi_turn_rollout():
    return MultiTurnRollout(
        turn_lengths=lambda rng: rng.integers(1, 7),
        env_lengths=lambda rng: rng.integers(2, 9),
        prompt_length=lambda rng: rng.integers(3, 12),
        max_completion_length=24,
        seed=2,
    )


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-chat-model")), chat=True)


def compare(model_dir, tmp_path, trainer_kwargs, before_run=lambda: None, budget=48, **overrides):
    before_run()
    initial, stock, stock_completions, _ = run_training(
        GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "stock"), trainer_kwargs=trainer_kwargs(), **overrides
    )
    before_run()
    _, ours, completions, history = run_training(
        DynamicBatchGRPOTrainer,
        DynamicBatchGRPOConfig,
        model_dir,
        str(tmp_path / "ours"),
        trainer_kwargs=trainer_kwargs(),
        max_tokens_per_microbatch=budget,
        **overrides,
    )
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    assert steps and all(step["dynbsz/microbatches"] >= 1 for step in steps)
    return history


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_multi_turn_rollout_with_environment_mask_matches_stock(model_dir, tmp_path, loss_type):
    rollouts = []

    def kwargs():
        rollouts.append(multi_turn_rollout())
        return {"rollout_func": rollouts[-1]}

    compare(model_dir, tmp_path, kwargs, loss_type=loss_type, beta=0.1, num_iterations=2, max_steps=3)
    assert rollouts[-1].rounds  # the rollout ran


def test_the_environment_mask_reaches_the_loss():
    """The scripted rollout does hand out environment tokens (so the comparison above is about them)."""
    import numpy as np

    rollout = multi_turn_rollout()

    class Trainer:
        class accelerator:  # noqa: N801 - the attribute ScriptedRollout reads
            process_index = 0

    output = rollout(["abc"] * 16, Trainer())
    masks = output["env_mask"]
    assert any(0 in mask for mask in masks) and all(mask[-1] == 1 for mask in masks)
    assert [len(m) for m in masks] == [len(c) for c in output["completion_ids"]]
    assert np.mean([sum(m) / len(m) for m in masks]) < 0.9


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_environment_owning_reward_and_data_matches_stock(chat_model_dir, tmp_path, loss_type):
    # no reward_funcs, no train_dataset: the environment's reset() gives the prompt, get_reward() the reward
    history = compare(
        chat_model_dir,
        tmp_path,
        lambda: {"environment_factory": CountingEnvironment, "reward_funcs": None, "train_dataset": None},
        before_run=CountingEnvironment.restart,
        budget=1600,
        loss_type=loss_type,
        max_steps=2,
        max_completion_length=16,
    )  # the tool schema makes the chat prompts ~680 tokens long
    rewards = [entry["reward"] for entry in history if "reward" in entry]
    assert rewards and any(reward != 0 for reward in rewards)
