"""Shared builders for trainer tests: a tiny offline model saved to disk, prompts, a reward, run helpers.

The tiny model's LM head is shrunk so its next-token distribution is close to uniform over a 7-token
vocabulary: completions then end at <eos> after a geometric number of tokens, so lengths vary widely
(the situation dynamic batching is for) and some hit ``max_completion_length`` (truncated).
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset

from hf_dynbsz.tiny import build_char_tokenizer, build_tiny_causal_lm

ALPHABET = "abcd"


def save_tiny_model(directory: str, *, attn_implementation: str = "sdpa", seed: int = 0) -> str:
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_causal_lm(tokenizer, attn_implementation=attn_implementation, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tokenizer(directory: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def prompt_dataset(num_prompts: int = 16, seed: int = 0) -> Dataset:
    """Prompts of varied length (3 to 18 characters) so prompt padding varies too."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):
        length = int(torch.randint(3, 19, (1,), generator=generator))
        chars = torch.randint(0, len(ALPHABET), (length,), generator=generator).tolist()
        prompts.append("".join(ALPHABET[c] for c in chars))
    return Dataset.from_dict({"prompt": prompts})


class RecordingReward:
    """Reward = fraction of 'a' in the completion minus a small length term; records every completion."""

    __name__ = "recording_reward"

    def __init__(self):
        self.completions: list[str] = []

    def __call__(self, prompts, completions, **kwargs):
        self.completions.extend(completions)
        return [c.count("a") / max(len(c), 1) - 0.01 * len(c) for c in completions]


def base_config_kwargs(output_dir: str, **overrides) -> dict:
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=24,
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=1e9,
        seed=0,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


def run_training(trainer_cls, config_cls, model_dir: str, output_dir: str, dataset=None, **overrides):
    """Train from ``model_dir`` and return (initial params, final params, completions, log history)."""
    from transformers import AutoModelForCausalLM

    args = config_cls(**base_config_kwargs(output_dir, **overrides))
    reward = RecordingReward()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset if dataset is not None else prompt_dataset(),
        processing_class=load_tokenizer(model_dir),
    )
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


def relative_difference(a: dict, b: dict) -> float:
    num = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    den = torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))
    return float(num / den)


def update_difference(initial: dict, ours: dict, stock: dict) -> float:
    """Relative difference of the parameter UPDATES (far more sensitive than comparing parameters)."""
    num = torch.sqrt(sum(((ours[k] - stock[k]).double() ** 2).sum() for k in ours))
    den = torch.sqrt(sum(((stock[k] - initial[k]).double() ** 2).sum() for k in stock))
    return float(num / den)


def run_with_timeout(command: list[str], cwd, timeout: float, what: str) -> str:
    """Run ``command`` in its own process group with the repo importable and offline; return stdout + stderr.

    Fails the test on a non-zero exit, and on timeout kills the whole group (every rank) and fails.
    """
    import signal
    import subprocess

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    env = {key: value for key, value in env.items() if not key.startswith("DIFFU_")}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} did not finish in {timeout} s (hang?):\n{output[-4000:]}")
    assert process.returncode == 0, f"{what} failed ({process.returncode}):\n{output[-6000:]}"
    return output


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
