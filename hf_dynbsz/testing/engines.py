"""What the engine of a multi-process run did with the parameters: recorded by the worker, checked by the test.

A launch under an FSDP2 or ZeRO-3 accelerate config that silently fell back to data parallelism (an accelerate
release that stops honouring :func:`~hf_dynbsz.testing.fsdp_on_cpu`, a DeepSpeed plugin left out) trains the same
parameters, so a comparison with stock passes either way. :func:`engine_record` writes down, per process, what
accelerate chose and how the parameters are held; :func:`engine_mismatches` compares that with what the config asks
for. :func:`gathered_parameters` gives a model's whole parameters whatever holds them (the runs' before and after).
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "engine_mismatches",
    "engine_record",
    "expected_engine",
    "gathered_parameters",
    "leave_worker",
    "write_worker_results",
]


def gathered_parameters(model) -> dict:
    """Every named parameter of ``model``, whole, detached, on the CPU: ZeRO-3 partitions gathered
    (``deepspeed.zero.GatheredParameters``), FSDP2's DTensor shards gathered (``full_tensor``), any other parameter as
    it is. Gathering is a collective: every process calls this at the same point."""
    from torch.distributed.tensor import DTensor

    named = list(model.named_parameters())
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {name: p.detach().clone().cpu() for name, p in named}
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().cpu() for name, p in named}


def write_worker_results(accelerator, out: str, record: dict, params: dict) -> None:
    """A multi-process worker's results, as the tests read them back: each process's ``record`` as
    ``<out>.rank<i>.json``, the main process's ``params`` (:func:`gathered_parameters`) as ``<out>.params.pt``; then
    every process waits for the others."""
    import json

    import torch

    with open(f"{out}.rank{accelerator.process_index}.json", "w") as handle:
        json.dump(record, handle)
    if accelerator.is_main_process:
        torch.save(params, f"{out}.params.pt")
    accelerator.wait_for_everyone()


def leave_worker(trainer) -> None:
    """The end of a multi-process worker whose results are written (:func:`write_worker_results`): ``trainer.end()``
    (the process group destroyed: gloo threads left at exit can abort a process after training), then the process
    leaves without interpreter finalization, where a torch/gloo teardown race (pytorch#190489) can still abort it,
    rarely, with "terminate called without an active exception" (seen once under stock AsyncGRPOTrainer's DDP run)."""
    import os
    import sys

    trainer.end()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def engine_record(accelerator, model) -> dict:
    """How this process holds ``model``'s parameters after preparation (``model``: the unwrapped module): accelerate's
    ``distributed_type``; how many parameters there are, how many are FSDP2 DTensors sharded over more than one
    process (a ``Shard`` placement on a mesh of 2 or more), how many are ZeRO-3 parameters (``ds_id``); and their
    elements: whole (``numel``) and held by this process (``local_numel``: a DTensor's local shard, a ZeRO-3
    parameter's partition ``ds_tensor``, any other parameter whole)."""
    from torch.distributed.tensor import DTensor

    record = dict(distributed_type=accelerator.distributed_type.value, parameters=0, dtensors=0, sharded_dtensors=0,
                  zero3=0, numel=0, local_numel=0)  # fmt: skip
    for p in model.parameters():
        record["parameters"] += 1
        if isinstance(p, DTensor):
            record["dtensors"] += 1
            sharded = p.device_mesh.size() > 1 and any(placement.is_shard() for placement in p.placements)
            record["sharded_dtensors"] += int(sharded)
            whole, local = p.numel(), p.to_local().numel()
        elif hasattr(p, "ds_id"):
            record["zero3"] += 1
            whole, local = p.ds_numel, p.ds_tensor.numel()
        else:
            whole = local = p.numel()
        record["numel"] += whole
        record["local_numel"] += local
    return record


def expected_engine(config: str | Path) -> tuple[str, str | None]:
    """What the accelerate config ``config`` (a path, or a file of ``accelerate_configs/``) makes of a CPU run:
    accelerate's ``distributed_type`` and how the parameters are sharded (``"fsdp2"``, ``"zero3"`` or None: whole on
    every process)."""
    import yaml

    from hf_dynbsz.testing.processes import REPO_ROOT

    path = Path(config)
    path = path if path.is_absolute() else REPO_ROOT / "accelerate_configs" / path
    settings = yaml.safe_load(path.read_text())
    kind = settings["distributed_type"]
    if kind == "FSDP":
        return "FSDP", "fsdp2" if int(settings["fsdp_config"].get("fsdp_version", 1)) == 2 else "fsdp1"
    if kind == "DEEPSPEED":
        return "DEEPSPEED", "zero3" if int(settings["deepspeed_config"]["zero_stage"]) == 3 else None
    return ("MULTI_CPU" if settings.get("use_cpu") else kind), None


def engine_mismatches(records: list[dict], config: str | Path) -> list[str]:
    """How the processes' :func:`engine_record` (each rank's record holds one under ``"engine"``) differ from what
    ``config`` asks for (:func:`expected_engine`); empty when they do not. Sharded: every parameter sharded the
    config's way, each process holding less than the whole and the processes together no more than the whole (plus
    ZeRO-3's padding of each partition: at most one element per parameter and process). Whole: no parameter sharded,
    every process holding the whole."""
    distributed_type, sharding = expected_engine(config)
    engines = [record["engine"] for record in records]
    found = []
    for rank, engine in enumerate(engines):
        if engine["distributed_type"] != distributed_type:
            found.append(f"rank {rank}: distributed_type {engine['distributed_type']}, not {distributed_type}")
        found += [f"rank {rank}: {problem}" for problem in _holding_mismatches(engine, sharding)]
    if sharding in ("fsdp2", "zero3"):
        padding = sum(engine["parameters"] for engine in engines) if sharding == "zero3" else 0
        held = sum(engine["local_numel"] for engine in engines)
        if held > engines[0]["numel"] + padding:
            found.append(f"the processes hold {held} elements of {engines[0]['numel']}: replicated, not sharded")
    return found


def _holding_mismatches(engine: dict, sharding: str | None) -> list[str]:
    """How one process's :func:`engine_record` differs from holding its parameters ``sharding``'s way."""
    if sharding is None:
        whole = not (engine["dtensors"] or engine["zero3"]) and engine["local_numel"] == engine["numel"]
        return [] if whole else [f"parameters sharded ({engine}) where the config keeps them whole"]
    if sharding not in ("fsdp2", "zero3"):
        return []
    found = []
    sharded = engine["sharded_dtensors"] if sharding == "fsdp2" else engine["zero3"]
    if not sharded == engine["dtensors"] + engine["zero3"] == engine["parameters"]:
        found.append(f"{sharded} of {engine['parameters']} parameters sharded ({sharding})")
    if not engine["local_numel"] < engine["numel"]:
        found.append(f"holds {engine['local_numel']} of {engine['numel']} elements ({sharding})")
    return found
