"""Multi-process runs for real: `accelerate launch`, 2 CPU processes, gloo, DDP, DeepSpeed ZeRO-1/2/3 and FSDP2.

For each backend, stock GRPOTrainer and DynamicBatchGRPOTrainer train from the same saved model and seed;
the final (gathered) parameters must agree within 1e-5, the plugin's update (final minus initial parameters) must
be stock's within 1e-3 (relative, as in the single-process tests), training must have moved the parameters, every
rank must generate the same completions and log stock's metrics (the loss metrics, reduced per stock slice over both
processes, among them). Every launch's engine is checked against its config on every process: accelerate's
distributed type, and under FSDP2 and ZeRO-3 every parameter sharded, each process holding a part of each.
The lopsided-prompt runs (balancing off) give rank 1 prompts ~20x longer than rank 0's, so the ranks need
different numbers of micro-batches: without lockstep (all-reduce MAX + exact-k + dummy passes) ZeRO-2/3 and FSDP2
would hang. The balancing runs give rank 1 every long completion and check that samples move between the ranks and
the parameters stay stock's; the mutation runs damage what moved samples carry and check that this is caught.
Every launch runs under a timeout and every rank must write its result file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_dynbsz.testing import (
    accelerate_command,
    engine_mismatches,
    grpo_worker_command,
    metric_mismatches,
    relative_difference,
    run_with_timeout,
    save_tiny_model,
    update_difference,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
BACKENDS = {
    # backend: (accelerate config, loss settings exercised there)
    "ddp": ("cpu_ddp.yaml", dict(loss_type="bnpo", beta=0.1, num_iterations=2)),
    "zero1": (
        "cpu_zero1.yaml",
        dict(loss_type="grpo", beta=0.0, num_iterations=1, top_entropy_quantile=0.5, entropy_coef=0.01),
    ),
    "zero2": ("cpu_zero2.yaml", dict(loss_type="dapo", beta=0.0, num_iterations=2)),
    "zero3": ("cpu_zero3.yaml", dict(loss_type="dr_grpo", beta=0.1, num_iterations=1)),
    # FSDP2 (fsdp_version 2): with beta > 0 TRL builds the reference model from the model's name (a path here)
    "fsdp2": ("cpu_fsdp2.yaml", dict(loss_type="grpo", beta=0.05, num_iterations=2)),
}


def launch(config: str, out: Path, model_dir: str, trainer: str, **options) -> list[dict]:
    """Run tests/distributed_grpo.py on 2 processes; return each rank's record. Kills the group on timeout."""
    command = grpo_worker_command(config, out, model_dir, trainer, **options)
    run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} run under {config}")
    return read_records(out, config, trainer)


def read_records(out: Path, config: str, trainer: str, processes: int = 2) -> list[dict]:
    """Each rank's record of the run written under ``out``; every rank must have written one, and its engine must be
    what ``config`` (a file of ``accelerate_configs/``) asks for (:func:`~hf_dynbsz.testing.engine_mismatches`: under
    FSDP2 and ZeRO-3, every parameter sharded)."""
    records = []
    for rank in range(processes):
        path = Path(f"{out}.rank{rank}.json")
        assert path.exists(), f"rank {rank} did not finish ({config}, {trainer})"
        records.append(json.loads(path.read_text()))
    mismatches = engine_mismatches(records, config)
    assert not mismatches, f"{trainer} under {config}: {mismatches}"
    return records


#: The plugin's parameter update (final minus initial) against stock's, relative: the single-process tests' bound.
UPDATE_TOLERANCE = 1e-3
#: The least relative change of the parameters over a run (final against initial) that counts as trained: 100 times
#: the parameters' tolerance, so that runs that hardly moved cannot pass the comparison by standing still.
MOVED = 1e-3


def parameter_differences(our_out: Path | str, stock_out: Path | str) -> dict[str, float]:
    """The runs' parameters written under ``our_out`` and ``stock_out`` (``.initial.pt``, ``.params.pt``), compared:
    the initial ones (``initial``), the final ones (``parameters``), the updates (``update``:
    :func:`~hf_dynbsz.testing.update_difference`), and how far each run moved them (``moved_ours``,
    ``moved_stock``), all relative."""
    initial, stock_initial = torch.load(f"{our_out}.initial.pt"), torch.load(f"{stock_out}.initial.pt")
    ours, stock = torch.load(f"{our_out}.params.pt"), torch.load(f"{stock_out}.params.pt")
    return dict(
        initial=relative_difference(initial, stock_initial),
        parameters=relative_difference(ours, stock),
        update=update_difference(stock_initial, ours, stock),
        moved_ours=relative_difference(ours, initial),
        moved_stock=relative_difference(stock, stock_initial),
    )


