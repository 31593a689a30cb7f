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


def build_run(limit: int | None, output_dir: str):
    """The plugin's trainer under ``limit`` MiB (None: no limit): 4 layers of hidden 512, 16 long-tailed scripted
    completions (up to 768 tokens) per step, 3 steps."""
    import numpy as np

    from hf_dynbsz.testing import ModelShape, scripted_run

    longest = 768
    return scripted_run(
        "grpo_dynamic",
        output_dir,
        ModelShape(512, 4, num_heads=8, num_kv_heads=8, vocab_size=4000),
        completion_lengths=lambda rng, n, rank: np.clip(rng.lognormal(np.log(longest / 5), 0.8, n), 8, longest).astype(
            int
        ),
        prompt_length=lambda rng: int(rng.integers(32, 96)),
        max_completion_length=longest,
        max_positions=900,
        prompts=32,
        prompt_prefix="p",
        reward=lambda completions, **kw: [0.1 * (len(c) % 5) for c in completions],
        **dict(per_device_train_batch_size=16, gradient_accumulation_steps=1, num_generations=8, max_steps=3),
        **dict(beta=0.0, gradient_checkpointing=False, max_memory_per_device_mib=limit),
    )


def main(limit: int | None) -> None:
    from hf_dynbsz.testing import ResidentSetSampler, quiet_worker, run_peak_mib

    quiet_worker(threads=1)
    trainer = build_run(limit, sys.argv[2])
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
