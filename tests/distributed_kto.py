"""Worker for the multi-process KTO tests: ``accelerate launch --config_file <yaml> tests/distributed_kto.py ...``.

Trains stock ``KTOTrainer`` (``--trainer stock``) or ``DynamicBatchKTOTrainer`` (``--trainer dynamic``) from a saved
tiny causal LM, against a reference whose logits are -10 times its own (``hf_dynbsz.testing.kto.sharpened_reference``:
a positive KL estimate at the first step), on unpaired samples with long-tailed completions, once per named set of
config fields of ``--scenarios`` (JSON ``{"name": {"field": value}}``; files suffixed ``.name``), and writes each
rank's record (every metric it logged but the timings, the plugin's figures apart, whether ZeRO-3 partitioned the
parameters or FSDP2 sharded both models) and, from rank 0, the final gathered parameters.
"""

from __future__ import annotations

from hf_dynbsz.testing import fsdp_on_cpu, load_tokenizer, scenarios
from hf_dynbsz.testing.kto import kto_config, sharpened_reference, unpaired_samples

#: Fields only DynamicBatchKTOConfig has (left out of a stock run's config).
OURS_ONLY = ("max_tokens_per_microbatch", "balance_across_ranks")


def train(cli, name: str, fields: dict):
    from trl import KTOTrainer

    from hf_dynbsz import DynamicBatchKTOTrainer

    plugin = cli.trainer == "dynamic"
    fields, own = scenarios.scenario_fields(plugin, fields, OURS_ONLY, samples=32, system=0)
    args = kto_config(f"{cli.out}.{name}.output", plugin=plugin, beta=1.0, **fields)
    dataset = unpaired_samples(
        own["samples"], seed=11, prompt=(3, 30), completion=scenarios.long_tailed_responses, system=own["system"]
    )
    trainer_class = DynamicBatchKTOTrainer if plugin else KTOTrainer
    trainer = trainer_class(
        model=cli.model_dir,
        ref_model=sharpened_reference(cli.model_dir, -10.0),
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(cli.model_dir),
    )
    trainer.train()
    scenarios.write_scenario_results(trainer, f"{cli.out}.{name}", engine_of(trainer))
    return trainer


def engine_of(trainer) -> dict:
    """What the launch's engine did to the trained model and the reference: ZeRO-3 partitioned the model's
    parameters, FSDP2 made both models' parameters DTensors."""
    from torch.distributed.tensor import DTensor

    models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    return {
        "zero3_partitioned": scenarios.zero3_partitioned(trainer.model_wrapped),
        "fsdp_dtensor": all(isinstance(p, DTensor) for model in models for p in model.parameters()),
    }


if __name__ == "__main__":
    fsdp_on_cpu()  # a distributed_type: FSDP launch on CPU processes runs FSDP, as on GPUs (else plain DDP)
    scenarios.run_scenarios(train)
