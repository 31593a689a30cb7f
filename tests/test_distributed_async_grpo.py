"""DynamicBatchAsyncGRPOTrainer against stock AsyncGRPOTrainer on 2 processes, for real: `accelerate launch`, gloo,
DDP, DeepSpeed ZeRO-3 and FSDP2 (behind ``-m long``).

Stock's reference for the samples-defined step (``async_step="samples"``) is its fixed-count mode with the step in one
micro-batch per process (8 samples per process, 16 per step); the plugin trains the same samples with the step written 8
x 1 or 4 x 2 and cut by a token budget, its samples balanced across the processes, every pass in lockstep. Stock's own
step (the default, ``async_step="stock"``) is compared with stock at the same config: its token-budget mode (300 tokens,
2 micro-batches per step) and its fixed-count 4 x 2, cut into 48-token passes. Parameters within 1e-5 of stock's
(updates within 1e-3), the step's loss metrics stock's (reduced over both processes), stock's per-micro-batch metrics
those of stock written the same way, and the engine asserted (:func:`~hf_dynbsz.testing.engine_mismatches`: the
parameters whole under DDP, sharded under FSDP2 and ZeRO-3). The runs of a backend share one launch per trainer
(``--scenarios``, :class:`~test_distributed.SharedLaunches`'s pattern).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_async_grpo_trainer import STEP_METRICS, step_metrics

from hf_dynbsz.testing import (
    accelerate_command,
    engine_mismatches,
    metric_mismatches,
    relative_difference,
    run_with_timeout,
    snapshot_parameters,
    update_difference,
)

pytestmark = [pytest.mark.slow, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 300
#: Multi-turn samples with forks and a tool block every prompt begins with (the prefix tree shares them).
AGENTIC = dict(shared_prefix=10, tool_turns=2, forks=0.5, completion_lengths=(6, 36), seed=4)
#: Per backend, the runs of each trainer (stock's flags are its own: it ignores the budget and balancing).
RUNS = {
    "cpu_ddp.yaml": {
        "step": dict(per_device=8),
        "cut": dict(per_device=4, accumulation=2, budget=48),
        "agentic": dict(per_device=8, budget=64, script=AGENTIC),
        "agentic_cut": dict(per_device=4, accumulation=2, script=AGENTIC),
        # the router aux loss over each process's step as one packed row (each sample on its dispatched process)
        "moe": dict(per_device=8, budget=48, architecture="qwen3_moe"),
        # stock's step at the same config: its token budget (ours: 48-token passes), its fixed count at 4 x 2
        "stock_budget": dict(per_device=16, accumulation=2, stock_budget=300, step="stock", passes=48),
        "stock_cut": dict(per_device=4, accumulation=2, step="stock", passes=48),
        "moe_stock": dict(
            per_device=16, accumulation=2, stock_budget=300, step="stock", passes=48, architecture="qwen3_moe"
        ),
    },
    "cpu_zero3.yaml": {"step": dict(per_device=8), "cut": dict(per_device=4, accumulation=2, budget=48)},
    "cpu_fsdp2.yaml": {"step": dict(per_device=8), "cut": dict(per_device=4, accumulation=2, budget=48)},
}
#: stock's step at the same config under every backend (the default async_step="stock")
for _engine in ("cpu_zero3.yaml", "cpu_fsdp2.yaml"):
    RUNS[_engine].update({name: RUNS["cpu_ddp.yaml"][name] for name in ("stock_budget", "stock_cut")})
#: stock's run each of ours compares its step with (the step in one micro-batch), and the one written the same way
REFERENCE = {
    "agentic": ("agentic", "agentic"),
    "agentic_cut": ("agentic", "agentic_cut"),
    "moe": ("moe", "moe"),
    "stock_budget": ("stock_budget", "stock_budget"),
    "stock_cut": ("stock_cut", "stock_cut"),
    "moe_stock": ("moe_stock", "moe_stock"),
}


class Launches:
    """One launch per (trainer, backend), every scenario of the backend in it, run on first use."""

    def __init__(self, directory: Path, model_dir: str) -> None:
        self.directory, self.model_dir, self.done = directory, model_dir, {}

    def get(self, trainer: str, config: str, scenario: str) -> tuple[Path, list[dict]]:
        if (trainer, config) not in self.done:
            out = self.directory / f"{trainer}-{Path(config).stem}"
            arguments = ["--trainer", trainer, "--model_dir", self.model_dir, "--out", out]
            arguments += ["--scenarios", json.dumps(RUNS[config])]
            command = accelerate_command(config, "tests/distributed_async_grpo.py", *arguments)
            run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} under {config}")
            self.done[trainer, config] = out
        out = Path(f"{self.done[trainer, config]}.{scenario}")
        records = []
        for rank in range(2):
            path = Path(f"{out}.rank{rank}.json")
            assert path.exists(), f"rank {rank} did not finish ({config}, {trainer}, {scenario})"
            records.append(json.loads(path.read_text()))
        return out, records


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    return Launches(tmp_path_factory.mktemp("async-launches"), model_dir)


def initial_parameters(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return snapshot_parameters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def compare(config: str, scenario: str, model_dir: str, launches: Launches) -> list[dict]:
    """Ours (``scenario``) against stock: parameters, the step's metrics, stock's per-micro-batch metrics; returns
    our records."""
    step_reference, same_cut = REFERENCE.get(scenario, ("step", scenario))
    stock_out, stock = launches.get("async_grpo_stock", config, step_reference)
    _, stock_cut = launches.get("async_grpo_stock", config, same_cut)
    our_out, ours = launches.get("async_grpo_dynamic", config, scenario)
    assert engine_mismatches(ours, config) == [] and engine_mismatches(stock, config) == []
    stock_params, our_params = torch.load(f"{stock_out}.params.pt"), torch.load(f"{our_out}.params.pt")
    parameters = relative_difference(our_params, stock_params)
    architecture = RUNS[config][step_reference].get("architecture")  # (the worker saved that model by its output)
    initial = initial_parameters(f"{stock_out}-{architecture}" if architecture else model_dir)
    update = update_difference(initial, our_params, stock_params)
    print(f"{config} {scenario}: parameters {parameters:.2e}, update {update:.2e} from stock's")  # (pytest -s)
    assert parameters <= 1e-5 and update <= 1e-3, (parameters, update)
    for rank in range(2):
        ours_logged, stock_logged = ours[rank]["logged"], stock[rank]["logged"]
        assert not metric_mismatches(step_metrics(ours_logged), step_metrics(stock_logged)), f"rank {rank}"
        left = [{k: v for k, v in e.items() if not k.startswith(STEP_METRICS)} for e in ours_logged]
        right = [{k: v for k, v in e.items() if not k.startswith(STEP_METRICS)} for e in stock_cut[rank]["logged"]]
        assert not metric_mismatches(left, right), f"rank {rank}'s per-micro-batch metrics"
        for step in ours[rank]["metrics"]:  # lockstep: every rank ran the agreed number of passes
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )
        assert len(ours[rank]["metrics"]) == 3
    return ours


@pytest.mark.parametrize("config", list(RUNS), ids=lambda config: Path(config).stem.removeprefix("cpu_"))
@pytest.mark.parametrize("scenario", ["step", "cut"])
def test_the_step_equals_stock_across_two_processes(config, scenario, model_dir, launches):
    ours = compare(config, scenario, model_dir, launches)
    if scenario == "cut":  # a budget of 48 tokens cut each process's 8 samples into several passes
        assert all(step["dynbsz/microbatches_max_over_ranks"] > 1 for step in ours[0]["metrics"])


@pytest.mark.parametrize("scenario", ["agentic", "agentic_cut"])
def test_agentic_samples_share_their_prefixes_across_two_processes(scenario, model_dir, launches):
    ours = compare("cpu_ddp.yaml", scenario, model_dir, launches)
    for rank in range(2):
        assert all(step["dynbsz/tree_tokens_saved"] > 0 for step in ours[rank]["metrics"])


@pytest.mark.parametrize("scenario", ["moe", "moe_stock"])
def test_an_moe_models_router_aux_loss_equals_stock_across_two_processes(launches, scenario):
    """Balancing is off for the router aux loss (each process's rows are stock's packed rows: its step for the samples
    step, each micro-batch's row for stock's step at a 300-token budget): the aux loss, reduced over both processes as
    stock reduces it, and the parameters stock's."""
    ours = compare("cpu_ddp.yaml", scenario, launches.model_dir, launches)
    for rank in range(2):
        assert all("aux_loss" in entry for entry in step_metrics(ours[rank]["logged"])[:3])
        assert all(
            step["dynbsz/samples_moved"] == 0 for step in ours[rank]["metrics"] if "dynbsz/samples_moved" in step
        )


@pytest.mark.parametrize("config", list(RUNS), ids=lambda config: Path(config).stem.removeprefix("cpu_"))
@pytest.mark.parametrize("scenario", ["stock_budget", "stock_cut"])
def test_stocks_step_equals_stock_at_the_same_config_across_two_processes(config, scenario, model_dir, launches):
    """The default step: stock's micro-batches at the same config (its token budget, or 4 x 2), each normalised by
    its own tokens, in the plugin's 48-token passes balanced across the processes, under DDP, ZeRO-3 and FSDP2."""
    ours = compare(config, scenario, model_dir, launches)
    assert all(step["dynbsz/microbatches_max_over_ranks"] > 2 for step in ours[0]["metrics"])
