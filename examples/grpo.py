"""GRPO with token-budget micro-batches: TRL's GRPO example script, on ``DynamicBatchGRPOTrainer``.

**No arguments: an offline demo** (nothing is downloaded; about a minute and a half on an idle CPU core)::

    python examples/grpo.py

A tiny Qwen2-style model with random weights and a character tokenizer (``hf_dynbsz.testing``) learns to answer a
prompt word with a completion of the length the word names, then ``<eos>``: ``tiny:`` 4 characters, ``short:`` 10,
``medium:`` 20, ``long:`` 36, ``huge:`` 60 (``length_reward`` below). Completion lengths range from 0 to 64 tokens
in every optimizer step, the situation dynamic batching is for. The run prints the batch-size table, one line per
optimizer step (the metrics under the names they are logged as: ``reward``, ``dynbsz/microbatches_max_over_ranks``
against stock TRL's fixed count, ``dynbsz/computed_tokens`` against ``dynbsz/stock_computed_tokens``,
``dynbsz/padding_fraction``, ``dynbsz/tokens_per_second``, ``dynbsz/peak_memory_mib``, ...) and a summary; the
model, tokenizer and ``trainer_state.json`` are saved to ``runs/grpo-tiny`` (``hf-dynbsz report runs/grpo-tiny``
plots them).

**With a model and a dataset** it trains any Hub or local causal LM on any prompt dataset, as TRL's own
``trl/scripts/grpo.py`` does (the trainer loads the model from its name)::

    python examples/grpo.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs think_format_reward --max_completion_length 1024 --output_dir runs/grpo-qwen3

The dataset needs a ``prompt`` column, plain text or chat messages (``--prompt_column`` renames another one).
``--reward_funcs`` takes TRL's reward names (``think_format_reward``, which needs chat-message prompts,
``accuracy_reward``, ``reasoning_accuracy_reward``, ``get_soft_overlong_punishment``), this script's
``length_reward`` (the default), or dotted import paths (``my_lib.rewards.my_reward``). ``length_reward`` scores
a completion ``T / (T + 4 |L - T|)``: 1.0 when it ends with EOS after exactly ``T`` tokens, 0.5 when 25% off,
0.0 when cut off at ``max_completion_length``; ``T`` is the dataset's ``target_length`` column when it has one,
else ``--target_length`` (default: half of ``max_completion_length``).

Every ``DynamicBatchGRPOConfig`` option is a flag (``--max_tokens_per_microbatch 8192``, ``--packing_layout
padded``, ``--dynamic_batching false`` for stock TRL, ...), as is every ``GRPOConfig`` / ``TrainingArguments`` and
``ModelConfig`` one (``--dtype bfloat16``, ``--attn_implementation flash_attention_2``, ``--use_peft``, ...);
``--config my.yaml`` reads them from a YAML file. Multi-process: ``accelerate launch --config_file
accelerate_configs/<config>.yaml examples/grpo.py ...``. ``--resume_from_checkpoint runs/grpo-tiny/checkpoint-50``
(or ``true`` for the latest checkpoint in ``--output_dir``) resumes a run.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

from hf_dynbsz import DynamicBatchGRPOConfig

# ---------------------------------------------------------------------------------------------------------------------
# Defaults. Precedence: command line > --config YAML > these > GRPOConfig's own defaults.

# Every run: log every optimizer step, to the console only.
COMMON_DEFAULTS = dict(report_to="none", logging_steps=1)
# Runs on a named model keep TRL's GRPOConfig defaults (learning_rate 1e-6, bf16, gradient checkpointing, ...).
MODEL_DEFAULTS = dict(output_dir="runs/grpo")
# The offline demo, tuned on 2 CPU cores: over seeds 0-5 the mean reward of the last 10 steps is 0.39 to 0.52 above
# that of the first 10 (~0.28); about 70 s of training.
# TRL turns gradient checkpointing on by default; the tiny models do not need it. (transformers 5.x renamed the
# field to activation_checkpointing and warns about the old name.)
_FIELDS = DynamicBatchGRPOConfig.__dataclass_fields__
_CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in _FIELDS else "gradient_checkpointing"
# Every offline demo (this script's and those that import it): fp32 (the tiny models are fast enough, and CPUs gain
# nothing from bf16 autocast here), seed 0, no gradient checkpointing.
DEMO_DEFAULTS = {"bf16": False, "seed": 0, _CHECKPOINTING: False}
TINY_DEFAULTS = dict(
    DEMO_DEFAULTS,
    output_dir="runs/grpo-tiny",
    max_steps=200,
    learning_rate=7e-4,
    lr_scheduler_type="linear",  # decaying to 0 keeps the end of the run stable (a constant rate can collapse)
    # 8 prompts x 8 completions = 64 samples per optimizer step (per process), which stock TRL runs as
    # gradient_accumulation_steps = 4 passes of 16 samples, each padded to the longest prompt + completion.
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,
    num_generations=8,
    max_completion_length=64,
    save_strategy="steps",
    save_steps=50,
    save_total_limit=2,
)
# The shorter demos of examples/distill.py and examples/dpo.py: 8 samples per process per optimizer step, which stock
# runs as 2 passes of 4; a constant learning rate; no checkpoints.
SHORT_DEMO_DEFAULTS = dict(DEMO_DEFAULTS, per_device_train_batch_size=4, gradient_accumulation_steps=2)
SHORT_DEMO_DEFAULTS.update(lr_scheduler_type="constant", save_strategy="no")

TINY_TASKS = {"tiny": 4, "short": 10, "medium": 20, "long": 36, "huge": 60}  # prompt word -> target length
TINY_ALPHABET = "abcdefghijklmnopqrstuvwxyz :"
LENGTH_REWARD_SHARPNESS = 4.0  # reward 0.5 when the length is off by 1/4 of the target


@dataclass
class DemoScriptArguments(ScriptArguments):
    """TRL's script arguments (``--dataset_name``, ``--dataset_config``, ``--dataset_train_split``, ...) plus those of
    every script here."""

    prompt_column: str = field(
        default="prompt", metadata={"help": "Dataset column holding the prompts (renamed to 'prompt')."}
    )
    log_style: str = field(
        default="compact",
        metadata={
            "help": "compact: one line per logging step with the algorithm's main metrics and the dynbsz/ ones; full: "
            "the Trainer's dictionary of every metric.",
            "choices": ["compact", "full"],
        },
    )


@dataclass
class GRPOScriptArguments(DemoScriptArguments):
    """The scripts' arguments (:class:`DemoScriptArguments`) plus the rewards and the demo's prompts."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions (with --model_name_or_path): length_reward (default), think_format_reward, "
            "accuracy_reward, reasoning_accuracy_reward, get_soft_overlong_punishment, or dotted import paths "
            "such as my_lib.rewards.my_reward. The offline demo always uses length_reward."
        },
    )
    target_length: int | None = field(
        default=None,
        metadata={
            "help": "Target completion length (tokens) of length_reward; a 'target_length' column of the dataset "
            "overrides it per prompt. Default: half of max_completion_length."
        },
    )
    num_prompts: int = field(default=2048, metadata={"help": "Offline demo: number of synthetic prompts."})


