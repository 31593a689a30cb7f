"""Peak memory of the vocabulary-sized work and of generation: stock TRL vs hf_dynbsz's memory knobs.

Run from the repository root (about 15 minutes on 2 CPU cores; ``--quick`` for a smaller run):

    python benchmarks/memory.py

Every configuration runs in a fresh subprocess. Peak memory is the process's resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` right before the measured work, so model construction
does not count) minus the resident set at that moment: it sees torch's CPU allocations, which torch's own
allocator statistics do not track on CPU.

1. Log-prob + backward: one training micro-batch of a Qwen2-style model with a realistic vocabulary
   (151,936) and a small hidden size, through TRL 1.16's fused LM head (log-probs and entropies, backward
   through both), with TRL's own tile (stock) and with ``tensor_batch_size`` tiles.
2. Generation: ``DynamicBatchGRPOTrainer._generate_single_turn`` (TRL's transformers ``generate`` path) for
   one device's share of a generation round, unchunked (stock) and in chunks of
   ``per_device_generation_batch_size`` samples.

Writes ``benchmarks/results/memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VOCAB = 151_936


def _status_mb(field: str) -> float:
    """A ``/proc/self/status`` figure in MiB, read by the package's reader; raises where there is none."""
    from hf_dynbsz.execution.device_memory import status_mib

    value = status_mib(field)
    if value is None:
        raise RuntimeError(field)
    return value


def _reset_peak() -> float:
    """Restart ``VmHWM`` at the current resident set and return that (MiB); raises where it cannot be restarted."""
    from hf_dynbsz.execution.device_memory import reset_peak_rss

    if not reset_peak_rss():
        raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs")
    return _status_mb("VmRSS")


def measure_logprob(tokens_per_tile: int | None, tokens: int, hidden: int) -> dict:
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from hf_dynbsz.execution.tiling import lm_head_tiles
    from hf_dynbsz.testing import build_char_tokenizer, build_tiny_causal_lm

    torch.manual_seed(0)
    model = build_tiny_causal_lm(
        build_char_tokenizer(),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    rows = 4
    input_ids = torch.randint(0, VOCAB, (rows, tokens // rows))
    for param in model.parameters():  # gradients exist before the step, as in training after step 1
        param.grad = torch.zeros_like(param)
    base = _reset_peak()
    start = time.perf_counter()
    with lm_head_tiles(tokens_per_tile):
        out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
        (-(out.log_probs.sum()) - 0.01 * out.entropy.sum()).backward()
    seconds = time.perf_counter() - start
    return {"peak_mb": _status_mb("VmHWM") - base, "seconds": seconds}


def measure_generation(chunk: int | None, samples: int, new_tokens: int) -> dict:
    import torch
    from datasets import Dataset

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        tokenizer, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=VOCAB
    )
    run = dict(output_dir="/tmp/hf-dynbsz-memory-bench", report_to="none", use_cpu=True)
    batch = dict(per_device_train_batch_size=samples, num_generations=samples, max_completion_length=new_tokens)
    args = DynamicBatchGRPOConfig(
        **run,
        **batch,
        per_device_generation_batch_size=chunk,
        generation_kwargs={"min_new_tokens": new_tokens},  # every sample is max length: comparable peaks
    )
    trainer = DynamicBatchGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc"]}),
        processing_class=tokenizer,
    )
    prompts = [tokenizer("hello world " * 4).input_ids] * samples
    torch.manual_seed(0)
    base = _reset_peak()
    start = time.perf_counter()
    completions, _ = trainer._generate_single_turn(prompts, None, {}, samples)
    seconds = time.perf_counter() - start
    assert all(len(c) == new_tokens for c in completions), [len(c) for c in completions]
    return {"peak_mb": _status_mb("VmHWM") - base, "seconds": seconds}


def _child(kind: str, value, options: dict) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps({"kind": kind, "value": value, **options})]
    # Large blocks straight from mmap and returned at free: the resident set then follows torch's live
    # allocations instead of what glibc's heap happens to retain from model construction.
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TOKENIZERS_PARALLELISM": "false",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_TRIM_THRESHOLD_": "0",
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind}={value} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, for a smoke run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        spec = json.loads(cli.child)
        if spec["kind"] == "logprob":
            result = measure_logprob(spec["value"], spec["tokens"], spec["hidden"])
        else:
            result = measure_generation(spec["value"], spec["samples"], spec["new_tokens"])
        print(json.dumps(result))
        return

    logprob_options = {"tokens": 1024 if cli.quick else 4096, "hidden": 64}
    generation_options = {"samples": 16 if cli.quick else 32, "new_tokens": 32 if cli.quick else 64}
    lines = [
        "# Peak memory: stock TRL vs hf_dynbsz memory knobs",
        "",
        f"Command: `python benchmarks/memory.py{' --quick' if cli.quick else ''}` (2 CPU cores, fp32). "
        "Peak = resident-set high-water mark during the measured work minus the resident set before it, "
        "one fresh subprocess per row.",
        "",
    ]

    lines += [
        f"## Log-prob + backward, {logprob_options['tokens']} tokens, vocabulary {VOCAB:,}, hidden "
        f"{logprob_options['hidden']}, 2 layers",
        "",
        "| setting | tile (tokens x vocab columns) | peak MB | vs stock | seconds |",
        "|---|---|---:|---:|---:|",
    ]
    stock = _child("logprob", None, logprob_options)
    lines.append(f"| stock TRL | 4096 x 32768 | {stock['peak_mb']:.0f} | 1.00 | {stock['seconds']:.1f} |")
    for tile in (8192, 2048, 1024, 512):
        result = _child("logprob", tile, logprob_options)
        lines.append(
            f"| tensor_batch_size={tile} | {tile} x 8192 | {result['peak_mb']:.0f} | "
            f"{result['peak_mb'] / stock['peak_mb']:.3f} | {result['seconds']:.1f} |"
        )
        print(lines[-1], flush=True)

    samples = generation_options["samples"]
    lines += [
        "",
        f"## Generation, {samples} samples per device x {generation_options['new_tokens']} new tokens, "
        f"vocabulary {VOCAB:,}, hidden 256, 4 layers",
        "",
        "| setting | generate calls | peak MB | vs stock | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    stock = _child("generation", None, generation_options)
    lines.append(f"| stock (whole share at once) | 1 | {stock['peak_mb']:.0f} | 1.00 | {stock['seconds']:.1f} |")
    for chunk in (16, 8, 4):
        if chunk >= samples:
            continue
        result = _child("generation", chunk, generation_options)
        lines.append(
            f"| per_device_generation_batch_size={chunk} | {-(-samples // chunk)} | {result['peak_mb']:.0f} | "
            f"{result['peak_mb'] / stock['peak_mb']:.3f} | {result['seconds']:.1f} |"
        )
        print(lines[-1], flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "memory_quick.md" if cli.quick else "memory.md"
    (RESULTS / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {RESULTS / name}")


if __name__ == "__main__":
    main()
