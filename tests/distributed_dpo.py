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

from hf_dynbsz.testing import dpo_config, fsdp_on_cpu, load_tokenizer, scenarios

#: Fields only DynamicBatchDPOConfig has (left out of a stock run's config).
OURS_ONLY = ("max_tokens_per_microbatch", "max_tokens_per_microbatch_logprob", "balance_across_ranks")


def train(cli, name: str, fields: dict):
    from peft import LoraConfig
    from trl import DPOTrainer

    from hf_dynbsz import DynamicBatchDPOTrainer

    plugin = cli.trainer == "dynamic"
    fields, own = scenarios.scenario_fields(plugin, fields, OURS_ONLY, lora=False, pairs=32, system=0)
    lora, pairs, system = own["lora"], own["pairs"], own["system"]
    args = dpo_config(f"{cli.out}.{name}.output", plugin=plugin, **fields)
    dataset = scenarios.scenario_pairs(pairs, system)
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

    reference = trainer.ref_model
    return {
        "zero3_partitioned": scenarios.zero3_partitioned(trainer.model_wrapped)
        and (reference is None or scenarios.zero3_partitioned(reference)),
        "fsdp_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters())
        and (reference is None or all(isinstance(p, DTensor) for p in reference.parameters())),
        "reference": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
    }


def write_results(trainer, out: str) -> None:
    scenarios.write_scenario_results(trainer, out, engine_of(trainer))


if __name__ == "__main__":
    fsdp_on_cpu()  # a distributed_type: FSDP launch on CPU processes runs FSDP, as on GPUs (else plain DDP)
    scenarios.run_scenarios(train)
