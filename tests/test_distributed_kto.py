"""DynamicBatchKTOTrainer against stock KTOTrainer on 2 processes, for real: ``accelerate launch``, gloo, DDP and
DeepSpeed ZeRO-3, and under ``-m long`` FSDP2 (``fsdp_on_cpu``: the policy and the reference sharded, DTensor
parameters).

Long-tailed completions give the processes unequal steps: cross-rank balancing moves samples between them and the
processes' pass counts differ, so lockstep dummy passes run (under ZeRO-3 they gather what a real pass gathers). Each
stock micro-batch's KL estimate is every process's mean gathered, as stock gathers it, including at the end of the
data, where stock's ``gather_for_metrics`` keeps only the first ``remainder`` processes' values (33 samples on 2
processes of 4: the last micro-batch keeps one). Each backend's runs share one launch per trainer
(``tests/distributed_kto.py --scenarios``). Parameters within 1e-5 of stock's and every metric stock logs (``kl``,
``entropy``, ``logits/*``, ``rewards/*`` within fp32 rounding, ``logps/*``, ``num_tokens``, the loss) equal on every
rank.
"""

from __future__ import annotations

import pytest

from hf_dynbsz.testing import compare_in_lockstep, logged_mismatches, scenario_launches
from hf_dynbsz.testing.kto import kto_metric_mismatches

pytestmark = pytest.mark.slow

LAUNCH_TIMEOUT_S = 420
#: per backend: the accelerate config and the named runs one launch trains (config fields; ``samples`` and ``system``
#: are the worker's)
RUNS = {
    "ddp": (
        "cpu_ddp.yaml",
        {
            "end_of_data": dict(samples=33, max_steps=-1, num_train_epochs=1),
            "apo_unequal_weights": dict(loss_type="apo_zero_unpaired", desirable_weight=1.3, undesirable_weight=0.8),
        },
    ),
    "zero3": ("cpu_zero3.yaml", {"kto": dict(system=16, max_tokens_per_microbatch=100)}),
    "fsdp2": ("cpu_fsdp2.yaml", {"kto": dict(max_tokens_per_microbatch=80)}),  # (-m long)
}
#: fields every run shares: 2 optimizer steps of 2 micro-batches of 4 samples per process, a budget cutting them up
COMMON = dict(max_tokens_per_microbatch=60, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    """Each backend's launch per trainer, run once and shared: ``{(backend, trainer): output prefix}``."""
    directory = tmp_path_factory.mktemp("kto-launches")
    return scenario_launches(directory, model_dir, RUNS, COMMON, "tests/distributed_kto.py", "kto", LAUNCH_TIMEOUT_S)


def kto_logged_mismatches(ours: list[dict], stock: list[dict]) -> list[str]:
    """Every logged metric but ``total_flos`` (:func:`~hf_dynbsz.testing.logged_mismatches`; the reward and DPO tests
    leave it out too), rewards within fp32 rounding."""
    return logged_mismatches(ours, stock, lambda *logged: kto_metric_mismatches(*logged, beta=1.0, longest=64))


def compare(backend: str, name: str, launches) -> list[dict]:
    """Ours against stock: every logged metric on every rank, parameters within 1e-5, lockstep; returns each rank's
    record of ours."""
    return compare_in_lockstep(launches, backend, name, kto_logged_mismatches)


def test_ddp_at_the_end_of_the_data_matches_stock(launches):
    ours = compare("ddp", "end_of_data", launches)
    assert len(ours[0]["metrics"]) == 3  # 5 micro-batches of 2 x 4: the last step is one, stock's gather cut
    assert ours[0]["metrics"][0]["kl"] > 0  # the first step's estimate weighs in the loss
    assert max(step["dynbsz/samples_moved"] for record in ours for step in record["metrics"]) > 0


def test_ddp_apo_zero_unpaired_with_unequal_weights_matches_stock(launches):
    compare("ddp", "apo_unequal_weights", launches)


def test_zero3_partitions_the_model_and_matches_stock(launches):
    ours = compare("zero3", "kto", launches)
    assert all(record["engine"]["zero3_partitioned"] for record in ours)
    assert min(step["dynbsz/tree_tokens_saved"] for record in ours for step in record["metrics"]) > 0
    assert ours[0]["metrics"][0]["kl"] > 0  # the first step's estimate weighs in the loss


@pytest.mark.long
def test_fsdp2_shards_both_models_and_matches_stock(launches):
    ours = compare("fsdp2", "kto", launches)
    assert all(record["engine"]["fsdp_dtensor"] for record in ours)