def assert_parameters_match(our_out: Path | str, stock_out: Path | str) -> dict[str, float]:
    """Ours and stock's runs (output prefixes) started from the same parameters, both trained them (moved by at least
    :data:`MOVED`), and ours ended within 1e-5 of stock's parameters and :data:`UPDATE_TOLERANCE` of its update;
    returns :func:`parameter_differences`."""
    found = parameter_differences(our_out, stock_out)
    assert found["initial"] == 0.0, found
    assert found["moved_stock"] >= MOVED and found["moved_ours"] >= MOVED, found
    assert found["parameters"] <= 1e-5, found
    assert found["update"] <= UPDATE_TOLERANCE, found
    return found


#: Flags of tests/distributed_grpo.py that only the plugin's trainers read: stock's run is the same without them.
OURS_ONLY = frozenset(
    {"budget", "balance", "max_memory_mib", "inject_oom", "mutate", "oversize_policy", "tensor_batch_size"}
)


class SharedLaunches:
    """2-process runs of tests/distributed_grpo.py, each run once per module and shared by the tests that read it.

    A launch's start-up (about 14 s on 2 CPU cores) costs more than a tiny run (about 2 s): the runs a backend's
    tests compare (``shared_runs``, default ``SHARED_RUNS``) train in one launch per trainer (``--scenarios``), and a
    stock run other tests compare against too (named by its flags, ``OURS_ONLY`` left out) is launched once.
    ``trainer`` is the worker's ``--trainer`` (a stock one ends in ``stock``)."""

    def __init__(self, directory: Path, model_dir: str, shared_runs: dict | None = None) -> None:
        self.directory, self.model_dir, self.runs = directory, model_dir, {}
        self.shared_runs = SHARED_RUNS if shared_runs is None else shared_runs

    @staticmethod
    def flags(trainer: str, options: dict) -> dict:
        """The flags of ``options`` that ``trainer`` reads (stock: ``OURS_ONLY`` left out)."""
        stock = trainer.endswith("stock")
        return {name: value for name, value in options.items() if not stock or name not in OURS_ONLY}

    @classmethod
    def key(cls, trainer: str, config: str, model_dir: str, options: dict) -> tuple:
        return trainer, config, model_dir, tuple(sorted(cls.flags(trainer, options).items()))

    def get(self, trainer: str, config: str, model_dir: str, **options) -> tuple[Path, list[dict]]:
        """The output prefix and each rank's record of ``trainer``'s run with ``options``."""
        key = self.key(trainer, config, model_dir, options)
        if key not in self.runs:
            shared = self.shared_runs.get(config, {}) if model_dir == self.model_dir else {}
            group = {}  # one run per key not yet run (stock's runs of several scenarios can be one)
            for name, flags in shared.items():
                run = self.key(trainer, config, model_dir, flags)
                if run not in self.runs and run not in group:
                    group[run] = name, self.flags(trainer, flags)
            if key in group:
                self.launch_group(trainer, config, group)
            else:
                out = self.directory / f"{trainer}{len(self.runs)}"
                self.runs[key] = (out, launch(config, out, model_dir, trainer, **self.flags(trainer, options)))
        return self.runs[key]

    def launch_group(self, trainer: str, config: str, group: dict[tuple, tuple[str, dict]]) -> None:
        """One launch of ``trainer`` training every ``(name, flags)`` of ``group`` (keyed by run) in turn."""
        out = self.directory / f"{trainer}-{Path(config).stem}-{len(self.runs)}"
        scenarios = json.dumps(dict(group.values()))
        command = grpo_worker_command(config, out, self.model_dir, trainer, scenarios=scenarios)
        run_with_timeout(
            command, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} runs {sorted(dict(group.values()))} under {config}"
        )
        for key, (name, _) in group.items():
            self.runs[key] = (Path(f"{out}.{name}"), read_records(Path(f"{out}.{name}"), config, trainer))


@pytest.fixture(scope="module")
def shared_launches(tmp_path_factory, model_dir):
    return SharedLaunches(tmp_path_factory.mktemp("shared-launches"), model_dir)


def compare(config, model_dir, shared_launches, repacked=True, **options):
    """Ours against stock, both run with ``options`` under ``config``: same completions, every logged metric stock's
    on every rank (the loss metrics, which stock reduces per slice over both processes, among them), parameters and
    update stock's (:func:`assert_parameters_match`); ``repacked``: ours repacked steps (logged dynbsz metrics) on
    every rank."""
    stock_out, stock = shared_launches.get("stock", config, model_dir, **options)
    our_out, ours = shared_launches.get("dynamic", config, model_dir, **options)
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        assert bool(ours[rank]["metrics"]) == repacked, f"rank {rank}: dynbsz metrics {ours[rank]['metrics']}"
        assert not metric_mismatches(ours[rank]["logged"], stock[rank]["logged"]), f"rank {rank}'s logged metrics"
    assert_parameters_match(our_out, stock_out)
    return ours


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_matches_stock_across_two_processes(backend, model_dir, shared_launches):
    config, options = BACKENDS[backend]
    ours = compare(config, model_dir, shared_launches, **options)
    for rank in range(2):
        for step in ours[rank]["metrics"]:
            # lockstep: every rank ran the agreed number of passes
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )


