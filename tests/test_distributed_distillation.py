"""DynamicBatchDistillationTrainer against stock DistillationTrainer on 2 processes, for real: `accelerate launch`,
gloo, DDP and DeepSpeed ZeRO-3 (the teacher a DeepSpeed engine of its own, as stock's ``prepare_deepspeed`` makes it,
through ``_forward_redirection`` in both), and FSDP2 under ``-m long``.

Scripted completions give process 1 every long one (``--rollout lopsided``): cross-rank balancing moves samples
between the processes for the teacher's passes (their hidden states go back to the owner) and for the training passes
(with everything that belongs to a sample: its teacher hidden states, slice, weight), and the processes' pass counts
differ, so lockstep dummy passes run on both models (under ZeRO-3 they must gather what a real pass gathers: the
teacher's backbone, the student's backbone and both LM heads). The runs of a backend share one launch per trainer
(``SharedLaunches`` of ``tests/test_distributed.py``, ``--trainer distillation_stock|distillation_dynamic``). Parameters
within 1e-5 of stock's and the update within 1e-3 of stock's, both runs moved the parameters
(``assert_parameters_match``), the same completions on every rank, every metric stock logs (loss and entropy among
them); every launch's engine is the one its config asks for (under ZeRO-3 and FSDP2 every parameter sharded).
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import SharedLaunches, assert_parameters_match

from hf_dynbsz.testing import metric_mismatches, relative_difference, save_tiny_teacher

pytestmark = pytest.mark.slow

#: Process 1 gets every long completion (18-24 tokens against 1-3) and the long prompts.
LOPSIDED = dict(lopsided=True, rollout="lopsided", budget=64, max_steps=2)
DISTILLATION_RUNS = {
    "cpu_ddp.yaml": {
        "balanced": dict(LOPSIDED, beta=0.5, temperature=0.8),
        # the teacher states of the samples that arrived from the other process damaged (ours only: stock's run is
        # "balanced"'s): the comparison must see it
        "damaged": dict(LOPSIDED, beta=0.5, temperature=0.8, mutate="teacher_hidden"),
        # budgets from memory; process 1's first teacher pass runs out of memory: both processes re-plan their passes
        "memory": dict(LOPSIDED, beta=0.5, max_memory_mib=100_000, inject_oom="teacher:forward:0:1"),
        # tool-result tokens (tool mask 0) in every process's completions; balancing off: each process its own
        "tool_mask": dict(rollout="multiturn", budget=48, beta=1.0, balance="off"),
    },
    "cpu_zero3.yaml": {"balanced": dict(LOPSIDED, beta=0.0)},
}
#: The default prefix tree (test_a_prefix_tree_...): a 16-token block every prompt begins with, each prompt twice in a
#: row (stock generates one completion per prompt) so that a process's step holds two completions of each of its
#: prompts, sharing a trunk, then a branch each; every long leaf on process 1 (balancing moves samples).
PREFIX = dict(LOPSIDED, rollout="prefix", repeat_prompts=2)
DISTILLATION_RUNS["cpu_ddp.yaml"]["prefix"] = dict(PREFIX, beta=0.5, temperature=1.3)
DISTILLATION_RUNS["cpu_zero3.yaml"]["prefix"] = dict(PREFIX, beta=1.0, temperature=0.7)
#: FSDP2 (its own launch: -m long): the student sharded, the divergence reading its head's DTensor as stock does.
DISTILLATION_RUNS["cpu_fsdp2.yaml"] = {"prefix": dict(PREFIX, beta=0.0, temperature=0.7)}
BACKENDS = {"ddp": "cpu_ddp.yaml", "zero3": "cpu_zero3.yaml", "fsdp2": "cpu_fsdp2.yaml"}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_tiny_teacher(str(tmp_path_factory.mktemp("tiny-teacher")))


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir, teacher_dir):
    runs = {
        config: {name: dict(options, teacher_dir=teacher_dir) for name, options in scenarios.items()}
        for config, scenarios in DISTILLATION_RUNS.items()
    }
    return SharedLaunches(tmp_path_factory.mktemp("distillation-launches"), model_dir, runs)


def compare(config: str, scenario: str, model_dir, launches) -> list[dict]:
    """Ours against stock, both run with ``scenario``'s flags under ``config``: same completions, parameters and update
    stock's (``assert_parameters_match``), every metric stock logs (its loss and entropy among them); returns each
    rank's records of ours."""
    options = launches.shared_runs[config][scenario]
    stock_out, stock = launches.get("distillation_stock", config, model_dir, **options)
    our_out, ours = launches.get("distillation_dynamic", config, model_dir, **options)
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        assert ours[rank]["metrics"], f"rank {rank} logged no dynbsz metrics"
        assert not metric_mismatches(ours[rank]["logged"], stock[rank]["logged"], abs=1e-7), f"rank {rank}'s metrics"
        assert len([entry for entry in ours[rank]["logged"] if "entropy" in entry]) == options.get("max_steps", 2)
        assert ours[rank]["losses"] == pytest.approx(stock[rank]["losses"], rel=1e-5, abs=1e-7)
    assert_parameters_match(our_out, stock_out)
    return ours


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_balancing_moves_samples_with_their_teacher_states_and_matches_stock(backend, model_dir, launches):
    ours = compare(BACKENDS[backend], "balanced", model_dir, launches)
    for rank in range(2):
        steps = ours[rank]["metrics"]
        assert any(step["dynbsz/samples_moved"] > 0 for step in steps)
        for step in steps:  # lockstep: every rank ran the agreed number of passes
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )
            assert step["dynbsz/teacher_seconds"] > 0


