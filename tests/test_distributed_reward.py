"""DynamicBatchRewardTrainer against stock RewardTrainer on 2 processes, for real: ``accelerate launch``, gloo, DDP
and DeepSpeed ZeRO-3.

Long-tailed pairs give the processes unequal steps: cross-rank balancing moves whole pairs between them (a pair's
chosen and rejected always run on one process, in one pass), and the processes' pass counts differ, so lockstep dummy
passes run (under ZeRO-3 they gather what a real pass gathers, the score head included). Each backend's runs share one
launch per trainer (``tests/distributed_reward.py --scenarios``). Parameters within 1e-5 of stock's, every metric
stock logs (``min_reward`` / ``mean_reward`` / ``max_reward`` over both processes' rewards, ``accuracy``, ``margin``,
``num_tokens``, the loss) equal on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_dynbsz.testing import (
    accelerate_command,
    logged_metrics,
    metric_mismatches,
    relative_difference,
    run_with_timeout,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 420
#: per backend: the accelerate config and the named runs one launch trains (config fields; ``pairs``, ``system`` and
#: ``margins`` are the worker's)
RUNS = {
    "ddp": ("cpu_ddp.yaml", {"margin_center": dict(margins=True, center_rewards_coefficient=0.05)}),
    "zero3": ("cpu_zero3.yaml", {"bradley_terry": dict(system=16, max_tokens_per_microbatch=120)}),
}
#: fields every run shares: 2 optimizer steps of 2 micro-batches of 4 pairs per process, a budget cutting them up
COMMON = dict(max_tokens_per_microbatch=70, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    """Each backend's launch per trainer, run once and shared: ``{(backend, trainer): output prefix}``."""
    directory, done = tmp_path_factory.mktemp("reward-launches"), {}

    def get(backend: str, trainer: str) -> Path:
        if (backend, trainer) not in done:
            config, runs = RUNS[backend]
            scenarios = json.dumps({name: {**COMMON, **fields} for name, fields in runs.items()})
            out = directory / f"{trainer}-{backend}"
            arguments = ["--trainer", trainer, "--model_dir", model_dir, "--out", str(out), "--scenarios", scenarios]
            command = accelerate_command(config, "tests/distributed_reward.py", *arguments)
            run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"reward {trainer} runs under {config}")
            done[backend, trainer] = out
        return done[backend, trainer]

    return get


def records(out: Path, name: str) -> list[dict]:
    paths = [Path(f"{out}.{name}.rank{rank}.json") for rank in range(2)]
    assert all(path.exists() for path in paths), f"a rank did not finish {name}"
    return [json.loads(path.read_text()) for path in paths]


def compare(backend: str, name: str, launches) -> list[dict]:
    """Ours against stock: every logged metric on every rank, parameters within 1e-5; returns each rank's record of
    ours."""
    stock_out, our_out = launches(backend, "stock"), launches(backend, "dynamic")
    stock, ours = records(stock_out, name), records(our_out, name)
    for rank in range(2):
        assert ours[rank]["metrics"], f"rank {rank} logged no dynbsz metrics"
        logged = [logged_metrics(record[rank]["logged"], ("total_flos",)) for record in (ours, stock)]
        mismatches = metric_mismatches(*logged)
        assert not mismatches, f"rank {rank}: {mismatches}"
        assert ours[rank]["engine"] == stock[rank]["engine"]
    ours_params = torch.load(f"{our_out}.{name}.params.pt")
    stock_params = torch.load(f"{stock_out}.{name}.params.pt")
    difference = relative_difference(ours_params, stock_params)
    assert difference <= 1e-5, difference
    for rank in range(2):
        for step in ours[rank]["metrics"]:  # lockstep
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )
    return ours


def test_ddp_moves_whole_pairs_and_matches_stock(launches):
    ours = compare("ddp", "margin_center", launches)
    assert max(step["dynbsz/samples_moved"] for record in ours for step in record["metrics"]) > 0


def test_zero3_partitions_the_model_and_matches_stock(launches):
    ours = compare("zero3", "bradley_terry", launches)
    assert all(record["engine"]["zero3_partitioned"] for record in ours)
    assert min(step["dynbsz/tree_tokens_saved"] for record in ours for step in record["metrics"]) > 0