# ---------------------------------------------------------------------------------------------------------------------
# Rewards


class LengthReward:
    """``T / (T + 4 |L - T|)`` for a completion of ``L`` tokens that ends with EOS (EOS not counted), ``T`` the target:
    1.0 on target, 0.5 when 25% off; 0.0 for a completion cut off at ``max_completion_length``.

    ``T`` comes from the dataset's ``target_length`` column when it has one (TRL passes extra columns to reward
    functions as keyword arguments), else from ``default_target``. The demo's tokenizer has one token per character.
    """

    __name__ = "length_reward"  # TRL names the metric after it: rewards/length_reward/mean

    def __init__(self, default_target: int, eos_token_ids):
        self.default_target = default_target
        self.eos_token_ids = set(eos_token_ids)

    def __call__(self, completions, completion_ids, target_length=None, **kwargs):
        targets = target_length if target_length is not None else [self.default_target] * len(completion_ids)
        rewards = []
        for ids, target in zip(completion_ids, targets, strict=True):
            ids = list(ids)
            if not ids or ids[-1] not in self.eos_token_ids:
                rewards.append(0.0)  # cut off: never ended
                continue
            length = len(ids) - 1
            rewards.append(target / (target + LENGTH_REWARD_SHARPNESS * abs(length - target)))
        return rewards


