"""One training run under a memory limit, in a fresh process (tests/test_memory_budget.py launches it).

A tiny decoder whose activations count (4 layers, hidden 512, vocabulary 4000, no gradient checkpointing) trains on
scripted long-tailed completions up to 768 tokens, 16 per step; the process prints one JSON line: its whole-process peak
(MiB: sampled resident set, logged step peaks and VmHWM) and each step's budget and passes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main(limit: int | None) -> None:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import (
        ResidentSetSampler,
        ScriptedRollout,
        build_char_tokenizer,
        build_tiny_causal_lm,
        run_peak_mib,
    )

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        tokenizer,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1536,
        vocab_size=4000,
        max_position_embeddings=900,
        attn_implementation="sdpa",
        seed=0,
    )
    longest = 768
    rollout = ScriptedRollout(
        lambda rng, n, rank: np.clip(rng.lognormal(np.log(longest / 5), 0.8, n), 8, longest).astype(int),
        lambda rng: int(rng.integers(32, 96)),
        max_completion_length=longest,
        seed=0,
        token_low=3,
        token_high=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
    )
    args = DynamicBatchGRPOConfig(
        output_dir=sys.argv[2],
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=longest,
        max_steps=3,
        beta=0.0,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        gradient_checkpointing=False,
        max_memory_per_device_mib=limit,
    )
    trainer = DynamicBatchGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.1 * (len(c) % 5) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(32)]}),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    with ResidentSetSampler() as sampler:  # the trainer resets VmHWM before each pass: sample the peak as well
        trainer.train()
    peak = run_peak_mib(trainer.state.log_history, sampler)
    steps = [e for e in trainer.state.log_history if "dynbsz/budget_tokens" in e]
    print(
        json.dumps(
            {
                "peak_mib": peak,
                "budgets": [e["dynbsz/budget_tokens"] for e in steps],
                "passes": [e["dynbsz/microbatches"] for e in steps],
                "predicted": [e.get("dynbsz/predicted_peak_memory_mib") for e in steps],
                "passes_measured": [
                    [h[0], h[1], round(h[3]), round(h[4]), round(h[5])] for h in trainer._dynbsz.memory.history
                ],
            }
        )
    )


if __name__ == "__main__":
    main(None if sys.argv[1] == "none" else int(sys.argv[1]))
