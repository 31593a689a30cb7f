"""The named length mixes of the benchmarks (and of the runs the tests build from them), parameterised by the maximum
completion length ``M`` so that a scaled-down run keeps the shape of the distribution:

* ``long_tailed``: completion lengths lognormal with median ``M / 7`` and sigma 1.0, clipped to ``[8, M]`` (about
  2.6% hit ``M``, i.e. are truncated), like reasoning traces: most are short, a few run to the limit. Prompts uniform
  in ``[32, 96]`` tokens.
* ``bimodal``: half short answers (normal, mean ``M / 16``, sd ``M / 64``), half long traces (uniform in
  ``[0.6 M, M]``). Prompts uniform in ``[32, 96]`` tokens.
* ``uniform``: every completion ``M / 2`` tokens and every prompt 64 tokens: nothing to save by repacking; measures
  the plug-in's overhead.
* ``prompt_heavy``: long prompts and short answers (system prompts, retrieved documents, few-shot examples with a
  final answer): prompts uniform in ``[400, 600]`` tokens, completions lognormal with median 40 and sigma 0.6,
  clipped to ``[4, M]``. GRPO's ``num_generations`` completions of a prompt share it.

A *sequence* length is prompt + completion tokens (the unit of the token budget). numpy is imported inside the
functions (importing :mod:`hf_dynbsz.testing` stays cheap).
"""

from __future__ import annotations

import math

MIXES = ("long_tailed", "bimodal", "uniform", "prompt_heavy")
MIX_LABELS = {
    "long_tailed": "long-tailed (lognormal)",
    "bimodal": "bimodal",
    "uniform": "uniform (all equal)",
    "prompt_heavy": "prompt-heavy (long prompts, short answers)",
}
PROMPT_RANGE = (32, 96)
PROMPT_HEAVY_RANGE = (400, 600)
UNIFORM_PROMPT = 64


def longest_prompt(mix: str) -> int:
    """The longest prompt ``mix`` draws, in tokens."""
    return PROMPT_HEAVY_RANGE[1] if mix == "prompt_heavy" else PROMPT_RANGE[1]


def completion_lengths(mix: str, n: int, max_completion_length: int, rng):
    """``n`` completion lengths (tokens, eos included) of ``mix``, each in ``[1, max_completion_length]``
    (an int64 array; ``rng``: a ``numpy.random.Generator``)."""
    import numpy as np

    m = int(max_completion_length)
    if mix == "long_tailed":
        values = rng.lognormal(math.log(m / 7), 1.0, n)
        values = np.clip(values, 8, m)
    elif mix == "bimodal":
        short = np.clip(rng.normal(m / 16, m / 64, n), 4, m)
        long = rng.uniform(0.6 * m, m, n)
        values = np.where(rng.random(n) < 0.5, short, long)
    elif mix == "uniform":
        values = np.full(n, m // 2)
    elif mix == "prompt_heavy":
        values = np.clip(rng.lognormal(math.log(40), 0.6, n), 4, m)
    else:
        raise ValueError(f"unknown mix {mix!r}; choose from {MIXES}")
    return np.clip(np.rint(values), 1, m).astype(np.int64)


def prompt_lengths(mix: str, n: int, rng):
    """``n`` prompt lengths (tokens) of ``mix`` (fixed for ``uniform``)."""
    import numpy as np

    if mix == "uniform":
        return np.full(n, UNIFORM_PROMPT, dtype=np.int64)
    low, high = PROMPT_HEAVY_RANGE if mix == "prompt_heavy" else PROMPT_RANGE
    return rng.integers(low, high + 1, n).astype(np.int64)


def sequence_lengths(mix: str, n: int, max_completion_length: int, seed: int):
    """Prompt + completion lengths (tokens) of ``n`` independent samples of ``mix``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return prompt_lengths(mix, n, rng) + completion_lengths(mix, n, max_completion_length, rng)
