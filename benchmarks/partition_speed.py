"""Time the token-budget partitioner on 100,000 sequence lengths and print a markdown table.

Run it from the repository root with ``python benchmarks/partition_speed.py`` (options: ``--n``,
``--max-tokens``, ``--repeats``, ``--seed``; no torch needed).  Lengths are drawn lognormal with a median
of ~300 tokens and capped at 4096, like prompt + completion lengths of a GRPO batch, and split under a
budget of 16384 tokens per micro-batch.  Each row is one call of ``partition_by_token_budget`` (packed and
padded layouts, with ``num_microbatches=None`` and with an explicit count as a trainer passes it after
the all-reduce), plus ``min_num_microbatches`` and the first-fit-decreasing baseline for reference.  The
time is the median (and worst) of ``--repeats`` calls on this machine; the target is well under 0.5 s per
call.  "cost max/mean" is the imbalance of the micro-batches under the default workload model (1.0 is
perfectly even).  This is a script, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dynbsz.partition import (  # noqa: E402  (after the path tweak, so the script runs without installing)
    WorkloadModel,
    first_fit_decreasing,
    min_num_microbatches,
    partition_by_token_budget,
    token_lower_bound,
)


def sample_lengths(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median ~300 tokens, long tail) capped at 4096 tokens, at least 16."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(300), 1.0, n), 16, 4096).astype(np.int64)


def time_call(function, repeats: int):
    """(result of the last call, list of wall-clock seconds per call)."""
    seconds = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - start)
    return result, seconds


def cost_imbalance(microbatches, lengths: list[int], layout: str) -> float:
    workload = WorkloadModel.default(layout=layout)
    costs = [workload.cost([lengths[i] for i in mb], layout) for mb in microbatches if mb]
    return max(costs) / (sum(costs) / len(microbatches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="number of sequences (default 100000)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    parser.add_argument("--repeats", type=int, default=5, help="calls per row (median and worst reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = sample_lengths(args.n, args.seed)
    as_list = lengths.tolist()
    budget = args.max_tokens
    print(f"{args.n} lengths (median {int(np.median(lengths))}, max {int(lengths.max())}, "
          f"{int(lengths.sum())} tokens), max_tokens={budget}, lower bound "
          f"{token_lower_bound(lengths, budget)} micro-batches\n")
    print("| call | layout | num_microbatches | micro-batches | median s | worst s | cost max/mean |")
    print("|---|---|---|---|---|---|---|")
    for layout in ("packed", "padded"):
        minimum = min_num_microbatches(lengths, budget, layout=layout)
        _, seconds = time_call(lambda: min_num_microbatches(lengths, budget, layout=layout), args.repeats)
        print(f"| min_num_microbatches | {layout} | - | {minimum} | {statistics.median(seconds):.3f} "
              f"| {max(seconds):.3f} | - |")
        for requested in (None, minimum, minimum + 32):
            result, seconds = time_call(
                lambda: partition_by_token_budget(lengths, budget, num_microbatches=requested, layout=layout),
                args.repeats,
            )
            label = "None" if requested is None else ("minimum" if requested == minimum else "minimum + 32")
            print(f"| partition_by_token_budget | {layout} | {label} | {len(result)} "
                  f"| {statistics.median(seconds):.3f} | {max(seconds):.3f} "
                  f"| {cost_imbalance(result, as_list, layout):.3f} |")
        result, seconds = time_call(lambda: first_fit_decreasing(lengths, budget, layout), args.repeats)
        print(f"| first_fit_decreasing (baseline) | {layout} | - | {len(result)} "
              f"| {statistics.median(seconds):.3f} | {max(seconds):.3f} "
              f"| {cost_imbalance(result, as_list, layout):.3f} |")


if __name__ == "__main__":
    main()