TRL_REWARDS = ("think_format_reward", "accuracy_reward", "reasoning_accuracy_reward")


def build_reward_funcs(names: list[str] | None, default_target: int, eos_token_ids) -> list:
    """TRL's reward registry plus ``length_reward``; dotted paths are imported (as in trl/scripts/grpo.py)."""
    rewards = []
    for name in names or ["length_reward"]:
        if name == "length_reward":
            rewards.append(LengthReward(default_target, eos_token_ids))
        elif name in TRL_REWARDS:
            rewards.append(getattr(importlib.import_module("trl.rewards"), name))
        elif name == "get_soft_overlong_punishment":
            from trl.rewards import get_soft_overlong_punishment

            rewards.append(get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256))
        elif "." in name:
            module_path, attribute = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            rewards.append(getattr(importlib.import_module(module_path), attribute))
        else:
            raise ValueError(
                f"Unknown reward function {name!r}: use length_reward, {', '.join(TRL_REWARDS)}, "
                "get_soft_overlong_punishment or a dotted import path (module.function)."
            )
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# The offline demo: tiny model, character tokenizer, synthetic prompts


def build_tiny_model_and_tokenizer(seed: int):
    """A 2-layer Qwen2-style model (hidden size 128, ~0.4M parameters) with random weights, and a 31-token
    character tokenizer.

    The LM head starts near zero, so the first completions are near-uniform random characters that stop at
    ``<eos>`` after a geometric number of tokens: lengths 0 to 64, mean ~25.
    """
    import torch
    from tokenizers import decoders

    from hf_dynbsz.testing import ModelShape, build_char_tokenizer

    tokenizer = build_char_tokenizer(TINY_ALPHABET)
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decode to "abc", not "a b c"
    shape = ModelShape(128, 2, num_heads=4, num_kv_heads=2, intermediate_size=256)
    model = shape.build(tokenizer, max_positions=256, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.01)
    model.config._name_or_path = "hf-dynbsz-tiny"
    return model, tokenizer


def build_tiny_dataset(num_prompts: int, seed: int):
    """Prompts like ``"medium:"``; the ``target_length`` column reaches the reward function as a keyword argument."""
    from datasets import Dataset

    rng = random.Random(seed)
    words = [rng.choice(list(TINY_TASKS)) for _ in range(num_prompts)]
    return Dataset.from_dict(
        {"prompt": [f"{word}:" for word in words], "target_length": [TINY_TASKS[word] for word in words]}
    )


# ---------------------------------------------------------------------------------------------------------------------
# Console output: one line per logging step, a summary at the end


def _fmt(value, spec=".3f"):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


#: The metrics of the compact console line, by the names they are logged under (W&B, TensorBoard, trainer_state.json).
COMPACT_METRICS = (
    ("reward", ".3f"),
    ("completions/mean_length", ".1f"),
    ("dynbsz/microbatches_max_over_ranks", ".0f"),
    ("dynbsz/padding_fraction", ".2f"),
    ("dynbsz/computed_tokens", ".0f"),
    ("dynbsz/stock_computed_tokens", ".0f"),
    ("dynbsz/tokens_per_second", ".0f"),
    ("dynbsz/peak_memory_mib", ".0f"),
    ("dynbsz/mfu", ".3f"),
    ("loss", ".4f"),
)


