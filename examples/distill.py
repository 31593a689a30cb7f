"""On-policy distillation with token-budget passes: TRL's distillation script, on ``DynamicBatchDistillationTrainer``.

**No arguments: an offline demo** (nothing is downloaded; about a minute on 2 CPU cores)::

    python examples/distill.py
    accelerate launch examples/distill.py

``examples/grpo.py``'s tiny student (a Qwen2-style model with random weights, hidden 128, 2 layers, a character
tokenizer) generates its own completions to prompt words (0 to 64 tokens, a long tail), and learns to match a teacher
of the same vocabulary three times its size (hidden 192, 3 layers) whose next-token distribution is sharper: the
loss, the divergence (``beta`` 0.5, the generalized Jensen-Shannon divergence), falls over the run. The run prints the
batch-size table (with the teacher's budget), one line per optimizer step (``loss``, ``entropy``,
``dynbsz/microbatches_max_over_ranks`` against stock's fixed count, ``dynbsz/computed_tokens`` against
``dynbsz/stock_computed_tokens``, ...) and a summary; the student and ``trainer_state.json`` are saved to
``runs/distill-tiny``.

**With Hub models and a dataset**, as TRL's own ``trl/scripts/distillation.py``::

    python examples/distill.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --dataset_name trl-lib/ultrafeedback-prompt \\
        --learning_rate 2.0e-5 --max_completion_length 512 --output_dir runs/distill-qwen2.5

The dataset needs a ``prompt`` column, plain text or chat messages (``--prompt_column`` renames another one). Every
``DynamicBatchDistillationConfig`` option is a flag (``--max_tokens_per_microbatch 8192``,
``--max_tokens_per_microbatch_teacher 16384``, ``--beta 0`` for the forward KL, ``--dynamic_batching false`` for stock
DistillationTrainer, ...), as is every ``DistillationConfig`` / ``TrainingArguments`` and ``ModelConfig`` one
(``--dtype bfloat16``, ``--use_peft``, ...); ``--config my.yaml`` reads them from a YAML file. The console output,
multi-process notes and ``--resume_from_checkpoint`` are ``examples/grpo.py``'s (this script imports them from it:
keep the two files together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpo  # examples/grpo.py, the shared parts of the scripts (a script's folder is first on sys.path)

from hf_dynbsz import DynamicBatchDistillationConfig

MODEL_DEFAULTS = dict(output_dir="runs/distill")
# The offline demo: 8 prompts per process per optimizer step, which stock runs as 2 passes of 4 padded rows.
TINY_DEFAULTS = dict(grpo.SHORT_DEMO_DEFAULTS, output_dir="runs/distill-tiny", max_steps=60, learning_rate=3e-3)
TINY_DEFAULTS.update(max_completion_length=64, beta=0.5)
#: The teacher's scale of its LM head: a sharper next-token distribution than the student's near-uniform one.
TEACHER_HEAD_SCALE = 4.0
COMPACT_METRICS = (("loss", ".5f"), ("entropy", ".3f"))


@dataclass
class DistillationScriptArguments(grpo.DemoScriptArguments):
    """The scripts' arguments (``examples/grpo.py``'s ``DemoScriptArguments``) plus the demo's prompts."""

    num_prompts: int = field(default=1024, metadata={"help": "Offline demo: number of synthetic prompts."})


def build_tiny_teacher(tokenizer, seed: int):
    """The demo's teacher: a Qwen2-style model of the student's vocabulary (hidden 192, 3 layers: about 3x the
    student's parameters), its LM head scaled by :data:`TEACHER_HEAD_SCALE`."""
    import torch

    from hf_dynbsz.testing import ModelShape

    shape = ModelShape(192, 3, num_heads=6, num_kv_heads=2, intermediate_size=384)
    teacher = shape.build(tokenizer, max_positions=256, seed=seed + 1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(TEACHER_HEAD_SCALE)
    return teacher


def load_named(script_args, training_args, model_args):
    """Student name, teacher name, tokenizer, train split and PEFT config of a ``--model_name_or_path`` run, as
    ``trl/scripts/distillation.py`` loads them (both models by name, with the model's dtype and attention)."""
    if training_args.teacher_model_name_or_path is None:
        raise ValueError("--model_name_or_path needs --teacher_model_name_or_path (the teacher).")
    student, tokenizer, dataset, peft_config = grpo.load_named(script_args, training_args, model_args)
    # the trainer loads the teacher with these
    training_args.teacher_model_init_kwargs = grpo.init_kwargs(
        training_args.teacher_model_revision, training_args, model_args, training_args.teacher_model_init_kwargs
    )
    return student, training_args.teacher_model_name_or_path, tokenizer, dataset, peft_config


def build(script_args, training_args, model_args, named: bool):
    """``(student, teacher, tokenizer, dataset, peft_config)`` of the run: named models, or the offline demo's."""
    if named:
        return load_named(script_args, training_args, model_args)
    student, tokenizer = grpo.start_offline_demo(script_args, training_args.seed)
    teacher = build_tiny_teacher(tokenizer, training_args.seed)
    dataset = grpo.build_tiny_dataset(script_args.num_prompts, training_args.seed).remove_columns("target_length")
    return student, teacher, tokenizer, dataset, None


def main(argv: list[str] | None = None):
    types = (DistillationScriptArguments, DynamicBatchDistillationConfig)
    script_args, training_args, model_args, named = grpo.parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from hf_dynbsz import DynamicBatchDistillationTrainer

    student, teacher, tokenizer, dataset, peft_config = build(script_args, training_args, model_args, named)
    metrics = COMPACT_METRICS + grpo.COMPACT_METRICS[1:-1]
    return grpo.train(DynamicBatchDistillationTrainer, script_args, training_args, tokenizer, dataset, peft_config,
                      metrics, model=student, teacher_model=teacher)  # fmt: skip


if __name__ == "__main__":
    main()
