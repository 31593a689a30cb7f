"""Sequence parallelism (hf_dynbsz/execution/sequence_parallel.py): DeepSpeed Ulysses on packed rows, exact.

Single-process specifications: the config takes accelerate's ``ParallelismConfig(sp_size=N)`` (stock's refuses it),
what cannot run is refused at start naming the setting and the fix, a pass's budget spans the group. Multi-process
runs (marked slow): per-token log-probs and gradients of sharded rows equal unsharded ones, and training with
``sp_size=2`` equals stock GRPOTrainer (no sequence parallelism, same samples: parameters, update and both runs'
movement as in ``tests/test_distributed.py``) under DDP, ZeRO-2 and ZeRO-3 (its parameters sharded, checked on every
process), with long-tailed completions, shared prompts and sequences longer than one device's budget; on 4
processes, 2 groups balanced against each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.parallelism_config import ParallelismConfig
from test_distributed import assert_parameters_match
from trl import GRPOConfig

from hf_dynbsz import DynamicBatchGRPOConfig
from hf_dynbsz.execution.packing import dummy_microbatch
from hf_dynbsz.execution.sequence_parallel import sequence_parallel_blocker
from hf_dynbsz.planning.model_support import Layout
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.testing import REPO_ROOT as ROOT
from hf_dynbsz.testing import (
    accelerate_command,
    base_config_kwargs,
    engine_mismatches,
    grpo_worker_command,
    run_with_timeout,
    save_tiny_model,
)

LAUNCH_TIMEOUT_S = 300


def config(**overrides):
    return DynamicBatchGRPOConfig(**base_config_kwargs("/tmp/hf-dynbsz-sp-test", **overrides))


# ---- configuration ------------------------------------------------------------------------------------------------
def test_stock_grpo_config_refuses_sp_size_and_ours_takes_it():
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        GRPOConfig(
            **base_config_kwargs("/tmp/x", parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
        )
    args = config(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    assert args.sequence_parallel_size == 2
    assert args.parallelism_config is None  # accelerate runs plain data parallelism; the trainer runs Ulysses
    assert config(sequence_parallel_size=2).sequence_parallel_size == 2
    assert config().sequence_parallel_size == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(parallelism_config=ParallelismConfig(cp_size=2)), "cp_size=2"),
        (
            dict(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2), sequence_parallel_size=4),
            "sequence_parallel_size=4 and parallelism_config.sp_size=2 disagree",
        ),
        (
            dict(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2), dynamic_batching=False),
            "needs dynamic_batching=True",
        ),
        (dict(sequence_parallel_size=0), "sequence_parallel_size must be a positive integer"),
    ],
)
def test_what_cannot_run_is_refused_with_the_setting_and_a_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def blocker(size=2, processes=2, **overrides):
    support = SimpleNamespace(padding_free_blocker=None, sequence_mixers=())
    kwargs = dict(
        layouts=[Layout("padding_free", segment_attention="sdpa", attention="varlen")],
        support=support,
        vision_language=None,
        router_aux=False,
        entropy_bonus=False,
        text_config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2),
    )
    kwargs.update(overrides)
    return sequence_parallel_blocker(size, processes, **kwargs)


def test_the_runs_sequence_parallelism_cannot_shard_are_named():
    assert blocker() is None
    assert "does not divide the 3 processes" in blocker(processes=3)
    assert "vision-language" in blocker(vision_language="repacked")
    assert "padding-free rows" in blocker(layouts=[Layout("padded")])
    assert "router aux loss" in blocker(router_aux=True)
    assert "entropy bonus" in blocker(entropy_bonus=True)
    hybrid = SimpleNamespace(padding_free_blocker=None, sequence_mixers=("Qwen3NextGatedDeltaNet",))
    assert "does not shard the Qwen3NextGatedDeltaNet layers" in blocker(support=hybrid)  # state crosses shards
    assert "must divide the attention heads" in blocker(
        size=4, processes=4, text_config=SimpleNamespace(num_attention_heads=6, num_key_value_heads=2)
    )
    # fewer key/value heads than processes: DeepSpeed replicates them
    assert (
        blocker(size=4, processes=4, text_config=SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)) is None
    )
    for reason in (blocker(processes=3), blocker(router_aux=True)):
        assert "sequence_parallel_size=1" in reason  # the fix


def test_a_pass_budget_spans_the_group():
    args = config(max_tokens_per_microbatch=100, sequence_parallel_size=2)
    scheduler = Scheduler.from_args(args)
    assert scheduler.budget(50, "training") == 200
    assert scheduler.budget(50, "logprob") == 400
    assert Scheduler.from_args(config(max_tokens_per_microbatch=100)).budget(50, "training") == 100


def test_a_lockstep_pass_gives_every_process_of_a_group_a_token():
    mb = dummy_microbatch(0, width=4, attention="sdpa")
    assert mb.model_inputs["input_ids"].shape == (1, 4)
    assert mb.shift_labels.tolist() == [[0, 0, 0, -100]]
    assert mb.segments.width == 4


def test_one_process_cannot_form_a_group_of_two(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dynbsz import DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import RecordingReward, load_tokenizer, prompt_dataset

    model_dir = save_tiny_model(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the 1 processes"):
        DynamicBatchGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=RecordingReward(),
            args=config(sequence_parallel_size=2),
            processing_class=load_tokenizer(model_dir),
            train_dataset=prompt_dataset(),
        )


# ---- multi-process ------------------------------------------------------------------------------------------------
def launch(script: str, config_file: str, out: Path, *arguments: str, processes: int = 2) -> list[dict]:
    command = accelerate_command(config_file, f"tests/{script}", "--out", out, *arguments, num_processes=processes)
    run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"{script} under {config_file}")
    records = []
    for rank in range(processes):
        path = Path(f"{out}.rank{rank}.json")
        assert path.exists(), f"rank {rank} did not finish ({script}, {config_file})"
        records.append(json.loads(path.read_text()))
    if script == "distributed_grpo.py":  # the engine the config asks for (under ZeRO-3, every parameter sharded)
        assert not engine_mismatches(records, config_file), engine_mismatches(records, config_file)
    return records


@pytest.mark.long
@pytest.mark.slow
def test_sharded_rows_give_every_token_its_log_prob_and_each_shards_gradient_once(tmp_path, model_dir):
    """Fails when a token at a shard boundary is lost or misplaced (log-probs, entropies against stock's own method)
    and when a shard's loss counts twice or not at all (the group's summed gradients against the unsharded pass)."""
    for record in launch(
        "sequence_parallel_logprobs.py", "cpu_ddp.yaml", tmp_path / "logprobs", "--model_dir", model_dir
    ):
        assert record["row_width"] % 2 == 0
        assert record["logprob"] <= 1e-5 and record["entropy"] <= 1e-5, record
        assert record["gradient"] <= 1e-5, record


LONG_TAILED = ("--rollout", "lopsided", "--max_steps", "3")  # rank 1 gets every long completion (18-24 tokens)
SEQUENCE_PARALLEL_RUNS = {
    # name: (accelerate config, processes, options)
    "ddp-grpo": (
        "cpu_ddp.yaml",
        2,
        ("--loss_type", "grpo", "--budget", "20", "--oversize_policy", "error", "--top_entropy_quantile", "0.5"),
    ),
    # 2 groups of 2: data parallelism and cross-rank balancing between groups (rank 1's group has every long one)
    "zero2-4-processes-dapo": (
        "cpu_zero2.yaml",
        4,
        ("--loss_type", "dapo", "--budget", "64", "--num_iterations", "2", "--no_gradient_checkpointing"),
    ),
    # a prefix tree beyond prompt groups, sharded: a block every prompt begins with, trunks and branches
    "ddp-prefix-tree": ("cpu_ddp.yaml", 2, ("--loss_type", "dapo", "--budget", "48", "--rollout", "prefix")),
    # gradient checkpointing is on in the runs above and this one (GRPOConfig's default), off in the 4-process run
    "zero3-dr_grpo": (
        "cpu_zero3.yaml",
        2,
        ("--loss_type", "dr_grpo", "--budget", "64", "--beta", "0.1", "--tensor_batch_size", "8"),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[] if name == "ddp-grpo" else [pytest.mark.long]) for name in SEQUENCE_PARALLEL_RUNS],
)  # the README's test command runs the DDP run; -m long the ZeRO-2 (4 processes) and ZeRO-3 ones
def test_sp_size_2_matches_stock(name, tmp_path, model_dir):
    config_file, processes, options = SEQUENCE_PARALLEL_RUNS[name]
    arguments = ("--model_dir", model_dir, *LONG_TAILED, *options)
    stock = launch(
        "distributed_grpo.py", config_file, tmp_path / "stock", "--trainer", "stock", *arguments, processes=processes
    )
    ours = launch(
        "distributed_grpo.py",
        config_file,
        tmp_path / "ours",
        "--trainer",
        "dynamic",
        "--sequence_parallel",
        "2",
        *arguments,
        processes=processes,
    )
    for rank in range(processes):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        steps = ours[rank]["metrics"]
        assert len(steps) == 3
        for step in steps:
            assert step["dynbsz/shared_tokens_saved"] > 0  # shared prompts ran sharded too
            assert step["dynbsz/padding_fraction"] < 0.05
            if processes == 4:
                assert step["dynbsz/samples_moved"] > 0 and step["dynbsz/rank_imbalance_after"] < 1.1, step
    # the logged loss counts each group once (each of its processes holds the group's whole loss); it is not near 0
    # in the ZeRO runs, so a loss counted per process (x2) fails here
    assert ours[0]["losses"] == pytest.approx(stock[0]["losses"], rel=1e-3, abs=1e-6)
    assert_parameters_match(tmp_path / "ours", tmp_path / "stock")


@pytest.mark.long
@pytest.mark.slow
def test_a_sequence_over_one_devices_budget_trains_with_sp_size_2_only(tmp_path, model_dir):
    """budget 20 tokens per device: the long completions (up to 33 tokens with their prompts) are oversize on one
    device (oversize_policy='error' stops the run) and fit a group of two (40 tokens), as the ddp-grpo run above
    shows by matching stock."""
    options = dict(loss_type="grpo", budget=20, oversize_policy="error")
    command = [*grpo_worker_command("cpu_ddp.yaml", tmp_path / "alone", model_dir, "dynamic", **options), *LONG_TAILED]
    output = run_with_timeout(
        command, ROOT, LAUNCH_TIMEOUT_S, "the same run without sequence parallelism", expect_failure=True
    )
    assert "more than the micro-batch budget max_tokens_per_microbatch=20" in output, output[-3000:]


def test_an_oversize_error_names_the_per_device_setting_and_the_pass_of_the_group():
    scheduler = Scheduler.from_args(
        config(max_tokens_per_microbatch=20, sequence_parallel_size=2, oversize_policy="error")
    )
    with pytest.raises(ValueError) as raised:
        scheduler.plan([50, 10], scheduler.budget(10), prompt_lengths=[5, 5])
    message = str(raised.value)
    assert "max_tokens_per_microbatch=20" in message and "shares each pass over 2 processes: 40 tokens" in message
    assert "Raise max_tokens_per_microbatch to >= 25" in message  # 50 tokens over a group of 2


def test_the_plan_table_shows_the_groups_and_the_longest_sequence_a_pass_holds():
    from hf_dynbsz.planning.plan import BatchSizePlan

    rows = {
        row[0]: row
        for row in BatchSizePlan.from_args(
            config(max_tokens_per_microbatch=8192, sequence_parallel_size=2), num_processes=4
        ).rows()
    }
    assert rows["sequence_parallel_size"][1:3] == ("2", "2 group(s)")
    assert rows["tokens per training pass (group)"][1] == "16384"
    assert rows["tokens per logprob pass (group)"][1] == "32768"
    assert "sequence_parallel_size" not in {row[0] for row in BatchSizePlan.from_args(config(), 4).rows()}


def test_planning_a_group_size_that_does_not_divide_the_processes_is_refused():
    from hf_dynbsz.planning.plan import BatchSizePlan

    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide num_processes=3"):
        BatchSizePlan.from_args(config(sequence_parallel_size=2), num_processes=3)