def compact_line(logs: dict, step: int, stock_passes: int, metrics=COMPACT_METRICS) -> str:
    """``step 12 | reward=0.412 | completions/mean_length=23.5 | dynbsz/microbatches_max_over_ranks=3 (stock 4) |
    ...``: each metric under the name it is logged as, so what the console shows is what a tracker holds. Records
    without these keys (the final train_runtime one) are printed as they are."""
    parts = [f"step {step:>4}"]
    for name, spec in metrics:
        if name in logs:
            stock = f" (stock {stock_passes})" if name == "dynbsz/microbatches_max_over_ranks" else ""
            parts.append(f"{name}={_fmt(logs[name], spec)}{stock}")
    if len(parts) == 1:
        parts += [f"{key} {_fmt(value, '.4g') if isinstance(value, float) else value}" for key, value in logs.items()]
    return " | ".join(parts)


def use_compact_logs(trainer, stock_passes: int, metrics=COMPACT_METRICS) -> None:
    """Keep the progress bar, replace the Trainer's per-step dictionary dump with :func:`compact_line` (of
    ``metrics``)."""
    from tqdm.auto import tqdm
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    class ProgressBarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    class CompactLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                tqdm.write(compact_line(logs, state.global_step, stock_passes, metrics))

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(ProgressBarOnly)
    trainer.pop_callback(PrinterCallback)
    trainer.add_callback(CompactLog)


def summarize(log_history: list[dict], stock_passes: int, num_processes: int, seconds: float) -> str:
    """Reward over the first vs last 10 steps, micro-batches run vs stock's count, tokens computed vs stock's.

    Reads ``trainer.state.log_history`` (which includes the records of a resumed run's earlier part); a record
    averages the metrics over the ``logging_steps`` optimizer steps it covers, so sums weight it by that count.
    """
    records, previous = [], 0
    for entry in log_history:
        if "reward" in entry or "dynbsz/computed_tokens" in entry:
            records.append((entry, max(entry["step"] - previous, 1)))
            previous = entry["step"]
    lines = [f"Summary: {previous} optimizer steps on {num_processes} process(es); this run took {seconds:.0f} s"]
    for name, spec in (("reward", ".3f"), ("loss", ".3e")):  # a distillation has no reward: its loss, the divergence
        values = [entry[name] for entry, _ in records if entry.get(name) is not None]
        if values:
            k = max(1, min(10, len(values) // 2))
            first, last = sum(values[:k]) / k, sum(values[-k:]) / k
            lines.append(
                f"  {name:<16} first {k} logged steps {first:{spec}} -> last {k} {last:{spec}} ({last - first:+{spec}})"
            )
            break
    # Passes per process: every process runs the same number (the most any process needs; the others add empty
    # lock-step passes, counted in dynbsz/dummy_passes).
    runs = [
        (
            entry.get("dynbsz/microbatches_max_over_ranks", entry["dynbsz/microbatches"]),
            entry.get("dynbsz/dummy_passes", 0.0),
            n,
        )
        for entry, n in records
        if "dynbsz/microbatches" in entry
    ]
    if runs:
        ran = sum(value * n for value, _, n in runs)
        dummies = sum(value * n for _, value, n in runs)
        stock = stock_passes * sum(n for _, _, n in runs)
        empty = f" ({dummies:,.0f} of them empty lock-step passes on the main process)" if dummies else ""
        lines.append(
            f"  micro-batches    {ran:,.0f} run per process vs {stock:,} with stock's fixed "
            f"{stock_passes} per optimizer step{empty}"
        )
    tokens = [
        (entry["dynbsz/computed_tokens"], entry["dynbsz/stock_computed_tokens"], n)
        for entry, n in records
        if "dynbsz/computed_tokens" in entry
    ]
    if tokens:
        computed = sum(c * n for c, _, n in tokens)
        stock = sum(s * n for _, s, n in tokens)
        change = f" ({100 * (computed / stock - 1):+.1f}%)" if stock else ""
        lines.append(
            f"  tokens computed  {computed:,.0f} vs {stock:,.0f} with stock batching{change} "
            "(training passes, all processes)"
        )
    if not runs and not tokens:
        lines.append("  no dynbsz/ metrics: dynamic batching was off (stock TRL micro-batches)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def platform_defaults(environ=os.environ) -> dict:
    """Defaults for machines without a GPU (or other accelerator), where the launcher alone is not enough.

    * DDP (``accelerate_configs/cpu_ddp.yaml``): the TrainingArguments need ``use_cpu=True``. Without it each
      process trains alone (world size 1), or with ``ddp_backend="gloo"`` TRL's gather does not gather and the
      second process fails in ``shuffle_sequence_dict``.
    * DeepSpeed (``accelerate_configs/cpu_zero*.yaml``): ``ddp_backend="gloo"`` and not ``use_cpu``
      (``DynamicBatchGRPOConfig`` sets the backend too; stated here for scripts built on a plain GRPOConfig).
    """
    import torch

    if torch.accelerator.is_available():
        return {}
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return {"ddp_backend": "gloo"}
    return {"use_cpu": True}


def parse_arguments(argv: list[str] | None, types: tuple, model_defaults: dict, tiny_defaults: dict) -> tuple:
    """``(script_args, training_args, model_args, named)`` of a script's command line (``sys.argv`` by default):
    ``types`` its script-arguments and config dataclasses, with defaults ``model_defaults`` for a run on a named
    model, ``tiny_defaults`` for the offline demo; hf_dynbsz's messages shown from the main process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    named = uses_named_model(argv)
    parser = TrlParser((*types, ModelConfig))
    parser.set_defaults(**COMMON_DEFAULTS, **platform_defaults(), **(model_defaults if named else tiny_defaults))
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    setup_logging(training_args.process_index == 0)
    return script_args, training_args, model_args, named


def start_offline_demo(script_args, seed: int):
    """The tiny model and tokenizer of an offline demo (:func:`build_tiny_model_and_tokenizer`), after refusing a
    ``--dataset_name`` without a model; one torch thread per process unless ``OMP_NUM_THREADS`` says otherwise."""
    if script_args.dataset_name:
        raise ValueError("--dataset_name needs --model_name_or_path (with neither, the offline demo runs).")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # The tiny model's matrices are far too small to share among threads: one thread per process is
        # faster, and much faster on a busy machine (threads spin-waiting for each other).
        torch.set_num_threads(1)
    return build_tiny_model_and_tokenizer(seed)


def uses_named_model(argv: list[str]) -> bool:
    """Whether ``--model_name_or_path`` is given, on the command line or in the ``--config`` YAML."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model_name_or_path")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.model_name_or_path:
        return True
    if known.config:
        import yaml

        with open(known.config) as f:
            return bool((yaml.safe_load(f) or {}).get("model_name_or_path"))
    return False


def setup_logging(is_main_process: bool) -> None:
    """Show hf_dynbsz's messages (layout, batch-size table, warnings) from the main process, errors from the others."""
    logger = logging.getLogger("hf_dynbsz")
    logger.setLevel(logging.INFO if is_main_process else logging.ERROR)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))  # its messages start with "hf_dynbsz"
        logger.addHandler(handler)
    logger.propagate = False


