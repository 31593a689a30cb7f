"""The harness that builds the tests', the benchmarks' and the GPU check's runs (hf_dynbsz/testing/harness.py)."""

from __future__ import annotations

import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.testing import (
    REPO_ROOT,
    ModelShape,
    accelerate_command,
    build_char_tokenizer,
    build_trainer,
    grpo_worker_command,
    mix_rollout,
    numbered_prompts,
    run_config,
    run_together,
    trainer_classes,
)


def test_a_trainer_is_named_by_algorithm_and_kind_and_an_unknown_name_lists_the_known():
    from trl import GRPOConfig, RLOOTrainer

    assert trainer_classes("rloo_stock")[0] is RLOOTrainer
    assert trainer_classes("stock")[1] is GRPOConfig  # the multi-process worker's --trainer names: GRPO's
    with pytest.raises(ValueError, match="trainer 'ppo': choose from .*'grpo_dynamic'"):
        trainer_classes("ppo")


def test_a_distillation_run_names_its_trainers_and_records_its_generations(tmp_path):
    """A distillation's comparison config is the comparison runs' without num_generations (one completion per prompt),
    and its trainer records what it generated (a scripted rollout's completions here, with its env mask as the tool
    mask)."""
    from trl import DistillationConfig, DistillationTrainer

    from hf_dynbsz.testing import MultiTurnRollout, distillation_config, distillation_trainer, save_tiny_model

    assert trainer_classes("distillation_stock") == (DistillationTrainer, DistillationConfig)
    args = distillation_config("distillation_dynamic", str(tmp_path), max_steps=1)
    assert args.per_device_train_batch_size == 4 and args.gradient_accumulation_steps == 2 and args.max_steps == 1
    rollout = MultiTurnRollout(
        lambda rng: 3, lambda rng: 2, lambda rng: 4, max_completion_length=16, seed=0, token_high=7
    )
    trainer = distillation_trainer(
        "distillation_stock", str(tmp_path), model_dir=save_tiny_model(str(tmp_path / "m")), rollout=rollout
    )
    batch = trainer._generate_and_score_completions([{"prompt": f"p{i}"} for i in range(3)])
    assert [len(ids) for ids in trainer.generated] == [batch["completion_mask"][i].sum() for i in range(3)]
    assert (batch["tool_mask"] == 0).any() and batch["num_items_in_batch"] == (
        batch["completion_mask"] * batch["tool_mask"]
    ).sum()


def test_a_run_config_is_a_cpu_run_whose_fields_override_the_defaults(tmp_path):
    args = run_config("grpo_dynamic", str(tmp_path), logging_steps=5, max_tokens_per_microbatch=64)
    assert args.use_cpu and not args.bf16 and args.report_to == [] and args.save_strategy == "no"
    assert args.logging_steps == 5 and args.max_tokens_per_microbatch == 64


def test_a_model_shape_left_open_takes_the_benchmarks_proportions():
    model = ModelShape(64, 1, vocab_size=100).build(build_char_tokenizer(), max_positions=128)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 192)
    assert (config.vocab_size, config.max_position_embeddings, config.num_hidden_layers) == (100, 128, 1)


def test_a_mix_rollout_draws_the_mix_lengths_and_the_tokenizers_tokens():
    tokenizer = build_char_tokenizer()
    rollout = mix_rollout("uniform", tokenizer, 40)
    trainer = type("Trainer", (), {"accelerator": type("Accelerator", (), {"process_index": 0})})()
    result = rollout(["a", "b"], trainer)
    assert [len(ids) for ids in result["prompt_ids"]] == [64, 64]  # the uniform mix: prompts of 64 tokens
    assert [len(ids) for ids in result["completion_ids"]] == [20, 20]  # and completions of M / 2
    assert all(3 <= t < len(tokenizer) for ids in result["completion_ids"] for t in ids[:-1])
    assert result["completion_ids"][0][-1] == tokenizer.eos_token_id  # shorter than M: finished


