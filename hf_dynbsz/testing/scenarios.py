"""The multi-process preference tests' runs by named scenario (``tests/distributed_dpo.py``,
``tests/distributed_reward.py`` and their tests): one ``accelerate launch`` per backend and trainer trains every named
set of config fields in turn; the worker's fields and results, the test's launches, records and comparison with stock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "assert_lockstep",
    "compare_in_lockstep",
    "compare_scenario",
    "logged_mismatches",
    "long_tailed_responses",
    "rank_records",
    "run_scenarios",
    "scenario_fields",
    "scenario_launches",
    "scenario_pairs",
    "write_scenario_results",
    "zero3_partitioned",
]


# ---- the worker ---------------------------------------------------------------------------------------------------
def long_tailed_responses(rng, n):
    """Response lengths with a long tail (1-60 tokens, most short)."""
    return [min(int(v), 60) for v in rng.geometric(0.08, n)]


def scenario_pairs(count: int, system: int = 0):
    """The scenarios' preference pairs: prompts of 3-30 tokens, long-tailed responses
    (:func:`long_tailed_responses`), a system block of ``system`` tokens common to every pair; seed 11."""
    from hf_dynbsz.testing.preference import preference_pairs

    return preference_pairs(count, seed=11, prompt=(3, 30), response=long_tailed_responses, system=system)


def scenario_fields(plugin: bool, fields: dict, ours_only: tuple[str, ...], **worker: object) -> tuple[dict, dict]:
    """A scenario's config fields and the worker's own: ``worker`` names the worker's fields with their defaults,
    taken out of ``fields``; a stock run leaves out the fields only the plugin's config has (``ours_only``); under
    DeepSpeed the ``ddp_backend`` is gloo unless given. Returns ``(config fields, worker fields)``."""
    fields = dict(fields)
    own = {key: fields.pop(key, default) for key, default in worker.items()}
    if not plugin:
        fields = {key: value for key, value in fields.items() if key not in ours_only}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        fields.setdefault("ddp_backend", "gloo")
    return fields, own


def zero3_partitioned(model) -> bool:
    """Every parameter of ``model`` ZeRO-3's, the large ones each process holds a shard of."""
    parameters = list(model.parameters())
    return all(hasattr(p, "ds_id") for p in parameters) and any(p.ds_tensor.numel() < p.ds_numel for p in parameters)


def run_scenarios(train: Callable) -> None:
    """A scenario worker's run (:func:`~hf_dynbsz.testing.scenario_worker_arguments`, trainers ``stock`` and
    ``dynamic``): ``train(cli, name, fields)`` per named scenario in turn, then :func:`~hf_dynbsz.testing.leave_worker`
    with the last trainer."""
    from hf_dynbsz.testing.engines import leave_worker
    from hf_dynbsz.testing.harness import scenario_worker_arguments

    cli = scenario_worker_arguments(["stock", "dynamic"], scenario="field")
    trainer = None
    for name, fields in json.loads(cli.scenarios).items():
        trainer = train(cli, name, fields)
    leave_worker(trainer)


def write_scenario_results(trainer, out: str, engine: dict) -> None:
    """A trained scenario's results (:func:`~hf_dynbsz.testing.write_worker_results`): each rank's record (the
    plugin's metrics, every metric it logged but the timings, ``engine``) and the final gathered parameters."""
    from hf_dynbsz.testing.engines import gathered_parameters, write_worker_results
    from hf_dynbsz.testing.oracles import logged_metrics

    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model_wrapped)
    params = gathered_parameters(unwrapped)  # ZeRO-3 partitions, FSDP2 shards: every process takes part
    record = {
        "rank": accelerator.process_index,
        "metrics": [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry],
        "logged": logged_metrics(trainer.state.log_history),
        "engine": engine,
    }
    write_worker_results(accelerator, out, record, params)