#: Rank 1's prompts about 20x longer than rank 0's, balancing off: the ranks need different numbers of passes.
LOPSIDED_PROMPTS = dict(lopsided=True, budget=96, loss_type="bnpo", max_steps=2, balance="off")


@pytest.mark.parametrize("backend", ["ddp", "zero2", "zero3", "fsdp2"])
def test_lopsided_ranks_finish_and_match_stock(backend, model_dir, shared_launches):
    config, _ = BACKENDS[backend]
    ours = compare(config, model_dir, shared_launches, **LOPSIDED_PROMPTS)
    needed = [[step["dynbsz/microbatches_needed"] for step in record["metrics"]] for record in ours]
    ran = [[step["dynbsz/microbatches_max_over_ranks"] for step in record["metrics"]] for record in ours]
    # the short-prompt rank needed fewer passes than it ran: the ranks really disagreed and were aligned
    assert any(n < r for n, r in zip(needed[0], ran[0])), (needed, ran)
    assert ran[0] == ran[1]


# ---- cross-rank balancing: every long completion on rank 1 ------------------------------------------------------
BALANCED = {
    "ddp": ("cpu_ddp.yaml", dict(loss_type="grpo", beta=0.1, num_iterations=2)),
    "zero1": (
        "cpu_zero1.yaml",
        dict(loss_type="dapo", beta=0.1, num_iterations=2, top_entropy_quantile=0.5, entropy_coef=0.01),
    ),
    "zero2": ("cpu_zero2.yaml", dict(loss_type="bnpo", beta=0.0, num_iterations=2)),
    "zero3": ("cpu_zero3.yaml", dict(loss_type="dr_grpo", beta=0.1, num_iterations=2)),
    "fsdp2": (
        "cpu_fsdp2.yaml",
        dict(loss_type="dapo", beta=0.1, num_iterations=2, top_entropy_quantile=0.5, entropy_coef=0.01),
    ),
}
LOPSIDED_ROLLOUT = dict(rollout="lopsided", budget=64, max_steps=3)

#: Vision-language samples moved between 2 DDP processes (test_balancing_moves_image_samples_...).
VISION_FAMILIES = ("qwen2_vl", "llava")
VISION_RUN = dict(loss_type="grpo", num_iterations=2, max_steps=2, budget=120)
#: Scripted multi-turn rollouts with an environment mask under DDP, per loss type (test_multiturn_rollouts_...).
ROLLOUT_LOSS_TYPES = ("grpo", "dapo", "bnpo")
MULTITURN_RUN = dict(rollout="multiturn", max_steps=2, budget=48)
#: A hybrid model (Gated DeltaNet layers) balanced across 2 processes, under DDP and ZeRO-3 (test_a_hybrid_...).
HYBRID_RUNS = {
    backend: dict(architecture="qwen3_next", router_aux_loss_coef=0.0, **LOPSIDED_ROLLOUT, **BALANCED[backend][1])
    for backend in ("ddp", "zero3", "fsdp2")
}
#: A LongRoPE model (original length 20) on the lopsided rollout under DDP: process 1's rounds are 26-32 tokens wide in
#: stock (the long factors), process 0's under 12 (the short ones); balancing moves process 1's samples, each with its
#: factors, to process 0 (test_long_rope_samples_moved_between_processes_...).
LONG_ROPE_RUN = dict(architecture="llama_longrope_20", **LOPSIDED_ROLLOUT, **BALANCED["ddp"][1])
#: Loss types with loss metrics of their own (cispo's clip ratio; vespo's phi, one value per sequence), with the KL
#: term (a token mean per slice), every long completion on rank 1, under DDP (test_the_loss_metrics_of_moved_...).
METRIC_RUNS = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}
METRIC_RUN = dict(LOPSIDED_ROLLOUT, beta=0.1, num_iterations=2)
#: What a moved sample loses in the mutation runs (test_a_moved_sample_that_loses_...).
DAMAGES = ("advantage", "old_logps", "weight")
#: A Qwen3-MoE with TRL's router aux loss (coefficient 1, so a mis-weighted aux loss shows), every long completion on
#: rank 1, per backend (test_moe_router_aux_loss_...).
MOE_RUNS = {
    "ddp": dict(
        architecture="qwen3_moe", router_aux_loss_coef=1.0, **LOPSIDED_ROLLOUT, loss_type="grpo", num_iterations=2
    ),
    "zero2": dict(
        architecture="qwen3_moe", router_aux_loss_coef=1.0, **LOPSIDED_ROLLOUT, loss_type="dapo", num_iterations=1
    ),
}
#: A prefix tree across two processes (test_a_prefix_tree_...): a block every prompt begins with, each prompt's
#: completions sharing a trunk and branches, every long leaf on rank 1. Moving whole subtrees left the busier rank
#: 1.23-1.25x the mean; balancing cuts a subtree across the ranks (its path computed on both) to 1.01x.
PREFIX_RUNS = {
    "ddp": dict(rollout="prefix", budget=96, max_steps=3, loss_type="grpo", beta=0.1, num_iterations=2),
    "zero3": dict(rollout="prefix", budget=96, max_steps=3, loss_type="dapo", beta=0.1, num_iterations=2),
    "fsdp2": dict(rollout="prefix", budget=96, max_steps=3, loss_type="bnpo", beta=0.05, num_iterations=2),
}
#: An out-of-memory error injected on one process under DDP with a memory limit (test_an_out_of_memory_pass_...).
#: A forward that raises leaves DDP's buffer-broadcast flag as the pass before set it: the process settles it as the
#: others' completed passes did (``OutOfMemoryRecovery.settle``), or it broadcast alone in its next forward and hung.
OOM_INJECTIONS = ("training:backward:1:1", "training:forward:1:1", "logprob:forward:1:0")
OOM_RUN = dict(LOPSIDED_ROLLOUT, loss_type="grpo", beta=0.1, num_iterations=2, max_memory_mib=200_000, budget=0)
#: An out-of-memory error in process 1's self-check at start, in its sixth pass (a sample alone with gradients):
#: test_an_out_of_memory_error_in_one_process_self_check_...
CHECK_OOM_RUN = dict(OOM_RUN, inject_oom="check:forward:5:1")
#: Sequence parallelism over both processes under FSDP2 (test_under_fsdp2_sequence_parallelism_...): a budget of 24
#: tokens per process, 48 per pass of the group.
FSDP2_SEQUENCE_PARALLEL_RUN = dict(sequence_parallel=2, budget=24, beta=0.1)
#: Image steps under FSDP2 (test_under_fsdp2_image_steps_...): lopsided completions, balancing off, as under ZeRO-3.
FSDP2_VISION_RUN = dict(vision="qwen2_vl", loss_type="grpo", num_iterations=2, max_steps=2, budget=60, balance="off")

