"""Worker for tests/test_sequence_parallel.py: `accelerate launch --num_processes 2 ... sequence_parallel_logprobs.py`.

Builds DynamicBatchGRPOTrainer with sequence_parallel_size=2 on a saved tiny model and checks, on every rank:

* the no-grad log-probs and entropies of TRL's hook (each process's own padded samples, pooled, packed with shared
  prompts, sharded over the group) equal stock GRPOTrainer's own method on the same samples, token by token (a token
  lost at a shard boundary, or a shard's values in the wrong place, differs);
* one sharded training pass: the gradients of a weighted sum of its log-probs, summed over the group, equal the
  unsharded pass's (a shard counted twice doubles them; one lost halves its part).

Writes ``<out>.rank<k>.json`` with the largest differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_dynbsz.execution.sequence_parallel import NoSequenceParallel
from hf_dynbsz.testing import RecordingReward, base_config_kwargs, build_trainer, load_tokenizer, prompt_dataset


def padded(rows: list[tuple[list[int], list[int]]], pad: int):
    """Left-padded prompts and right-padded completions, as TRL's generation output."""
    prompt_width = max(len(p) for p, _ in rows)
    completion_width = max(len(c) for _, c in rows)
    prompt_ids = torch.full((len(rows), prompt_width), pad)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(rows), completion_width), pad)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (prompt, completion) in enumerate(rows):
        prompt_ids[i, prompt_width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, prompt_width - len(prompt) :] = 1
        completion_ids[i, : len(completion)] = torch.tensor(completion)
        completion_mask[i, : len(completion)] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def sharded_trainer(model_dir: str, out: str):
    """DynamicBatchGRPOTrainer on the saved model with sequence_parallel_size 2 (accelerate's ParallelismConfig), a
    budget of 24 tokens per device."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import AutoModelForCausalLM

    from hf_dynbsz import DynamicBatchGRPOConfig

    parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=2)
    args = DynamicBatchGRPOConfig(
        **base_config_kwargs(out + "-run", max_tokens_per_microbatch=24, parallelism_config=parallelism)
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return build_trainer(args, model, load_tokenizer(model_dir), dataset=prompt_dataset(), reward=RecordingReward())


def logprob_differences(trainer, tokens) -> tuple[float, float]:
    """The largest differences of the no-grad log-probs and entropies of TRL's hook against stock's own method, on
    this rank's samples (one prompt with 3 completions, plus plain sequences of odd lengths)."""
    from trl import GRPOTrainer

    shared = tokens(9)
    rows = [(shared, tokens(n)) for n in (5, 14, 3)] + [(tokens(p), tokens(c)) for p, c in ((4, 21), (7, 1), (3, 9))]
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded(rows, trainer.processing_class.pad_token_id)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    width, model = completion_ids.size(1), trainer.model
    with torch.no_grad():
        ours, our_entropy = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, width, compute_entropy=True
        )[:2]
        stock, stock_entropy = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, width, compute_entropy=True
        )[:2]
    mask = completion_mask.bool()
    return (ours - stock)[mask].abs().max().item(), (our_entropy - stock_entropy)[mask].abs().max().item()


def gradient_difference(trainer, tokens):
    """One training pass over the same samples on both ranks (drawn by ``tokens``), sharded vs not: the largest
    relative difference of the group's summed gradients against the unsharded pass's, and the pass's row width."""
    from hf_dynbsz.execution.packing import SequenceTable

    model = trainer.model
    shared = tokens(9)
    rows = [(shared, tokens(n)) for n in (5, 14, 3)] + [(tokens(p), tokens(c)) for p, c in ((4, 21), (7, 1))]
    table = SequenceTable.from_padded(*padded(rows, trainer.processing_class.pad_token_id))
    mb = trainer._dynbsz.microbatch(table, list(range(len(rows))))
    weights = torch.linspace(0.5, 2.0, mb.completion_mask.numel()).view(mb.completion_mask.shape)

    def gradients(sharded: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        parallel = trainer._dynbsz.parallel if sharded else NoSequenceParallel()
        with trainer._dynbsz.segments(model, parallel=parallel):
            logps = trainer._dynbsz.forward(model, mb, False, autocast=False, parallel=parallel)[0]
            (logps * weights).sum().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    sharded = gradients(True)
    for grad in sharded:
        dist.all_reduce(grad)
    whole = gradients(False)
    difference = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(sharded, whole))
    return difference, int(mb.shift_labels.size(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    trainer = sharded_trainer(cli.model_dir, cli.out)
    rank = trainer.accelerator.process_index
    generator = torch.Generator().manual_seed(rank)

    def tokens(n):
        return torch.randint(3, 7, (n,), generator=generator).tolist()

    logprob, entropy = logprob_differences(trainer, tokens)
    generator.manual_seed(0)  # the training pass: rank 0's samples on both ranks
    gradient, row_width = gradient_difference(trainer, tokens)
    record = {"rank": rank, "logprob": logprob, "entropy": entropy, "gradient": gradient, "row_width": row_width}
    with open(f"{cli.out}.rank{rank}.json", "w") as f:
        json.dump(record, f)
    print(record, flush=True)
    trainer.end()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
