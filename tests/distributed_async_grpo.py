"""Worker for the asynchronous GRPO multi-process tests:
`accelerate launch --config_file <yaml> tests/distributed_async_grpo.py --trainer T --model_dir D --out O ...`.

Trains stock ``AsyncGRPOTrainer`` or ``DynamicBatchAsyncGRPOTrainer`` (``--trainer async_grpo_stock`` or
``async_grpo_dynamic``) from a saved tiny model on scripted rollout samples (:func:`hf_dynbsz.testing.async_grpo_run`:
the stand-in rollout worker on the main process, the no-op weight transfer, stock's tree kernel in plain torch) and
writes each rank's record (every logged metric, the plugin's ``dynbsz/*`` figures, what the engine did to the
parameters: :func:`~hf_dynbsz.testing.engine_record`) and, from rank 0, the final (gathered) parameters.

``--scenarios`` (JSON, ``{"name": {"flag": value, ...}, ...}``) trains once per named set of flags in the same launch
(files suffixed ``.name``): a launch's start-up costs more than a tiny run. The flags (:data:`FLAGS`): ``per_device``
and ``accumulation`` (the step's ``per_device_train_batch_size`` and ``gradient_accumulation_steps``), ``step`` (the
plugin's ``async_step``), ``budget`` (the plugin's ``token_budget`` for the samples step; stock runs its fixed-count
mode), ``stock_budget`` (``token_budget`` of both trainers for stock's step: stock's token-budget mode), ``passes``
(the plugin's ``max_tokens_per_microbatch``), ``balance`` ("on" or "off"), ``script``
(:class:`~hf_dynbsz.testing.RolloutScript` fields), ``architecture`` (a model of
:func:`~hf_dynbsz.testing.save_tiny_model`, saved here by the main process first), ``max_memory_mib``, ``steps``.
"""

from __future__ import annotations

import json
import os

from hf_dynbsz.testing import (
    ASYNC_UNCOMPARED,
    RolloutScript,
    async_grpo_run,
    engine_record,
    fsdp_on_cpu,
    gathered_parameters,
    leave_worker,
    logged_metrics,
    quiet_worker,
    save_tiny_model,
    scenario_worker_arguments,
    write_worker_results,
)

#: Each scenario's flags and their defaults (a step of 8 samples per process in one micro-batch).
FLAGS = dict(
    per_device=8, accumulation=1, budget=0, balance="on", script={}, architecture=None, max_memory_mib=None, steps=3
)
FLAGS.update(step="samples", stock_budget=0, passes=None)


def model_directory(model_dir: str, architecture: str | None, out: str) -> str:
    """``--model_dir``, or a model of ``architecture`` saved by the main process first."""
    from accelerate import PartialState

    if not architecture:
        return model_dir
    directory, state = f"{out}-{architecture}", PartialState()
    with state.main_process_first():
        if state.is_main_process:
            save_tiny_model(directory, architecture=architecture)
    return directory


def train(trainer: str, model_dir: str, out: str, flags: dict):
    """One run with ``flags``; writes each rank's record and, from rank 0, the parameters, under ``out``. Returns the
    trainer."""
    fields = dict(
        per_device_train_batch_size=flags["per_device"],
        gradient_accumulation_steps=flags["accumulation"],
        max_steps=flags["steps"],
        ddp_backend="gloo",
        token_budget=flags["stock_budget"],
    )
    if trainer.endswith("dynamic"):
        fields.update(
            async_step=flags["step"],
            max_tokens_per_microbatch=flags["passes"],
            token_budget=flags["budget"] if flags["step"] == "samples" else flags["stock_budget"],
            balance_across_ranks=flags["balance"] == "on",
            max_memory_per_device_mib=flags["max_memory_mib"],
        )
    directory = model_directory(model_dir, flags["architecture"], out)
    if flags["architecture"] in ("qwen3_next", "qwen3_moe"):
        fields.update(router_aux_loss_coef=None if flags["architecture"] == "qwen3_moe" else 0.0)
    run = async_grpo_run(
        trainer,
        directory,
        out + "-run",
        RolloutScript(**{"seed": 1, **flags["script"]}),
        num_processes=int(os.environ.get("WORLD_SIZE", "1")),
        **fields,
    )
    accelerator = run.trainer.accelerator
    history = run.trainer.state.log_history
    unwrapped = accelerator.unwrap_model(run.trainer.model_wrapped)
    record = {
        "rank": accelerator.process_index,
        "logged": logged_metrics(history, ASYNC_UNCOMPARED),
        "metrics": [entry for entry in history if "dynbsz/microbatches" in entry],
        "engine": engine_record(accelerator, unwrapped),
        "weight_syncs": run.transfer.syncs,
    }
    params = gathered_parameters(unwrapped)  # ZeRO-3 partitions, FSDP2 shards: every process takes part
    write_worker_results(accelerator, out, record, params)
    return run.trainer


def main() -> None:
    cli = scenario_worker_arguments(["async_grpo_stock", "async_grpo_dynamic"])
    fsdp_on_cpu()  # FSDP2 launches: accelerate's FSDP on CPU processes (before the trainer's Accelerator)
    quiet_worker()
    for name, flags in json.loads(cli.scenarios).items():
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise SystemExit(f"--scenarios {name}: unknown flags {sorted(unknown)}")
        trainer = train(cli.trainer, cli.model_dir, f"{cli.out}.{name}", {**FLAGS, **flags})
    leave_worker(trainer)


if __name__ == "__main__":
    main()