#: TRL's vLLM path through the stand-in (hf_dynbsz.testing.vllm_standin), rank 1's prompts long so that balancing moves
#: samples with their vLLM log-probs and importance-sampling ratios (test_the_vllm_path_matches_stock_...).
VLLM_RUNS = {
    "server": dict(vllm="server", vllm_is_mode="token_truncate", loss_type="grpo", num_iterations=2, max_steps=3),
    "colocate": dict(vllm="colocate", vllm_is_mode="sequence_mask", loss_type="dapo", max_steps=2),
}
VLLM_RUNS = {mode: dict(lopsided=True, budget=96, **flags) for mode, flags in VLLM_RUNS.items()}

#: Per accelerate config, the runs its tests compare, each trained by one launch per trainer (``SharedLaunches``).
SHARED_RUNS = {
    config: {
        "plain": BACKENDS[backend][1],
        "balanced": {**LOPSIDED_ROLLOUT, **BALANCED[backend][1]},
        **({"lopsided_prompts": LOPSIDED_PROMPTS} if backend != "zero1" else {}),
    }
    for backend, (config, _) in BACKENDS.items()
}
SHARED_RUNS["cpu_ddp.yaml"].update(
    {f"vision_{family}": dict(vision=family, **VISION_RUN) for family in VISION_FAMILIES}
    | {f"multiturn_{loss}": dict(MULTITURN_RUN, loss_type=loss) for loss in ROLLOUT_LOSS_TYPES}
    | {f"damaged_{what}": dict(mutate=what, **LOPSIDED_ROLLOUT, **BALANCED["ddp"][1]) for what in DAMAGES}
    | {"hybrid": HYBRID_RUNS["ddp"], "moe": MOE_RUNS["ddp"], "long_rope": LONG_ROPE_RUN}
    | {f"metrics_{loss}": dict(METRIC_RUN, loss_type=loss) for loss in METRIC_RUNS}
    | {f"vllm_{mode}": flags for mode, flags in VLLM_RUNS.items()}
    | {f"oom_{'_'.join(injection.split(':')[:2])}": dict(OOM_RUN, inject_oom=injection) for injection in OOM_INJECTIONS}
    | {"oom_check": CHECK_OOM_RUN}
)
SHARED_RUNS["cpu_zero2.yaml"]["moe"] = MOE_RUNS["zero2"]
SHARED_RUNS["cpu_ddp.yaml"]["prefix"] = PREFIX_RUNS["ddp"]
SHARED_RUNS["cpu_zero3.yaml"]["prefix"] = PREFIX_RUNS["zero3"]
SHARED_RUNS["cpu_zero3.yaml"]["hybrid"] = HYBRID_RUNS["zero3"]
SHARED_RUNS["cpu_fsdp2.yaml"].update(
    {"hybrid": HYBRID_RUNS["fsdp2"], "memory": OOM_RUN, "vision_qwen2_vl": FSDP2_VISION_RUN}
    | {"sequence_parallel": FSDP2_SEQUENCE_PARALLEL_RUN, "prefix": PREFIX_RUNS["fsdp2"]}
)


