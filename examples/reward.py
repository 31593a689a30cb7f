"""Reward-model training with token-budget passes: TRL's reward script, on ``DynamicBatchRewardTrainer``.

**No arguments: an offline demo** (nothing is downloaded; well under a minute on 2 CPU cores)::

    python examples/reward.py
    accelerate launch examples/reward.py

``examples/dpo.py``'s preference pairs (after prompts like ``"long:"``, sometimes behind a shared instruction block,
the chosen response spells the alphabet in order and the rejected one is random letters, of long-tailed lengths: 1 to
120 tokens) train a sequence classifier of one label built from ``examples/grpo.py``'s tiny model's config (a
Qwen2-style model with random weights, hidden 128, 2 layers, a character tokenizer). ``accuracy`` (the share of pairs
whose chosen response scores above the rejected one) rises towards 1 and ``margin`` (the mean score difference) grows.
The run prints the batch-size table, one line per optimizer step (``loss``, ``accuracy``, ``margin``,
``dynbsz/microbatches_max_over_ranks`` against stock's fixed count, ``dynbsz/computed_tokens`` against
``dynbsz/stock_computed_tokens``: each pair's prompt once for both its responses, no padding) and a summary; the model
and ``trainer_state.json`` are saved to ``runs/reward-tiny``.

**With Hub models and a dataset**, as TRL's own ``trl/scripts/reward.py``::

    python examples/reward.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --learning_rate 1.0e-5 --output_dir runs/reward-qwen2.5

The model is loaded as TRL loads it (``AutoModelForSequenceClassification`` with one label); the dataset is any of
TRL's preference formats (``prompt`` / ``chosen`` / ``rejected``, plain text or chat messages, or an implicit prompt).
Every ``DynamicBatchRewardConfig`` option is a flag (``--max_tokens_per_microbatch 8192``, ``--dynamic_batching
false`` for stock RewardTrainer, ...), as is every ``RewardConfig`` / ``TrainingArguments`` and ``ModelConfig`` one
(``--use_peft`` with ``--lora_task_type SEQ_CLS``, ...); ``--config my.yaml`` reads them from a YAML file. The demo's
pairs come from ``examples/dpo.py``, the console output, multi-process notes and ``--resume_from_checkpoint`` from
``examples/grpo.py`` (keep the three files together).
"""

from __future__ import annotations

import dpo  # examples/dpo.py, the demo's pairs (a script's folder is first on sys.path)
import grpo  # examples/grpo.py, the shared parts of the scripts

from hf_dynbsz import DynamicBatchRewardConfig

MODEL_DEFAULTS = dict(output_dir="runs/reward")
# The offline demo: 8 pairs per process per optimizer step, which stock runs as 2 micro-batches of 8 padded rows.
TINY_DEFAULTS = dict(grpo.SHORT_DEMO_DEFAULTS, output_dir="runs/reward-tiny", max_steps=40, learning_rate=1e-3)
TINY_DEFAULTS.update(max_length=256)
COMPACT_METRICS = (("loss", ".4f"), ("accuracy", ".2f"), ("margin", ".3f"))


def tiny_classifier(model, seed: int):
    """A sequence classifier of one label from the demo's causal LM's config, its weights drawn from ``seed``."""
    import torch
    from transformers import AutoModelForSequenceClassification

    config = model.config
    config.num_labels = 1
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def main(argv: list[str] | None = None):
    types = (dpo.DPOScriptArguments, DynamicBatchRewardConfig)
    script_args, training_args, model_args, named = grpo.parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from hf_dynbsz import DynamicBatchRewardTrainer

    model, tokenizer, dataset, peft_config = dpo.build(script_args, training_args, model_args, named)
    if not named:  # TRL loads a named model as a classifier of one label itself
        model = tiny_classifier(model, training_args.seed)
    metrics = COMPACT_METRICS + grpo.COMPACT_METRICS[2:-1]
    return grpo.train(DynamicBatchRewardTrainer, script_args, training_args, tokenizer, dataset, peft_config, metrics,
                      model=model)  # fmt: skip


if __name__ == "__main__":
    main()
