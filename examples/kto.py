"""Unpaired preference training (KTO) with token-budget passes: TRL's KTO script, on ``DynamicBatchKTOTrainer``.

**No arguments: an offline demo** (nothing is downloaded; well under a minute on 2 CPU cores)::

    python examples/kto.py
    accelerate launch examples/kto.py

``examples/dpo.py``'s pairs as unpaired samples (TRL's ``unpair_preference_dataset``): after prompts like ``"long:"``
(a task word, sometimes behind a shared instruction block), a completion that spells the alphabet in order is
desirable and one of random letters undesirable, of long-tailed lengths (1 to 120 tokens); the tiny model
(``examples/grpo.py``'s: a Qwen2-style model with random weights, hidden 128, 2 layers, a character tokenizer) is the
policy, its reference a copy. ``rewards/chosen`` (the policy's log-ratio to the reference on desirable completions,
times ``beta``) rises and ``rewards/rejected`` falls; ``kl`` is each micro-batch's KL estimate from its KL sequences
(each prompt with another sample's completion), computed as stock computes it. The run prints the batch-size table,
one line per optimizer step (``loss``, ``kl``, the rewards, ``dynbsz/microbatches_max_over_ranks`` against stock's
fixed count, ``dynbsz/computed_tokens`` against ``dynbsz/stock_computed_tokens``: the training passes' unique tokens,
no padding) and a summary; the model and ``trainer_state.json`` are saved to ``runs/kto-tiny``.

**With Hub models and a dataset**, as TRL's own ``trl/scripts/kto.py``::

    python examples/kto.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/kto-mix-14k --learning_rate 5.0e-7 --output_dir runs/kto-qwen2.5

The dataset is any of TRL's unpaired preference formats (``prompt`` / ``completion`` / ``label``, plain text or chat
messages; a paired one stock unpairs itself); the reference model is loaded from the same name (or, with
``--use_peft``, the policy with its adapter disabled). Every ``DynamicBatchKTOConfig`` option is a flag
(``--max_tokens_per_microbatch 8192``, ``--max_tokens_per_microbatch_logprob 16384`` for the no-grad passes of the KL
sequences and the reference, ``--loss_type apo_zero_unpaired``, ``--dynamic_batching false`` for stock KTOTrainer,
...), as is every ``KTOConfig`` / ``TrainingArguments`` and ``ModelConfig`` one; ``--config my.yaml`` reads them from a
YAML file. The demo's pairs and reference come from ``examples/dpo.py``, the console output, multi-process notes and
``--resume_from_checkpoint`` from ``examples/grpo.py`` (keep the three files together).
"""

from __future__ import annotations

import dpo  # examples/dpo.py, the demo's pairs and reference (a script's folder is first on sys.path)
import grpo  # examples/grpo.py, the shared parts of the scripts

from hf_dynbsz import DynamicBatchKTOConfig

MODEL_DEFAULTS = dict(output_dir="runs/kto")
# The offline demo: examples/dpo.py's settings (8 samples per process per optimizer step, which stock runs as 2
# micro-batches of 4 padded rows and 4 padded KL rows; a constant rate; beta 0.1; max_length 256), 60 steps at 1e-3
# (at dpo's 1e-2 the policy runs away from its reference: the KL estimate reaches 100 and the loss rises).
TINY_DEFAULTS = dict(dpo.TINY_DEFAULTS, output_dir="runs/kto-tiny", max_steps=60, learning_rate=1e-3)
COMPACT_METRICS = (("loss", ".4f"), ("kl", ".3f"), ("rewards/chosen", ".3f"), ("rewards/rejected", ".3f"))


def main(argv: list[str] | None = None):
    types = (dpo.DPOScriptArguments, DynamicBatchKTOConfig)
    script_args, training_args, model_args, named = grpo.parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from trl import unpair_preference_dataset

    from hf_dynbsz import DynamicBatchKTOTrainer

    model, tokenizer, dataset, peft_config = dpo.build(script_args, training_args, model_args, named)
    if not named:  # each demo pair as two samples, its chosen completion desirable and its rejected one not, mixed
        dataset = unpair_preference_dataset(dataset).shuffle(seed=training_args.seed)
    metrics = COMPACT_METRICS + grpo.COMPACT_METRICS[2:-1]
    return grpo.train(DynamicBatchKTOTrainer, script_args, training_args, tokenizer, dataset, peft_config, metrics,
                      model=model, ref_model=dpo.demo_reference(model, named))  # fmt: skip


if __name__ == "__main__":
    main()