# ---- the test -----------------------------------------------------------------------------------------------------
def scenario_launches(
    directory: Path, model_dir: str, runs: dict, common: dict, script: str, label: str, timeout: float
) -> Callable[[str, str], Path]:
    """Each backend's launch of ``script`` per trainer, run once when first asked for and shared: ``runs`` maps a
    backend to its accelerate config and its named runs' fields (each over ``common``); returns ``get(backend,
    trainer)``, the launch's output prefix."""
    from hf_dynbsz.testing.harness import accelerate_command
    from hf_dynbsz.testing.processes import REPO_ROOT, run_with_timeout

    done = {}

    def get(backend: str, trainer: str) -> Path:
        if (backend, trainer) not in done:
            config, named = runs[backend]
            scenarios = json.dumps({name: {**common, **fields} for name, fields in named.items()})
            out = directory / f"{trainer}-{backend}"
            arguments = ["--trainer", trainer, "--model_dir", model_dir, "--out", str(out), "--scenarios", scenarios]
            command = accelerate_command(config, script, *arguments)
            run_with_timeout(command, REPO_ROOT, timeout, f"{label} {trainer} runs under {config}")
            done[backend, trainer] = out
        return done[backend, trainer]

    return get


def rank_records(out: Path, name: str, processes: int = 2) -> list[dict]:
    """Each rank's record of the run ``name`` of the launch ``out``; every rank must have finished it."""
    paths = [Path(f"{out}.{name}.rank{rank}.json") for rank in range(processes)]
    assert all(path.exists() for path in paths), f"a rank did not finish {name}"
    return [json.loads(path.read_text()) for path in paths]


def compare_scenario(
    stock_out: Path, our_out: Path, name: str, mismatches: Callable[[list[dict], list[dict]], list[str]]
) -> list[dict]:
    """Ours against stock on the run ``name``: on every rank the plugin's metrics logged, ``mismatches(our logged,
    stock's logged)`` empty, the same engine; the final parameters within 1e-5. Returns each rank's record of ours."""
    import torch

    from hf_dynbsz.testing.oracles import relative_difference

    stock, ours = rank_records(stock_out, name), rank_records(our_out, name)
    for rank in range(2):
        assert ours[rank]["metrics"], f"rank {rank} logged no dynbsz metrics"
        found = mismatches(ours[rank]["logged"], stock[rank]["logged"])
        assert not found, f"rank {rank}: {found}"
        assert ours[rank]["engine"] == stock[rank]["engine"]
    ours_params = torch.load(f"{our_out}.{name}.params.pt")
    stock_params = torch.load(f"{stock_out}.{name}.params.pt")
    difference = relative_difference(ours_params, stock_params)
    assert difference <= 1e-5, difference
    return ours


def logged_mismatches(ours: list[dict], stock: list[dict], mismatches: Callable | None = None) -> list[str]:
    """Where two ranks' logs differ: ``mismatches`` (default :func:`~hf_dynbsz.testing.metric_mismatches`) of their
    :func:`~hf_dynbsz.testing.logged_metrics`, every logged metric but ``total_flos`` (transformers counts a ZeRO-3
    model's parameters as the process holds them when it counts, gathered or not)."""
    from hf_dynbsz.testing.oracles import logged_metrics, metric_mismatches

    return (mismatches or metric_mismatches)(*(logged_metrics(log, ("total_flos",)) for log in (ours, stock)))


def compare_in_lockstep(launches: Callable, backend: str, name: str, mismatches: Callable = logged_mismatches):
    """Ours against stock on the run ``name`` of ``backend``'s launches (``launches(backend, trainer)``:
    :func:`scenario_launches`): :func:`compare_scenario` with ``mismatches``, every rank in lockstep
    (:func:`assert_lockstep`). Returns each rank's record of ours."""
    ours = compare_scenario(launches(backend, "stock"), launches(backend, "dynamic"), name, mismatches)
    assert_lockstep(ours)
    return ours


def assert_lockstep(ours: list[dict]) -> None:
    """Every rank's passes, real and dummy, add up at every step to the most any rank ran."""
    for record in ours:
        for step in record["metrics"]:
            assert (
                step["dynbsz/microbatches"] + step["dynbsz/dummy_passes"] == step["dynbsz/microbatches_max_over_ranks"]
            )