@pytest.mark.parametrize("backend", list(BALANCED))
def test_balancing_lopsided_rollouts_matches_stock(backend, model_dir, shared_launches):
    config, options = BALANCED[backend]
    ours = compare(config, model_dir, shared_launches, **LOPSIDED_ROLLOUT, **options)
    for rank in range(2):
        steps = ours[rank]["metrics"]
        assert len(steps) == 3
        for step in steps:
            assert step["dynbsz/samples_moved"] > 0
            assert step["dynbsz/rank_imbalance_before"] > 1.5 > 1.1 > step["dynbsz/rank_imbalance_after"]
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )


def test_long_rope_samples_moved_between_processes_keep_their_stock_factors(model_dir, shared_launches):
    """Process 1's samples take LongRoPE's long factors in stock (their round is past the original length), process
    0's the short ones; balancing runs some of process 1's on process 0, in passes with its own."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, **LONG_ROPE_RUN)
    for rank in range(2):
        assert all(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])


@pytest.mark.parametrize("loss_type", list(METRIC_RUNS))
def test_the_loss_metrics_of_moved_samples_are_stocks(loss_type, model_dir, shared_launches):
    """Each sample counts in its stock slice's figures on the process it moved to: the loss type's own metric, ``kl``
    and ``entropy`` logged with stock's values, which stock reduces per slice over both processes."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, **METRIC_RUN, loss_type=loss_type)
    for rank in range(2):
        assert all(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])
        logged = [entry for entry in ours[rank]["logged"] if "entropy" in entry]
        assert len(logged) == 3 and all({"kl", METRIC_RUNS[loss_type]} <= set(entry) for entry in logged)
        assert len({entry[METRIC_RUNS[loss_type]] for entry in logged}) > 1  # the figure moves from step to step


@pytest.mark.parametrize("backend", list(PREFIX_RUNS))
def test_a_prefix_tree_across_two_processes_matches_stock(backend, model_dir, shared_launches):
    """The default prefix tree: the block once per pass across prompts, trunks once per prompt, samples moved to the
    other process with the subtree they share a pass with, or a subtree cut across the processes (each part with its
    path); parameters equal stock's under DDP, ZeRO-3 and FSDP2 (its decoder layers gathered around the tree's segment
    attention; the self-check compares log-probs there)."""
    ours = compare(BACKENDS[backend][0], model_dir, shared_launches, **PREFIX_RUNS[backend])
    steps = [step for record in ours for step in record["metrics"]]
    assert max(step["dynbsz/tree_tokens_saved"] for step in steps) > 0  # beyond prompt groups
    assert max(step["dynbsz/samples_moved"] for step in steps) > 0
    assert max(step["dynbsz/units_split"] for step in steps) > 0  # a subtree on both processes
    assert all(
        step["dynbsz/rank_imbalance_after"] < 1.05 < 1.4 < step["dynbsz/rank_imbalance_before"] for step in steps
    )


@pytest.fixture(scope="module")
def stock_lopsided_params(model_dir, shared_launches):
    out, _ = shared_launches.get("stock", "cpu_ddp.yaml", model_dir, **LOPSIDED_ROLLOUT, **BALANCED["ddp"][1])
    return torch.load(f"{out}.params.pt")


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_moved_sample_that_loses_what_belongs_to_it_is_caught(
    damage, model_dir, shared_launches, stock_lopsided_params
):
    out, _ = shared_launches.get(
        "dynamic", "cpu_ddp.yaml", model_dir, mutate=damage, **LOPSIDED_ROLLOUT, **BALANCED["ddp"][1]
    )
    damaged = torch.load(f"{out}.params.pt")
    assert relative_difference(damaged, stock_lopsided_params) > 100 * 1e-5


