"""Asynchronous GRPO with stock's optimizer step in the plugin's passes: ``DynamicBatchAsyncGRPOTrainer``.

**No arguments: an offline demo** (nothing is downloaded, no vLLM server; under a minute on 2 CPU cores)::

    python examples/async_grpo.py
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/async_grpo.py

A tiny Qwen2-style model (random weights) trains on scripted rollouts of the long-tailed length mix (prompts of
32-96 tokens, completions up to ``--max_completion_length``, groups of ``--num_generations``), produced by the
stand-in rollout worker of ``hf_dynbsz.testing`` (TRL's ``RolloutWorkerProtocol``) at ``--generation_seconds`` per
sample on a thread of its own, while the trainer trains; the weight syncs go to a no-op weight transfer (TRL's
``WeightTransferProtocol``). Each optimizer step is stock's at this config; the demo sets stock's fixed-count mode
(``--token_budget 0``: ``per_device_train_batch_size x gradient_accumulation_steps x processes`` samples of the queue,
each micro-batch normalised by its own tokens; stock's default asks a vLLM server for ``max_model_len``) and trains
them in passes of at most ``--max_tokens_per_microbatch`` tokens per device (unset: the plugin's automatic budget).
``--async_step samples`` trains the plugin's own step instead. The run prints the batch-size table, one line per
optimizer step and a summary.

**With a vLLM server**, as TRL's own asynchronous GRPO::

    trl vllm-serve --model Qwen/Qwen3-0.6B            # on its own GPU(s); or vllm serve with TRL's weight sync
    accelerate launch examples/async_grpo.py --vllm_server_base_url http://localhost:8000 \\
        --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --max_completion_length 1024 --output_dir runs/async-grpo-qwen3

Then stock's rollout worker generates on the server and stock's weight transfer streams the weights to it; the plugin
trains. Every ``DynamicBatchAsyncGRPOConfig`` option is a flag (``--token_budget 8192`` for stock's step's samples,
``--max_tokens_per_microbatch 4096`` for the passes, ``--dynamic_batching false`` for stock ``AsyncGRPOTrainer``,
``--max_memory_per_device_mib 70000`` for the budget from memory, ...).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from trl import TrlParser

from hf_dynbsz import DynamicBatchAsyncGRPOConfig

#: The offline demo's run: 16 samples per optimizer step (stock's fixed count), groups of 4, 8 steps, a visible learning
#: rate.
TINY_DEFAULTS = dict(
    output_dir="runs/async-grpo-tiny",
    per_device_train_batch_size=16,
    token_budget=0,  # stock's fixed-count step (stock's default budget asks the vLLM server for max_model_len)
    num_generations=4,
    max_completion_length=256,
    max_steps=8,
    learning_rate=1e-4,
    report_to="none",
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    bf16=False,
    gradient_checkpointing=False,
)
#: Shown per step: the step's loss metrics (stock's), the samples and passes, and the step's wall time.
STEP_METRICS = ("loss", "ratio", "kl", "entropy", "batch/samples_per_step", "dynbsz/microbatches", "perf/step_s")


@dataclass
class AsyncScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A model id or path (with a server)."})
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset of prompts (with a server)."})
    dataset_split: str = field(default="train", metadata={"help": "Its split."})
    reward_funcs: list[str] | None = field(default=None, metadata={"help": "TRL reward functions (with a server)."})
    generation_seconds: float = field(
        default=0.005, metadata={"help": "The offline demo: the stand-in worker's seconds per sample."}
    )


def platform_defaults() -> dict:
    """``use_cpu`` where there is no accelerator (accelerate's own device otherwise)."""
    import torch

    return {} if torch.accelerator.is_available() else {"use_cpu": True}


def offline_run(script_args, training_args):
    """The trainer of the offline demo: a tiny model saved under the output directory, the stand-in worker over a
    scripted long-tailed mix, the no-op weight transfer."""
    import torch
    from accelerate import PartialState

    from hf_dynbsz import DynamicBatchAsyncGRPOTrainer
    from hf_dynbsz.testing import (
        PROMPT_RANGE,
        TEST_ALPHABET,
        ModelShape,
        NoWeightTransfer,
        RolloutScript,
        StandInRolloutWorker,
        build_char_tokenizer,
        prompt_dataset,
    )

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny matrices: one thread per process is faster
    model_dir = os.path.join(training_args.output_dir, "initial-model")
    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    with PartialState().main_process_first():
        if PartialState().is_main_process:
            length = PROMPT_RANGE[1] + training_args.max_completion_length
            ModelShape(64, 2).build(tokenizer, max_positions=length, seed=training_args.seed).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
    script = RolloutScript(
        mix="long_tailed",
        max_completion_length=training_args.max_completion_length,
        prompt_lengths=PROMPT_RANGE,
        num_generations=training_args.num_generations,
        seed=training_args.seed,
    )
    per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    worker = StandInRolloutWorker(
        script.samples(),
        samples_per_sync=per_step * PartialState().num_processes,
        generation_seconds=script_args.generation_seconds,
        queue_maxsize=2 * per_step * PartialState().num_processes,
    )
    return DynamicBatchAsyncGRPOTrainer(
        model=model_dir,
        args=training_args,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=NoWeightTransfer(),
    )


def server_run(script_args, training_args):
    """The trainer of a run against a vLLM server: stock's rollout worker and weight transfer."""
    from datasets import load_dataset
    from trl.rewards import accuracy_reward, reasoning_accuracy_reward, think_format_reward

    from hf_dynbsz import DynamicBatchAsyncGRPOTrainer

    if not (script_args.model_name_or_path and script_args.dataset_name):
        raise ValueError("--vllm_server_base_url needs --model_name_or_path and --dataset_name.")
    rewards = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
    }
    return DynamicBatchAsyncGRPOTrainer(
        model=script_args.model_name_or_path,
        reward_funcs=[rewards[name] for name in script_args.reward_funcs or ["accuracy_reward"]],
        args=training_args,
        train_dataset=load_dataset(script_args.dataset_name, split=script_args.dataset_split),
    )


def print_steps(trainer) -> None:
    """One console line per optimizer step (main process), instead of transformers' printed log dictionaries."""
    from transformers import PrinterCallback, TrainerCallback

    class StepLine(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                shown = [f"{name}={logs[name]:.4g}" for name in STEP_METRICS if logs.get(name) is not None]
                print(f"step {state.global_step:>3} | " + " | ".join(shown), flush=True)

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepLine())


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    server = any(arg.startswith("--vllm_server_base_url") for arg in argv)
    parser = TrlParser((AsyncScriptArguments, DynamicBatchAsyncGRPOConfig))
    parser.set_defaults(**({} if server else {**TINY_DEFAULTS, **platform_defaults()}))
    script_args, training_args = parser.parse_args_and_config(args=argv)
    trainer = server_run(script_args, training_args) if server else offline_run(script_args, training_args)
    print_steps(trainer)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    last = steps[-1] if steps else {}
    trainer.accelerator.print(
        f"{len(steps)} optimizer steps of {last.get('batch/samples_per_step')} samples in {seconds:.1f} s; the last "
        f"step's passes: {last.get('dynbsz/microbatches')} (budget {last.get('dynbsz/budget_tokens')} tokens). "
        f"Output: {training_args.output_dir}"
    )
    return trainer


if __name__ == "__main__":
    main()
