"""Worker for the multi-process DPO tests: ``accelerate launch --config_file <yaml> tests/distributed_dpo.py ...``.

Trains stock ``DPOTrainer`` (``--trainer stock``) or ``DynamicBatchDPOTrainer`` (``--trainer dynamic``) from a saved
tiny model (by path: stock builds the reference from the same path and prepares it for the launch's engine: a
DeepSpeed engine under ZeRO-3, an FSDP2 module under FSDP) on long-tailed preference pairs, once per named set of
config fields of ``--scenarios`` (JSON ``{"name": {"field": value}}``; files suffixed ``.name``: a launch's start-up
costs more than a tiny run), and writes each rank's record (every metric it logged but the timings, the plugin's
figures apart, and the engine it trained under: ZeRO-3 partitioned parameters, FSDP2's DTensor shards) and, from rank
0, the final gathered parameters. Under FSDP on CPU processes :func:`~hf_dynbsz.testing.fsdp_on_cpu` makes
accelerate shard for real.
"""

from __future__ import annotations

import json
import os

from hf_dynbsz.testing import (
    dpo_config,
    fsdp_on_cpu,
    gathered_parameters,
    leave_worker,
    load_tokenizer,
    logged_metrics,
    preference_pairs,
    scenario_worker_arguments,
    write_worker_results,
)

#: Fields only DynamicBatchDPOConfig has (left out of a stock run's config).
OURS_ONLY = ("max_tokens_per_microbatch", "max_tokens_per_microbatch_logprob", "balance_across_ranks")


def long_tailed(rng, n):
    """Response lengths with a long tail (1-60 tokens, most short)."""
    return [min(int(v), 60) for v in rng.geometric(0.08, n)]


def train(cli, name: str, fields: dict):
    from peft import LoraConfig
    from trl import DPOTrainer

    from hf_dynbsz import DynamicBatchDPOTrainer

    plugin = cli.trainer == "dynamic"
    fields = dict(fields)
    lora = fields.pop("lora", False)
    pairs = fields.pop("pairs", 32)
    system = fields.pop("system", 0)
    if not plugin:
        fields = {key: value for key, value in fields.items() if key not in OURS_ONLY}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        fields.setdefault("ddp_backend", "gloo")
    args = dpo_config(f"{cli.out}.{name}.output", plugin=plugin, **fields)
    dataset = preference_pairs(pairs, seed=11, prompt=(3, 30), response=long_tailed, system=system)
    trainer_class = DynamicBatchDPOTrainer if plugin else DPOTrainer
    kwargs = {}
    if lora:
        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = trainer_class(
        model=cli.model_dir, args=args, train_dataset=dataset, processing_class=load_tokenizer(cli.model_dir), **kwargs
    )
    trainer.train()
    write_results(trainer, f"{cli.out}.{name}")
    return trainer


def engine_of(trainer) -> dict:
    """What the launch's engine did to the trained model and the reference: ZeRO-3 partitioned their parameters (each
    process holds a shard of the large ones), FSDP2 made them DTensors."""
    from torch.distributed.tensor import DTensor

    def partitioned(model) -> bool:  # every parameter ZeRO-3's, the large ones each process holds a shard of
        parameters = list(model.parameters())
        return all(hasattr(p, "ds_id") for p in parameters) and any(
            p.ds_tensor.numel() < p.ds_numel for p in parameters
        )

    reference = trainer.ref_model
    return {
        "zero3_partitioned": partitioned(trainer.model_wrapped) and (reference is None or partitioned(reference)),
        "fsdp_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters())
        and (reference is None or all(isinstance(p, DTensor) for p in reference.parameters())),
        "reference": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
    }


def write_results(trainer, out: str) -> None:
    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model_wrapped)
    engine = engine_of(trainer)
    params = gathered_parameters(unwrapped)  # ZeRO-3 partitions, FSDP2 shards: every process takes part
    record = {
        "rank": accelerator.process_index,
        "metrics": [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry],
        "logged": logged_metrics(trainer.state.log_history),
        "engine": engine,
    }
    write_worker_results(accelerator, out, record, params)


def main() -> None:
    cli = scenario_worker_arguments(["stock", "dynamic"], scenario="field")
    fsdp_on_cpu()  # a distributed_type: FSDP launch on CPU processes runs FSDP, as on GPUs (else plain DDP)
    trainer = None
    for name, fields in json.loads(cli.scenarios).items():
        trainer = train(cli, name, fields)
    leave_worker(trainer)


if __name__ == "__main__":
    main()