def resume_value(value):
    """``--resume_from_checkpoint true`` (or ``latest``) means the latest checkpoint in ``output_dir``."""
    if isinstance(value, str) and value.lower() in ("true", "latest", "last"):
        return True
    return value


def init_kwargs(revision, training_args, model_args, given: dict | None) -> dict:
    """The keyword arguments a trainer loads a model by name with (as TRL's scripts): ``revision``, the run's
    ``--trust_remote_code``, ``--attn_implementation`` and ``--dtype``, then the config's own ``given`` ones over
    them."""
    fields = dict(revision=revision, trust_remote_code=training_args.trust_remote_code)
    fields.update(attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    return {**fields, **(given or {})}


def load_named(script_args, training_args, model_args):
    """Model name, tokenizer, train split and PEFT config of a ``--model_name_or_path`` run (as trl/scripts/grpo.py)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    if not script_args.dataset_name:
        raise ValueError("--model_name_or_path needs --dataset_name (a Hub dataset or a local path).")
    # the trainer loads the model from its name with these
    training_args.model_init_kwargs = init_kwargs(
        model_args.model_revision, training_args, model_args, training_args.model_init_kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        padding_side="left",
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
    )[script_args.dataset_train_split]
    if script_args.prompt_column != "prompt":
        dataset = dataset.rename_column(script_args.prompt_column, "prompt")
    peft_config = None
    if model_args.use_peft:
        from trl import get_peft_config

        peft_config = get_peft_config(model_args)
    return model_args.model_name_or_path, tokenizer, dataset, peft_config


def main(argv: list[str] | None = None):
    types = (GRPOScriptArguments, DynamicBatchGRPOConfig)
    script_args, training_args, model_args, named = parse_arguments(argv, types, MODEL_DEFAULTS, TINY_DEFAULTS)

    from hf_dynbsz import DynamicBatchGRPOTrainer

    if named:
        model, tokenizer, dataset, peft_config = load_named(script_args, training_args, model_args)
        reward_names = script_args.reward_funcs
    else:
        model, tokenizer = start_offline_demo(script_args, training_args.seed)
        dataset = build_tiny_dataset(script_args.num_prompts, training_args.seed)
        peft_config = None
        reward_names = ["length_reward"]

    rewards = script_reward_funcs(reward_names, script_args, training_args, tokenizer)
    return train(DynamicBatchGRPOTrainer, script_args, training_args, tokenizer, dataset, peft_config, model=model,
                 reward_funcs=rewards)  # fmt: skip


def script_reward_funcs(names: list[str] | None, script_args, training_args, tokenizer) -> list:
    """The rewards ``names`` (:func:`build_reward_funcs`) of a script's run: ``length_reward`` aims at
    ``--target_length`` (default: half of ``max_completion_length``), completions ending at the tokenizer's eos."""
    eos_ids = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id]
    target = script_args.target_length or max(1, training_args.max_completion_length // 2)
    return build_reward_funcs(names, target, eos_ids)


def train(
    trainer_class, script_args, training_args, tokenizer, dataset, peft_config, metrics=COMPACT_METRICS, **models
):
    """The scripts' trainer: ``trainer_class`` of ``models`` (its model arguments: the model and its rewards, teacher
    or reference) on ``dataset`` with ``tokenizer`` and ``peft_config``, run by :func:`train_and_finish`."""
    trainer = trainer_class(
        **models, args=training_args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    return train_and_finish(trainer, script_args, training_args, metrics)


def train_and_finish(trainer, script_args, training_args, metrics=COMPACT_METRICS):
    """The scripts' run: the console lines (``--log_style compact``: ``metrics`` per step), training (resumed where
    ``--resume_from_checkpoint`` says), then :func:`finish`; returns ``trainer``."""
    # Stock TRL runs one forward/backward of per_device_train_batch_size samples per accumulation step.
    stock_passes = training_args.gradient_accumulation_steps
    if script_args.log_style == "compact":
        use_compact_logs(trainer, stock_passes, metrics)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_value(training_args.resume_from_checkpoint))
    finish(trainer, training_args.output_dir, stock_passes, time.perf_counter() - start)
    return trainer


def finish(trainer, output_dir: str, stock_passes: int, seconds: float) -> None:
    """After training: the model, tokenizer and ``trainer_state.json`` saved to ``output_dir``, the run's summary
    printed (``stock_passes``: stock's passes per step; ``seconds``: the training time), every process waited for."""
    trainer.save_model(output_dir)
    trainer.save_state()  # trainer_state.json (every logged metric, per step): what `hf-dynbsz report` reads
    accelerator = trainer.accelerator
    accelerator.print(f"Model, tokenizer and trainer_state.json saved to {output_dir}")
    accelerator.print(summarize(trainer.state.log_history, stock_passes, accelerator.num_processes, seconds))
    if accelerator.num_processes > 1:
        print(
            f"[process {accelerator.process_index} of {accelerator.num_processes}] finished at optimizer step "
            f"{trainer.state.global_step}",
            flush=True,
        )
    accelerator.wait_for_everyone()
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers, destroy the process group
        trainer.end()


if __name__ == "__main__":
    main()
