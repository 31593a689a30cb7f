"""DynamicBatchRewardTrainer against stock RewardTrainer on 2 processes, for real: ``accelerate launch``, gloo, DDP
and DeepSpeed ZeRO-3, and under ``-m long`` FSDP2 (``fsdp_on_cpu``: DTensor parameters).

Long-tailed pairs give the processes unequal steps: cross-rank balancing moves whole pairs between them (a pair's
chosen and rejected always run on one process, in one pass), and the processes' pass counts differ, so lockstep dummy
passes run (under ZeRO-3 they gather what a real pass gathers, the score head included). Each backend's runs share one
launch per trainer (``tests/distributed_reward.py --scenarios``). Parameters within 1e-5 of stock's, every metric
stock logs (``min_reward`` / ``mean_reward`` / ``max_reward`` over both processes' rewards, ``accuracy``, ``margin``,
``num_tokens``, the loss) equal on every rank.
"""

from __future__ import annotations

import pytest

from hf_dynbsz.testing import compare_in_lockstep, scenario_launches

pytestmark = pytest.mark.slow

LAUNCH_TIMEOUT_S = 420
#: per backend: the accelerate config and the named runs one launch trains (config fields; ``pairs``, ``system`` and
#: ``margins`` are the worker's)
RUNS = {
    "ddp": ("cpu_ddp.yaml", {"margin_center": dict(margins=True, center_rewards_coefficient=0.05)}),
    "zero3": ("cpu_zero3.yaml", {"bradley_terry": dict(system=16, max_tokens_per_microbatch=120)}),
    "fsdp2": ("cpu_fsdp2.yaml", {"margin": dict(margins=True)}),  # (-m long)
}
#: fields every run shares: 2 optimizer steps of 2 micro-batches of 4 pairs per process, a budget cutting them up
COMMON = dict(max_tokens_per_microbatch=70, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    """Each backend's launch per trainer, run once and shared: ``{(backend, trainer): output prefix}``."""
    directory = tmp_path_factory.mktemp("reward-launches")
    script = "tests/distributed_reward.py"
    return scenario_launches(directory, model_dir, RUNS, COMMON, script, "reward", LAUNCH_TIMEOUT_S)


def compare(backend: str, name: str, launches) -> list[dict]:
    """Ours against stock: every logged metric on every rank but ``total_flos``
    (:func:`~hf_dynbsz.testing.logged_mismatches`), parameters within 1e-5, lockstep; returns each rank's record of
    ours."""
    return compare_in_lockstep(launches, backend, name)


def test_ddp_moves_whole_pairs_and_matches_stock(launches):
    ours = compare("ddp", "margin_center", launches)
    assert max(step["dynbsz/samples_moved"] for record in ours for step in record["metrics"]) > 0


def test_zero3_partitions_the_model_and_matches_stock(launches):
    ours = compare("zero3", "bradley_terry", launches)
    assert all(record["engine"]["zero3_partitioned"] for record in ours)
    assert min(step["dynbsz/tree_tokens_saved"] for record in ours for step in record["metrics"]) > 0


@pytest.mark.long
def test_fsdp2_shards_the_model_and_matches_stock(launches):
    ours = compare("fsdp2", "margin", launches)
    assert all(record["engine"]["fsdp_dtensor"] for record in ours)
