"""DynamicBatchRLOOTrainer against stock RLOOTrainer on 2 processes, for real: `accelerate launch`, gloo, DDP,
DeepSpeed ZeRO-3 and FSDP2.

Rank 1's prompts are about 20x longer than rank 0's (``--lopsided``): cross-rank balancing moves samples between the
processes, with everything that belongs to them (summed old log-probs, advantages, slice, weight). The runs of a
backend share one launch per trainer (``SharedLaunches`` of ``tests/test_distributed.py``, ``--trainer
rloo_stock|rloo_dynamic``): under DDP with ``beta`` in the reward and two iterations, an MoE model with its router aux
loss, sequence parallelism over both processes and generation on TRL's vLLM path (server mode, through the stand-in
of ``hf_dynbsz.testing.vllm_standin``); under ZeRO-3 with a reference model; under FSDP2 with a reference model and two
iterations. Parameters within 1e-5 of stock's and the update within 1e-3 of stock's, both runs moved the parameters
(``assert_parameters_match``), the same completions on every rank, and every metric stock logs (entropy and clip ratios
among them); every launch's engine is the one its config asks for (under ZeRO-3 and FSDP2 every parameter sharded).
"""

from __future__ import annotations

import pytest
from test_distributed import SharedLaunches, assert_parameters_match

from hf_dynbsz.testing import metric_mismatches

pytestmark = pytest.mark.slow

#: Rank 1's prompts about 20x longer than rank 0's (balancing on, the default): samples move to rank 0.
LOPSIDED = dict(lopsided=True, budget=96, max_steps=2)
RLOO_RUNS = {
    "cpu_ddp.yaml": {
        "balanced": dict(LOPSIDED, beta=0.1, num_iterations=2),
        "moe": dict(LOPSIDED, architecture="qwen3_moe", router_aux_loss_coef=1.0),
        # one group of both processes: each pass's rows sharded over them (DeepSpeed Ulysses on packed rows)
        "sequence_parallel": dict(sequence_parallel=2, budget=24, beta=0.1),
        # TRL's vLLM path in server mode (hf_dynbsz.testing.vllm_standin): the main process's engine serves both
        "vllm_server": dict(LOPSIDED, vllm="server", num_iterations=2, max_steps=3),
    },
    "cpu_zero3.yaml": {"balanced": dict(LOPSIDED, beta=0.1)},
    # FSDP2: with beta > 0 TRL builds the reference model from the model's name (a path here)
    "cpu_fsdp2.yaml": {"balanced": dict(LOPSIDED, beta=0.1, num_iterations=2)},
}
BACKENDS = {"ddp": "cpu_ddp.yaml", "zero3": "cpu_zero3.yaml", "fsdp2": "cpu_fsdp2.yaml"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    return SharedLaunches(tmp_path_factory.mktemp("rloo-launches"), model_dir, RLOO_RUNS)


def compare(config: str, scenario: str, model_dir, launches) -> tuple[list[dict], list[dict]]:
    """Ours against stock, both run with ``scenario``'s flags under ``config``: same completions, parameters and update
    stock's (``assert_parameters_match``), every metric stock logs (its loss metrics among them); returns each rank's
    records, ours and stock's."""
    options = RLOO_RUNS[config][scenario]
    stock_out, stock = launches.get("rloo_stock", config, model_dir, **options)
    our_out, ours = launches.get("rloo_dynamic", config, model_dir, **options)
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        assert ours[rank]["metrics"], f"rank {rank} logged no dynbsz metrics"
        assert not metric_mismatches(ours[rank]["logged"], stock[rank]["logged"]), f"rank {rank}'s logged metrics"
    assert_parameters_match(our_out, stock_out)
    return ours, stock


@pytest.mark.parametrize("backend", ["ddp", pytest.param("zero3", marks=pytest.mark.long), "fsdp2"])
def test_balancing_moves_samples_and_matches_stock(backend, model_dir, launches):
    ours, _ = compare(BACKENDS[backend], "balanced", model_dir, launches)
    for rank in range(2):
        steps = ours[rank]["metrics"]
        assert len(steps) == 2
        assert any(step["dynbsz/samples_moved"] > 0 for step in steps)
        for step in steps:  # lockstep: every rank ran the agreed number of passes
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )


def test_moe_router_aux_loss_matches_stock_across_two_processes(model_dir, launches):
    ours, stock = compare("cpu_ddp.yaml", "moe", model_dir, launches)
    for rank in range(2):
        assert any(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])
        assert len(ours[rank]["aux_losses"]) == len(stock[rank]["aux_losses"]) == 2
        assert ours[rank]["aux_losses"] == pytest.approx(stock[rank]["aux_losses"], rel=1e-5)


def test_sequence_parallelism_matches_stock(model_dir, launches):
    """Stock trains each process's samples on that process; ours pools the two processes' samples and shards each
    pass's rows over both (a budget of 24 tokens per process: 48 per pass of the group)."""
    ours, _ = compare("cpu_ddp.yaml", "sequence_parallel", model_dir, launches)
    for rank in range(2):
        assert all(step["dynbsz/budget_tokens"] == 48 for step in ours[rank]["metrics"])
        assert any(step["dynbsz/shared_tokens_saved"] > 0 for step in ours[rank]["metrics"])


def test_the_vllm_path_matches_stock_across_two_processes(model_dir, launches):
    """Server mode: one engine, on the main process, generates both processes' completions (TRL gathers the prompts
    and broadcasts the completions); two iterations over each round read the plugin's packed old log-probs."""
    ours, stock = compare("cpu_ddp.yaml", "vllm_server", model_dir, launches)
    assert ours[0]["vllm_engines"] == stock[0]["vllm_engines"] == [[2, 2]]  # [weight syncs, requests]: two rounds
    assert ours[1]["vllm_engines"] == stock[1]["vllm_engines"] == []
    for rank in range(2):
        assert any(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])