@pytest.mark.parametrize("vllm_mode", list(VLLM_RUNS))
def test_the_vllm_path_matches_stock_across_two_processes(vllm_mode, model_dir, shared_launches):
    """Server mode: the main process's engine serves both processes' prompts (TRL gathers and broadcasts them);
    colocate mode: an engine per process. Stock's importance-sampling figures, parameters within 1e-5."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, **VLLM_RUNS[vllm_mode])
    _, stock = shared_launches.get("stock", "cpu_ddp.yaml", model_dir, **VLLM_RUNS[vllm_mode])
    engines = [[[2, 2]], []] if vllm_mode == "server" else [[[2, 2]], [[2, 2]]]  # [weight syncs, requests] per rank
    for rank in range(2):
        assert ours[rank]["vllm_engines"] == stock[rank]["vllm_engines"] == engines[rank]
        assert len(ours[rank]["sampling"]) == len(stock[rank]["sampling"]) == 2  # one entry per generation round
        for our_round, stock_round in zip(ours[rank]["sampling"], stock[rank]["sampling"]):
            assert our_round == pytest.approx(stock_round, rel=1e-5, abs=1e-6)
            assert our_round["sampling/sampling_logp_difference/mean"] > 0.1  # the stand-in's noise to correct
        assert any(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_a_hybrid_model_balanced_across_processes_matches_stock(backend, model_dir, shared_launches):
    """Qwen3-Next-style Gated DeltaNet layers run per sequence (segment recurrence): padding-free rows with shared
    prompts, samples moved between the processes, parameters equal to stock's. FSDP2 gathers a module's parameters at
    each call only for the modules it shards on its own (accelerate's transformer wrap: the decoder layers, the model's
    ``_no_split_modules``, and the whole model): the mixers run inside their layer's gather, so segment recurrence
    stays on there, unlike under ZeRO-3."""
    ours = compare(BACKENDS[backend][0], model_dir, shared_launches, **HYBRID_RUNS[backend])
    steps = [step for record in ours for step in record["metrics"]]
    assert max(step["dynbsz/samples_moved"] for step in steps) > 0
    assert max(step["dynbsz/shared_tokens_saved"] for step in steps) > 0
    assert all(step["dynbsz/padding_fraction"] == 0 for step in steps)


def test_under_zero3_a_hybrid_model_trains_padded_rows_and_matches_stock(model_dir, shared_launches):
    """ZeRO-3 gathers a module's parameters at each call, with every process: segment recurrence (a mixer call per
    run length, which differs between processes) is off, and the rows are padded."""
    ours = compare("cpu_zero3.yaml", model_dir, shared_launches, **HYBRID_RUNS["zero3"])
    steps = [step for record in ours for step in record["metrics"]]
    assert max(step["dynbsz/samples_moved"] for step in steps) > 0
    assert all(step["dynbsz/shared_tokens_saved"] == 0 for step in steps)
    assert max(step["dynbsz/padding_fraction"] for step in steps) > 0


def test_under_fsdp2_image_steps_keep_stocks_slices_and_every_process_finishes(model_dir, shared_launches):
    """FSDP2 shards the vision tower's blocks on their own (Qwen2-VL's ``_no_split_modules`` names them) and gathers
    them in every forward that runs them; repacked passes differ between the processes in how many do (lopsided
    completions, balancing off: the short process pads with lockstep passes, which have no image). Image steps keep
    stock's slices, as under ZeRO-3, and match stock."""
    compare("cpu_fsdp2.yaml", model_dir, shared_launches, repacked=False, **FSDP2_VISION_RUN)


def test_under_fsdp2_the_budget_from_memory_is_agreed_and_matches_stock(model_dir, shared_launches):
    """``max_memory_per_device_mib`` under FSDP2: every step's budget is the largest whose predicted peak fits,
    agreed by both processes; an out-of-memory error is not recovered there (``test_an_out_of_memory_pass_under_...``
    below)."""
    ours = compare("cpu_fsdp2.yaml", model_dir, shared_launches, **OOM_RUN)
    budgets = [[step["dynbsz/budget_tokens"] for step in record["metrics"]] for record in ours]
    assert budgets[0] == budgets[1] and len(budgets[0]) == 3
    for record in ours:
        assert all(step["dynbsz/predicted_peak_memory_mib"] > 0 for step in record["metrics"])
        assert all(step["dynbsz/oom_retries"] == 0 for step in record["metrics"])


def test_under_fsdp2_sequence_parallelism_matches_stock(model_dir, shared_launches):
    """DeepSpeed Ulysses on the plugin's packed rows (one group of both processes) with FSDP2 sharding the
    parameters over the same processes: each pass's all-to-alls run inside the layers' gathers, in the same order
    on both processes."""
    ours = compare("cpu_fsdp2.yaml", model_dir, shared_launches, **FSDP2_SEQUENCE_PARALLEL_RUN)
    for record in ours:
        assert all(step["dynbsz/budget_tokens"] == 48 for step in record["metrics"])
        assert any(step["dynbsz/shared_tokens_saved"] > 0 for step in record["metrics"])


# ---- vision-language samples moved between processes, 2-process DDP --------------------------------------------
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_balancing_moves_image_samples_with_their_images_and_matches_stock(family, model_dir, shared_launches):
    """Rank 1 gets every long completion: samples (their images, token fields and, for Qwen2-VL, M-RoPE positions
    computed where they run) move to rank 0, in the training passes and the old-policy pass (num_iterations 2)."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, vision=family, **VISION_RUN)
    moved = [step.get("dynbsz/samples_moved", 0) for record in ours for step in record["metrics"]]
    assert max(moved) > 0, moved


@pytest.mark.long
def test_image_steps_keep_stocks_slices_under_zero3_and_every_process_finishes(tmp_path, model_dir):
    """ZeRO-3 gathers the vision tower in every forward that runs it. Repacked passes differ between the processes in
    how many run it (lopsided completions, balancing off: the short rank pads with lockstep passes, which have no
    image), which hung every process; image steps now keep stock's slices there, and match stock."""
    options = dict(vision="qwen2_vl", loss_type="grpo", num_iterations=2, max_steps=2, budget=60, balance="off")
    stock = launch("cpu_zero3.yaml", tmp_path / "stock", model_dir, "stock", **options)
    ours = launch("cpu_zero3.yaml", tmp_path / "ours", model_dir, "dynamic", **options)
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"]
        assert not ours[rank]["metrics"]  # every step of this run has images: none was repacked
    assert_parameters_match(tmp_path / "ours", tmp_path / "stock")