def test_tool_masks_match_stock_across_two_processes(model_dir, launches):
    ours = compare("cpu_ddp.yaml", "tool_mask", model_dir, launches)
    assert all(step["dynbsz/microbatches"] >= 2 for rank in range(2) for step in ours[rank]["metrics"])


def test_a_moved_sample_that_lost_its_teacher_states_is_caught(model_dir, launches):
    """The balanced run again, with the teacher hidden states of every sample that moved shifted by 0.5 on arrival:
    the same completions, but parameters off stock's (what ``compare`` would fail on)."""
    options = launches.shared_runs["cpu_ddp.yaml"]["damaged"]
    stock_out, _ = launches.get("distillation_stock", "cpu_ddp.yaml", model_dir, **options)
    our_out, ours = launches.get("distillation_dynamic", "cpu_ddp.yaml", model_dir, **options)
    assert any(step["dynbsz/samples_moved"] > 0 for step in ours[0]["metrics"])
    difference = relative_difference(torch.load(f"{our_out}.params.pt"), torch.load(f"{stock_out}.params.pt"))
    assert difference > 1e-4, difference


def test_budgets_from_memory_and_a_teacher_pass_out_of_memory_on_one_process_match_stock(model_dir, launches):
    ours = compare("cpu_ddp.yaml", "memory", model_dir, launches)
    for rank in range(2):
        steps = ours[rank]["metrics"]
        assert sum(step["dynbsz/oom_retries"] for step in steps) == 1  # agreed: both re-planned the teacher's passes
        assert all(step["dynbsz/predicted_peak_memory_mib"] > 0 for step in steps)


@pytest.mark.parametrize("backend", ["ddp", "zero3", pytest.param("fsdp2", marks=pytest.mark.long)])
def test_a_prefix_tree_across_two_processes_matches_stock(backend, model_dir, launches):
    """The default prefix tree on both models, 2 processes: the student's training passes and the teacher's passes
    compute the shared block once per pass across prompts and each prompt's trunk once, samples moved to the other
    process with the subtree they share a pass with (their teacher states sent back to their owner, then moved with
    them for training); parameters equal stock's under DDP, ZeRO-3 (the self-check compares log-probs there) and,
    under ``-m long`` (a launch of its own), FSDP2."""
    ours = compare(BACKENDS[backend], "prefix", model_dir, launches)
    steps = [step for record in ours for step in record["metrics"]]
    assert min(step["dynbsz/tree_tokens_saved"] for step in steps) > 0  # beyond prompt groups, every step
    assert max(step["dynbsz/samples_moved"] for step in steps) > 0
