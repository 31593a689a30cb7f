"""RLOO with token-budget micro-batches: ``examples/grpo.py``'s script, on ``DynamicBatchRLOOTrainer``.

**No arguments: an offline demo** (nothing is downloaded; 1-2 minutes on 2 CPU cores)::

    python examples/rloo.py
    accelerate launch examples/rloo.py

The same tiny task as ``examples/grpo.py`` (a tiny Qwen2-style model with random weights learns to answer a prompt
word with a completion of the length the word names: 4 to 60 characters), trained by RLOO: each completion's
advantage is its reward minus the mean reward of the other completions of its prompt, with RLOO's default KL
penalty in the reward (``beta`` 0.05: the reference model is the initial tiny model, saved to
``<output_dir>/initial-model`` so that TRL can load it). The run prints the batch-size table, one line per optimizer
step (``reward``, ``dynbsz/microbatches_max_over_ranks`` against stock's fixed count, ``dynbsz/computed_tokens``
against ``dynbsz/stock_computed_tokens``, ...) and a summary; the model and ``trainer_state.json`` are saved to
``runs/rloo-tiny``.

**With a model and a dataset**, as TRL's own ``trl/scripts/rloo.py``::

    python examples/rloo.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs think_format_reward --max_completion_length 1024 --output_dir runs/rloo-qwen3

Every ``DynamicBatchRLOOConfig`` option is a flag (``--max_tokens_per_microbatch 8192``, ``--dynamic_batching false``
for stock RLOOTrainer, ...), as is every ``RLOOConfig`` / ``TrainingArguments`` and ``ModelConfig`` one; the script
arguments, rewards, console output and multi-process notes are ``examples/grpo.py``'s (this script imports them from
it: keep the two files together).
"""

from __future__ import annotations

import os

import grpo  # examples/grpo.py, the shared parts of the scripts (a script's folder is first on sys.path)

from hf_dynbsz import DynamicBatchRLOOConfig

MODEL_DEFAULTS = dict(output_dir="runs/rloo")
# The offline demo: examples/grpo.py's settings (RLOO's own defaults otherwise, beta 0.05 included).
TINY_DEFAULTS = dict(grpo.TINY_DEFAULTS, output_dir="runs/rloo-tiny")


def tiny_reference(model, tokenizer, output_dir: str, is_main_process: bool) -> None:
    """Save the initial tiny model where TRL loads the reference model from (``beta`` > 0: TRL builds it from the
    policy's ``name_or_path``), by the main process; every process then points its model there."""
    from accelerate import PartialState

    path = os.path.join(output_dir, "initial-model")
    with PartialState().main_process_first():
        if is_main_process:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
    model.config._name_or_path = path


def main(argv: list[str] | None = None):
    types = (grpo.GRPOScriptArguments, DynamicBatchRLOOConfig)
    script_args, training_args, model_args, named = grpo.parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from hf_dynbsz import DynamicBatchRLOOTrainer

    if named:
        model, tokenizer, dataset, peft_config = grpo.load_named(script_args, training_args, model_args)
        reward_names = script_args.reward_funcs
    else:
        model, tokenizer = grpo.start_offline_demo(script_args, training_args.seed)
        if training_args.beta != 0.0:
            tiny_reference(model, tokenizer, training_args.output_dir, training_args.process_index == 0)
        dataset = grpo.build_tiny_dataset(script_args.num_prompts, training_args.seed)
        peft_config, reward_names = None, ["length_reward"]

    rewards = grpo.script_reward_funcs(reward_names, script_args, training_args, tokenizer)
    return grpo.train(DynamicBatchRLOOTrainer, script_args, training_args, tokenizer, dataset, peft_config,
                      model=model, reward_funcs=rewards)  # fmt: skip


if __name__ == "__main__":
    main()
