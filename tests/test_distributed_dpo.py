"""DynamicBatchDPOTrainer against stock DPOTrainer on 2 processes, for real: ``accelerate launch``, gloo, DDP and
DeepSpeed ZeRO-3 (the reference a DeepSpeed engine of its own, as stock's ``prepare_deepspeed`` makes it); under
``-m long`` FSDP2 (``fsdp_on_cpu``: the policy and the reference sharded, DTensor parameters) and two more DDP runs (a
sorted loss with LD-DPO; a system block shared across pairs with LoRA's adapter-disabled reference).

Long-tailed pairs give the processes unequal steps: cross-rank balancing moves whole pairs between them (a pair's
chosen and rejected always run on one process, in one pass), the reference's passes move samples on their own (their
log-probs go back to the owner), and the processes' pass counts differ, so lockstep dummy passes run on the policy and
on the reference (under ZeRO-3 they gather what a real pass gathers). Each backend's runs share one launch per trainer
(``tests/distributed_dpo.py --scenarios``). Parameters within 1e-5 of stock's, every metric stock logs (its per-slice
``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy`` reduced over both processes,
``num_tokens``, the loss) equal on every rank, and the engine asserted.
"""

from __future__ import annotations

import pytest

from hf_dynbsz.testing import assert_lockstep, compare_scenario, scenario_launches

pytestmark = pytest.mark.slow

LAUNCH_TIMEOUT_S = 420
#: per backend: the accelerate config and the named runs one launch trains (config fields; ``lora``, ``pairs`` and
#: ``system`` are the worker's)
RUNS = {
    "ddp": ("cpu_ddp.yaml", {"sigmoid": dict(max_tokens_per_microbatch=90)}),
    "ddp_more": (  # (-m long: a launch of its own)
        "cpu_ddp.yaml",
        {
            # a sorted loss: coefficients from the policy's no-grad passes, the pairs moved between processes
            "aot_ld_alpha": dict(loss_type=["aot", "sigmoid"], loss_weights=[1.0, 0.5], ld_alpha=0.5),
            # a system block common to every prompt, LoRA (the adapter-disabled reference)
            "system_lora": dict(system=24, lora=True, max_tokens_per_microbatch=160),
        },
    ),
    "zero3": ("cpu_zero3.yaml", {"ipo_sft": dict(loss_type=["ipo", "sft"], learning_rate=0.02)}),
    "fsdp2": ("cpu_fsdp2.yaml", {"sigmoid": dict(max_tokens_per_microbatch=90)}),
}
#: fields every run shares: 2 optimizer steps of 2 micro-batches of 4 pairs per process, a budget cutting them up
COMMON = dict(max_tokens_per_microbatch=70, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    """Each backend's launch per trainer, run once and shared: ``{(backend, trainer): output prefix}``."""
    directory = tmp_path_factory.mktemp("dpo-launches")
    return scenario_launches(directory, model_dir, RUNS, COMMON, "tests/distributed_dpo.py", "DPO", LAUNCH_TIMEOUT_S)


def compare(backend: str, name: str, launches) -> list[dict]:
    """Ours against stock: every logged metric on every rank (at the first step, where the policy is the reference,
    ``rewards/accuracies`` counts float noise on both sides and is left out: tests/test_dpo_trainer.py), parameters
    within 1e-5; returns each rank's record of ours."""
    from test_dpo_trainer import logged_mismatches

    def mismatches(ours_logged: list[dict], stock_logged: list[dict]) -> list[str]:
        logged = [dict(entry) for entry in ours_logged], [dict(entry) for entry in stock_logged]
        if backend == "zero3":  # the Trainer's FLOP estimate counts the parameters ZeRO-3 holds gathered at the
            for entry in (*logged[0], *logged[1]):  # moment (Trainer.floating_point_ops): not a training figure
                entry.pop("total_flos", None)
        return logged_mismatches(*logged)

    return compare_scenario(launches(backend, "stock"), launches(backend, "dynamic"), name, mismatches)


def test_ddp_moves_whole_pairs_and_matches_stock(launches):
    ours = compare("ddp", "sigmoid", launches)
    assert_lockstep(ours)
    assert max(step["dynbsz/samples_moved"] for record in ours for step in record["metrics"]) > 0


@pytest.mark.long
def test_ddp_a_sorted_loss_with_ld_alpha_matches_stock(launches):
    assert_lockstep(compare("ddp_more", "aot_ld_alpha", launches))


@pytest.mark.long
def test_ddp_a_system_block_with_lora_matches_stock(launches):
    ours = compare("ddp_more", "system_lora", launches)
    assert min(step["dynbsz/tree_tokens_saved"] for record in ours for step in record["metrics"]) > 0


def test_zero3_partitions_both_models_and_matches_stock(launches):
    ours = compare("zero3", "ipo_sft", launches)
    assert_lockstep(ours)
    for record in ours:
        assert record["engine"]["zero3_partitioned"], record["engine"]
        assert record["engine"]["reference"] == "DeepSpeedEngine"


@pytest.mark.long
def test_fsdp2_shards_both_models_and_matches_stock(launches):
    ours = compare("fsdp2", "sigmoid", launches)
    assert_lockstep(ours)
    for record in ours:
        assert record["engine"]["fsdp_dtensor"], record["engine"]