# ---- tool and environment rollouts, 2-process DDP ----------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-chat-model")), chat=True)


@pytest.mark.parametrize("loss_type", ROLLOUT_LOSS_TYPES)
def test_multiturn_rollouts_with_an_environment_mask_match_stock(loss_type, model_dir, shared_launches):
    compare("cpu_ddp.yaml", model_dir, shared_launches, loss_type=loss_type, **MULTITURN_RUN)


@pytest.mark.long
def test_environment_rollouts_match_stock(tmp_path, chat_model_dir):
    """An environment that owns the prompts (no dataset) and the reward; one launch per trainer trains every loss
    type in turn (``--loss_types``)."""
    options = dict(rollout="environment", loss_types=",".join(ROLLOUT_LOSS_TYPES), max_steps=2, budget=1600)
    for trainer in ("stock", "dynamic"):
        command = grpo_worker_command("cpu_ddp.yaml", tmp_path / trainer, chat_model_dir, trainer, **options)
        run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} environment rollouts under DDP")
    for loss_type in ROLLOUT_LOSS_TYPES:
        records = {
            trainer: read_records(Path(f"{tmp_path / trainer}.{loss_type}"), "cpu_ddp.yaml", trainer)
            for trainer in ("stock", "dynamic")
        }
        for rank in range(2):
            assert records["dynamic"][rank]["completions"] == records["stock"][rank]["completions"]
            assert records["dynamic"][rank]["metrics"], f"rank {rank} logged no dynbsz metrics ({loss_type})"
        assert any(reward != 0 for reward in records["stock"][0]["rewards"])  # the environment's reward counted
        assert_parameters_match(f"{tmp_path / 'dynamic'}.{loss_type}", f"{tmp_path / 'stock'}.{loss_type}")


# ---- mixture-of-experts with TRL's router aux loss: every long completion on rank 1, samples moved -------------
@pytest.mark.parametrize("backend", list(MOE_RUNS))
def test_moe_router_aux_loss_matches_stock_across_two_processes(backend, model_dir, shared_launches):
    """Stock slices' expert counts are summed over the processes and each moved sample keeps its own slice's: the
    parameters and the logged aux_loss equal stock's (coefficient 1, so a mis-weighted aux loss would show)."""
    config, _ = BACKENDS[backend]
    ours = compare(config, model_dir, shared_launches, **MOE_RUNS[backend])
    _, stock = shared_launches.get("stock", config, model_dir, **MOE_RUNS[backend])
    for rank in range(2):
        assert any(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])
        assert len(ours[rank]["aux_losses"]) == len(stock[rank]["aux_losses"]) == 3
        assert ours[rank]["aux_losses"] == pytest.approx(stock[rank]["aux_losses"], rel=1e-5)


def test_a_diffu_variable_set_on_one_process_only_stops_every_process_clearly(tmp_path, model_dir):
    """DIFFU_* variables come from each process's environment; a node without the export must not hang the run."""
    with pytest.raises(AssertionError) as failed:
        launch("cpu_ddp.yaml", tmp_path / "split", model_dir, "dynamic", rank1_env="DIFFU_MAX_TOKENS=64", budget=40)
    message = str(failed.value)
    assert "did not finish" not in message  # no hang: every process stopped at construction
    assert "max_tokens_per_microbatch differs between processes (process 0: 40, process 1: 64)" in message
    assert "here it came from DIFFU_MAX_TOKENS=64" in message  # process 1 names its variable


# ---- a user's script, without trainer.end(), exits cleanly every time -------------------------------------------
EXIT_SERIES = {
    # name: (accelerate config, extra options, launches)
    "ddp": ("cpu_ddp.yaml", {}, 50),
    "zero2": ("cpu_zero2.yaml", {}, 10),
    "sequence_parallel": ("cpu_ddp.yaml", {"sequence_parallel": 2}, 10),
}


#: One test per launch (a slow launch under load does not take the others' time, and every status is reported).
EXIT_LAUNCHES = [(series, number) for series, (_, _, launches) in EXIT_SERIES.items() for number in range(launches)]


