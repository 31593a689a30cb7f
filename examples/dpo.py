"""Preference training with token-budget passes: TRL's DPO script, on ``DynamicBatchDPOTrainer``.

**No arguments: an offline demo** (nothing is downloaded; about a minute on 2 CPU cores)::

    python examples/dpo.py
    accelerate launch examples/dpo.py

``examples/grpo.py``'s tiny model (a Qwen2-style model with random weights, hidden 128, 2 layers, a character
tokenizer) learns a preference: after prompts like ``"long:"`` (a task word, sometimes behind a shared instruction
block), the chosen response spells the alphabet in order and the rejected one is random letters, of long-tailed
lengths (1 to 120 tokens). ``rewards/accuracies`` (the share of pairs whose chosen response the policy now prefers
over the reference more than the rejected one) rises towards 1 and ``rewards/margins`` grows. The run prints the
batch-size table, one line per optimizer step (``loss``, ``rewards/accuracies``, ``rewards/margins``,
``dynbsz/microbatches_max_over_ranks`` against stock's fixed count, ``dynbsz/computed_tokens`` against
``dynbsz/stock_computed_tokens``: each pair's prompt once for both its responses, no padding) and a summary; the model
and ``trainer_state.json`` are saved to ``runs/dpo-tiny``.

**With Hub models and a dataset**, as TRL's own ``trl/scripts/dpo.py``::

    python examples/dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --learning_rate 5.0e-7 --output_dir runs/dpo-qwen2.5

The dataset is any of TRL's preference formats (``prompt`` / ``chosen`` / ``rejected``, plain text or chat messages,
or an implicit prompt); the reference model is loaded from the same name (or, with ``--use_peft``, the policy with its
adapter disabled). Every ``DynamicBatchDPOConfig`` option is a flag (``--max_tokens_per_microbatch 8192``,
``--max_tokens_per_microbatch_logprob 16384`` for the reference's passes, ``--loss_type sigmoid sft``,
``--dynamic_batching false`` for stock DPOTrainer, ...), as is every ``DPOConfig`` / ``TrainingArguments`` and
``ModelConfig`` one (``--dtype bfloat16``, ``--use_peft``, ...); ``--config my.yaml`` reads them from a YAML file. The
console output, multi-process notes and ``--resume_from_checkpoint`` are ``examples/grpo.py``'s (this script imports
them from it: keep the two files together).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpo  # examples/grpo.py, the shared parts of the scripts (a script's folder is first on sys.path)

from hf_dynbsz import DynamicBatchDPOConfig

MODEL_DEFAULTS = dict(output_dir="runs/dpo")
# The offline demo: 8 pairs per process per optimizer step, which stock runs as 2 passes of 8 padded rows.
TINY_DEFAULTS = dict(grpo.SHORT_DEMO_DEFAULTS, output_dir="runs/dpo-tiny", max_steps=40, learning_rate=1e-2)
TINY_DEFAULTS.update(beta=0.1, max_length=256)
COMPACT_METRICS = (("loss", ".4f"), ("rewards/accuracies", ".2f"), ("rewards/margins", ".3f"))
#: The shared instruction block some demo prompts open with (the prefix tree computes it once per pass).
INSTRUCTION = "answer in order: "
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class DPOScriptArguments(grpo.DemoScriptArguments):
    """The scripts' arguments (``examples/grpo.py``'s ``DemoScriptArguments``) plus the demo's pairs."""

    num_pairs: int = field(default=512, metadata={"help": "Offline demo: number of synthetic preference pairs."})


def build_tiny_pairs(num_pairs: int, seed: int):
    """The demo's preference pairs: prompt ``"<task>:"`` (half of them behind :data:`INSTRUCTION`), chosen = the
    alphabet in order from a random letter, rejected = random letters; response lengths long-tailed (1-120)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(num_pairs):
        word = rng.choice(list(grpo.TINY_TASKS))
        rows["prompt"].append((INSTRUCTION if rng.random() < 0.5 else "") + f"{word}:")
        length = min(int(rng.expovariate(1 / 25)) + 1, 120)
        start = rng.randrange(len(ALPHABET))
        rows["chosen"].append("".join(ALPHABET[(start + k) % len(ALPHABET)] for k in range(length)))
        other = min(int(rng.expovariate(1 / 25)) + 1, 120)
        rows["rejected"].append("".join(rng.choice(ALPHABET) for _ in range(other)))
    return Dataset.from_dict(rows)


def build(script_args, training_args, model_args, named: bool):
    """``(model, tokenizer, dataset, peft_config)`` of the run: a named model, or the offline demo's."""
    if named:  # (a preference dataset's columns stay as they are: --prompt_column is "prompt")
        return grpo.load_named(script_args, training_args, model_args)
    model, tokenizer = grpo.start_offline_demo(script_args, training_args.seed)
    return model, tokenizer, build_tiny_pairs(script_args.num_pairs, training_args.seed), None


def demo_reference(model, named: bool):
    """The run's ``ref_model``: None for a named model (stock loads the reference by the same name, or with PEFT
    disables the adapter); the demo's model lives in memory, so its reference is a copy of it."""
    if named:
        return None
    import copy

    return copy.deepcopy(model)


def main(argv: list[str] | None = None):
    types = (DPOScriptArguments, DynamicBatchDPOConfig)
    script_args, training_args, model_args, named = grpo.parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from hf_dynbsz import DynamicBatchDPOTrainer

    model, tokenizer, dataset, peft_config = build(script_args, training_args, model_args, named)
    metrics = COMPACT_METRICS + grpo.COMPACT_METRICS[2:-1]
    return grpo.train(DynamicBatchDPOTrainer, script_args, training_args, tokenizer, dataset, peft_config, metrics,
                      model=model, ref_model=demo_reference(model, named))  # fmt: skip


if __name__ == "__main__":
    main()