@pytest.mark.parametrize(("mix", "block", "stem"), [("agentic", 600, 0), ("few_shot", 400, 0), ("tree", 0, 112)])
def test_a_prefix_mix_rollout_gives_its_prompts_a_block_and_its_completions_a_trunk(mix, block, stem):
    """The prefix mixes: every prompt begins with the same block; a prompt's completions share the trunk and their
    branch (``k mod 2``), then leaves of their own; each round records its unique tokens (the distinct token
    prefixes)."""
    tokenizer = build_char_tokenizer()
    rollout = mix_rollout(mix, tokenizer, 384)
    trainer = type("Trainer", (), {"accelerator": type("Accelerator", (), {"process_index": 0})})()
    result = rollout(["a"] * 4 + ["b"] * 4, trainer)
    prompts, completions = result["prompt_ids"], result["completion_ids"]
    assert prompts[0][:block] == prompts[4][:block] and prompts[0] != prompts[4]
    assert all(len(ids) <= 384 for ids in completions)
    if stem:  # a 64-token trunk, then one of two 48-token branches
        assert completions[0][:64] == completions[1][:64] and completions[0][:stem] == completions[2][:stem]
        assert completions[0][64:stem] != completions[1][64:stem] and completions[0][:64] != completions[4][:64]
    sequences = [p + c for p, c in zip(prompts, completions)]
    assert rollout.rounds[-1]["unique_tokens"] == len(distinct_prefixes(sequences)) < sum(map(len, sequences))


def distinct_prefixes(sequences):
    """Brute force: a position as its sample's tokens up to and including the next one (-1 after the last), each
    distinct tuple once."""
    return {tuple([*ids, -1][: i + 2]) for ids in sequences for i in range(len(ids))}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=8))
def test_unique_tokens_counts_the_distinct_token_prefixes(sequences):
    from hf_dynbsz.testing import unique_tokens

    assert unique_tokens(sequences) == len(distinct_prefixes(sequences))


def test_rloo_takes_the_scripted_rollout_as_its_generation(tmp_path):
    tokenizer = build_char_tokenizer()
    model = ModelShape(32, 1).build(tokenizer)
    rollout = mix_rollout("uniform", tokenizer, 8)
    args = run_config("rloo_stock", str(tmp_path), max_completion_length=8, num_generations=2, beta=0.0)
    trainer = build_trainer(args, model, tokenizer, dataset=numbered_prompts(4), rollout=rollout)
    prompt_ids, _, _ = trainer._tokenize_prompts(["prompt-0", "prompt-1"])
    assert prompt_ids == [rollout.prompt_ids("prompt-0"), rollout.prompt_ids("prompt-1")]
    completions = trainer._generate_single_turn(prompt_ids, None, None)  # the round the prompts drew
    assert [len(ids) for ids in completions] == [4, 4] and all(ids[-1] == tokenizer.eos_token_id for ids in completions)
    assert len(rollout.rounds) == 1


def test_one_command_builder_launches_every_worker(tmp_path):
    command = accelerate_command("cpu_ddp.yaml", "tests/exit_lopsided.py", tmp_path / "out", num_processes=2)
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[3:7] == [
        "--config_file",
        str(REPO_ROOT / "accelerate_configs" / "cpu_ddp.yaml"),
        "--num_processes",
        "2",
    ]
    assert command[7:] == [str(REPO_ROOT / "tests" / "exit_lopsided.py"), str(tmp_path / "out")]
    worker = grpo_worker_command(
        "cpu_zero3.yaml", tmp_path / "o", "model", "dynamic", budget=20, no_gradient_checkpointing=True
    )
    assert worker[5] == str(REPO_ROOT / "tests" / "distributed_grpo.py")
    assert worker[6:] == [
        "--trainer",
        "dynamic",
        "--model_dir",
        "model",
        "--out",
        str(tmp_path / "o"),
        "--budget",
        "20",
    ] + ["--no_gradient_checkpointing"]


def test_a_machine_of_a_multi_node_run_is_launched_over_tcp_on_this_host(tmp_path):
    command = grpo_worker_command("cpu_ddp.yaml", tmp_path / "o", "model", "dynamic", machine=(1, 2, 29512))
    flags = command[command.index("--num_machines") : command.index(str(REPO_ROOT / "tests" / "distributed_grpo.py"))]
    assert flags == ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "127.0.0.1"] + [
        "--main_process_port",
        "29512",
    ]


def test_commands_run_together_finish_under_one_timeout_that_kills_all_of_them(tmp_path):
    """The machines of a multi-node run: one that waits for ever is killed with the others when the time is up."""
    python = sys.executable
    finished = run_together([[python, "-c", "print('a')"], [python, "-c", "print('b')"]], tmp_path, 60, "two")
    assert [output.strip() for output in finished] == ["a", "b"]
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish in 2 s"):
        run_together([[python, "-c", "print('c')"], [python, "-c", "import time; time.sleep(600)"]], tmp_path, 2, "x")
    assert time.monotonic() - started < 60
    with pytest.raises(AssertionError, match=r"failed \(3\)"):
        run_together([[python, "-c", "import sys; sys.exit(3)"]], tmp_path, 60, "one")