@pytest.mark.exits
@pytest.mark.parametrize(("series", "launch_number"), EXIT_LAUNCHES, ids=[f"{s}-{n}" for s, n in EXIT_LAUNCHES])
def test_a_script_without_trainer_end_exits_cleanly_every_time(series, launch_number, tmp_path, model_dir):
    """TRL's own scripts return after trainer.train(). Here process 0 gets every long completion, so balancing moves
    samples every step, and with ``--plain_exit`` the script has no barrier of its own at the end: process 0 works on
    for a second, then saves the parameters, while process 1 returns. Every launch must exit 0 (run_with_timeout
    raises on any other status) and print no abort."""
    config, extra, _ = EXIT_SERIES[series]
    out = tmp_path / f"run{launch_number}"
    command = grpo_worker_command(
        config, out, model_dir, "dynamic", plain_exit=True, max_steps=3, rollout="lopsided", long_rank=0,
        linger=1, budget=64, **extra,
    )  # fmt: skip
    output = run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"{series} launch {launch_number} without trainer.end()")
    assert "terminate called" not in output, output[-2000:]
    records = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]
    if series != "sequence_parallel":  # one group of two: nothing to balance between groups
        assert all(step["dynbsz/samples_moved"] > 0 for step in records[0]["metrics"]), "balancing moved nothing"


#: Launches of tests/exit_lopsided.py in the exit soak (on top of EXIT_SERIES's 70).
EXIT_LOPSIDED_LAUNCHES = 20


@pytest.mark.exits
@pytest.mark.parametrize("launch_number", range(EXIT_LOPSIDED_LAUNCHES))
def test_the_reported_lopsided_script_exits_cleanly_every_time(launch_number, tmp_path):
    """tests/exit_lopsided.py, the plain DDP script with which the abort at exit was reported (issue 43): hidden size
    256, 4 layers, one thread per process, completions of median ~270 tokens on process 0 and ~25 on process 1
    (balancing moves samples every step), dapo, 3 steps; process 0 saves its parameters while process 1 returns. It
    aborted process 1 in 3 of 60 launches before the plugin held its collectives' tensors and waited at exit."""
    out = tmp_path / f"run{launch_number}"
    command = accelerate_command("cpu_ddp.yaml", "tests/exit_lopsided.py", out)
    output = run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, f"lopsided launch {launch_number}")
    assert "terminate called" not in output, output[-2000:]
    for rank in range(2):
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert record["samples_moved"] and all(moved > 0 for moved in record["samples_moved"])
    assert Path(f"{out}.params.pt").exists()


# ---- the budget from memory, and an out-of-memory pass recovered across processes --------------------------------
@pytest.mark.parametrize("inject_oom", OOM_INJECTIONS)
def test_an_out_of_memory_pass_on_one_process_is_replanned_by_all_and_matches_stock(
    inject_oom, model_dir, shared_launches
):
    """DDP with a memory limit: one process's pass raises, every process re-plans the step, the update is stock's."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, **dict(OOM_RUN, inject_oom=inject_oom))
    for rank in range(2):
        steps = ours[rank]["metrics"]
        assert sum(step["dynbsz/oom_retries"] for step in steps) == 1
        assert all(step["dynbsz/predicted_peak_memory_mib"] > 0 for step in steps)
        assert [step["dynbsz/budget_tokens"] for step in steps] == [
            s["dynbsz/budget_tokens"] for s in ours[0]["metrics"]
        ]


def test_an_out_of_memory_error_in_one_process_self_check_is_recovered_by_all_and_matches_stock(
    model_dir, shared_launches
):
    """DDP: process 1's self-check runs out of memory; its vote stops the check on both processes, both check again
    on smaller probes and keep the same layout (the run repacks on both and does not hang), and the update is
    stock's."""
    ours = compare("cpu_ddp.yaml", model_dir, shared_launches, **CHECK_OOM_RUN)
    summaries = [record["self_check"] for record in ours]
    assert (
        "ran out of memory (_InjectedOutOfMemory: injected out-of-memory error (check forward, process 1)"
        in (summaries[1])
    )
    assert "a pass of another process's self-check ran out of memory" in summaries[0]
    assert all("check ran again on smaller probes" in summary for summary in summaries), summaries


#: Why an out-of-memory error is not recovered, per engine that gathers parameters at module calls.
UNRECOVERED = {"zero3": "is not recovered under DeepSpeed", "fsdp2": "is not recovered under FSDP on several processes"}


@pytest.mark.long
@pytest.mark.parametrize("backend", list(UNRECOVERED))
def test_an_out_of_memory_pass_under_a_sharding_engine_stops_every_process_with_the_reason(
    backend, tmp_path, model_dir
):
    """DeepSpeed does not let a step's gradients be discarded, and under FSDP every pass gathers each layer's
    parameters with the other processes (a recovered pass hung the other process in its gather): the failing process
    stops with why, and the launcher stops the other (which waits in a parameter gather): no process hangs."""
    config, _ = BACKENDS[backend]
    command = grpo_worker_command(
        config, tmp_path / "ours", model_dir, "dynamic", inject_oom="training:forward:1:1", max_memory_mib=200000
    )
    # a hang raises on the timeout (every process killed); exiting 0 raises too
    output = run_with_timeout(
        command, ROOT, LAUNCH_TIMEOUT_S, f"{backend} run with an out-of-memory error", expect_failure=True
    )
    assert "injected out-of-memory error (training forward, process 1)" in output
    assert UNRECOVERED[backend] in output
