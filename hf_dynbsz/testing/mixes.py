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

Mixes with prefix structure beyond prompt groups (:data:`PREFIX_MIXES`, laid out by
:class:`~hf_dynbsz.testing.prefixes.PrefixRollout`), completions long-tailed as above:

* ``agentic``: a 600-token tool block every prompt begins with, then a question of 20-120 tokens;
* ``few_shot``: a 400-token block of exemplars every prompt begins with, then a question of 20-60 tokens;
* ``tree``: tree-search rollouts: prompts of 32-96 tokens, each prompt's completions share a 64-token trunk, then
  one of 2 branches of 48 tokens, then a long-tailed leaf (the whole completion at most ``M``).

A *sequence* length is prompt + completion tokens (the unit of the token budget). numpy is imported inside the
functions (importing :mod:`hf_dynbsz.testing` stays cheap).
"""

from __future__ import annotations

import math

__all__ = [
    "MIXES",
    "MIX_LABELS",
    "PREFIX_MIXES",
    "PROMPT_HEAVY_RANGE",
    "PROMPT_RANGE",
    "UNIFORM_PROMPT",
    "completion_lengths",
    "longest_prompt",
    "prompt_lengths",
    "sequence_lengths",
]

MIXES = ("long_tailed", "bimodal", "uniform", "prompt_heavy")
#: Prefix structure of the mixes that have more than prompt groups: the block every prompt begins with (``shared``
#: tokens), each prompt's own tokens (``prompts``: a range), and the completions' ``trunk``, ``branches`` x ``branch``.
PREFIX_MIXES = {
    "agentic": dict(shared=600, prompts=(20, 120), trunk=0, branches=0, branch=0),
    "few_shot": dict(shared=400, prompts=(20, 60), trunk=0, branches=0, branch=0),
    "tree": dict(shared=0, prompts=(32, 96), trunk=64, branches=2, branch=48),
}
MIX_LABELS = {
    "long_tailed": "long-tailed (lognormal)",
    "bimodal": "bimodal",
    "uniform": "uniform (all equal)",
    "prompt_heavy": "prompt-heavy (long prompts, short answers)",
    "agentic": "agentic (600-token tool block in every prompt)",
    "few_shot": "few-shot (400-token exemplar block in every prompt)",
    "tree": "tree rollouts (64-token trunk, 2 branches of 48, leaves)",
}
PROMPT_RANGE = (32, 96)
PROMPT_HEAVY_RANGE = (400, 600)
UNIFORM_PROMPT = 64


def longest_prompt(mix: str) -> int:
    """The longest prompt ``mix`` draws, in tokens (a shared block included)."""
    if mix in PREFIX_MIXES:
        return PREFIX_MIXES[mix]["shared"] + PREFIX_MIXES[mix]["prompts"][1]
    return PROMPT_HEAVY_RANGE[1] if mix == "prompt_heavy" else PROMPT_RANGE[1]


def leaf_limit(mix: str, max_completion_length: int) -> int:
    """The longest leaf of a completion of ``mix``: ``max_completion_length`` less its trunk and branch."""
    structure = PREFIX_MIXES.get(mix, {})
    stem = structure.get("trunk", 0) + (structure.get("branch", 0) if structure.get("branches") else 0)
    return max(int(max_completion_length) - stem, 1)


def completion_lengths(mix: str, n: int, max_completion_length: int, rng):
    """``n`` completion lengths (tokens, eos included) of ``mix``, each in ``[1, max_completion_length]``
    (an int64 array; ``rng``: a ``numpy.random.Generator``)."""
    import numpy as np

    m = int(max_completion_length)
    if mix in PREFIX_MIXES:  # the leaves, long-tailed under what the trunk and branch leave
        return completion_lengths("long_tailed", n, leaf_limit(mix, m), rng)
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
    """``n`` prompt lengths (tokens) of ``mix`` (fixed for ``uniform``; a prefix mix's own tokens, without its
    shared block)."""
    import numpy as np

    if mix == "uniform":
        return np.full(n, UNIFORM_PROMPT, dtype=np.int64)
    if mix in PREFIX_MIXES:  # each prompt's own tokens (the shared block comes on top)
        low, high = PREFIX_MIXES[mix]["prompts"]
        return rng.integers(low, high + 1, n).astype(np.int64)
    low, high = PROMPT_HEAVY_RANGE if mix == "prompt_heavy" else PROMPT_RANGE
    return rng.integers(low, high + 1, n).astype(np.int64)


def sequence_lengths(mix: str, n: int, max_completion_length: int, seed: int):
    """Prompt + completion lengths (tokens) of ``n`` independent samples of ``mix``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return prompt_lengths(mix, n, rng) + completion_lengths(mix, n, max_completion_length, rng)
