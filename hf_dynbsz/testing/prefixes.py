"""Samples with prefix structure beyond prompt groups: a block every prompt begins with (tool schemas, few-shot
exemplars), and tree-search rollouts whose completions share a trunk and branches. For the prefix-tree tests and
benchmarks; torch and numpy are imported inside the functions.

* :class:`PrefixRollout`: a scripted ``rollout_func`` (:class:`~hf_dynbsz.testing.fixtures.ScriptedRollout`) whose
  prompts begin with a ``shared`` block of tokens and whose completions of one prompt share a ``trunk`` of tokens,
  then one of ``branches`` blocks of ``branch`` tokens, then a leaf of their own;
* :func:`prefix_batch`: TRL-style padded tensors of such samples, for a pass without a trainer;
* :data:`PREFIX_STRUCTURES` and :func:`comparison_prefix_rollout`: the trainer comparisons' structures and their
  rollout (every trainer's tests train the same samples).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from hf_dynbsz.testing.fixtures import ScriptedRollout, unique_tokens

__all__ = ["PREFIX_STRUCTURES", "PrefixRollout", "comparison_prefix_rollout", "prefix_batch", "tree_completion"]


def tree_completion(rng_of, occurrence: int, trunk: int, branches: int, branch: int, leaf: list[int]) -> list[int]:
    """One completion of a tree rollout: the prompt's ``trunk`` tokens, the tokens of its branch ``occurrence`` modulo
    ``branches`` (``branch`` tokens each; none without branches), then ``leaf``. ``rng_of(name)``: the prompt's own
    generator for ``name`` ("trunk", or the branch's number), so that every completion of a prompt draws the same."""
    tokens = list(rng_of("trunk")(trunk)) if trunk else []
    if branches and branch:
        tokens += list(rng_of(occurrence % branches)(branch))
    return tokens + list(leaf)


class PrefixRollout(ScriptedRollout):
    """A scripted ``rollout_func`` with prefix structure: every prompt's ids begin with the same ``shared`` tokens
    (then the prompt's own ``prompt_length(rng)`` tokens); with ``trunk`` (and ``branches`` x ``branch``) the
    completions of a prompt in a round share a trunk of ``trunk`` tokens, then one of ``branches`` branches of
    ``branch`` tokens (the ``k``-th completion of the prompt in the call takes branch ``k mod branches``), then their
    own leaf of ``completion_lengths`` tokens (capped so that the completion fits ``max_completion_length``; a
    completion under the cap ends with ``eos_id``). Otherwise as :class:`ScriptedRollout`."""

    def __init__(
        self,
        completion_lengths: Callable,
        prompt_length: Callable,
        *,
        shared: int = 0,
        trunk: int = 0,
        branches: int = 0,
        branch: int = 0,
        **kwargs,
    ):
        super().__init__(completion_lengths, prompt_length, **kwargs)
        self.shared, self.trunk, self.branches, self.branch = shared, trunk, branches, branch

    def prompt_ids(self, prompt: str) -> list[int]:
        import numpy as np

        if prompt not in self._prompt_cache:
            block = np.random.default_rng([self.seed, 7]).integers(self.token_low, self.token_high, self.shared)
            own = super().prompt_ids(prompt)
            self._prompt_cache[prompt] = block.tolist() + own
        return self._prompt_cache[prompt]

    def __call__(self, prompts, trainer):
        import numpy as np

        out = super().__call__(prompts, trainer)
        stem = self.trunk + (self.branch if self.branches else 0)
        if not stem:
            return out
        seen: dict[str, int] = {}
        completions = []
        for prompt, leaf in zip(prompts, out["completion_ids"]):
            occurrence = seen.get(prompt, 0)
            seen[prompt] = occurrence + 1

            def rng_of(name, prompt=prompt):
                key = [self.seed, len(self.rounds), zlib.crc32(f"{prompt}/{name}".encode())]
                return lambda n: np.random.default_rng(key).integers(self.token_low, self.token_high, n).tolist()

            ids = tree_completion(rng_of, occurrence, self.trunk, self.branches, self.branch, leaf)
            completions.append(ids[: self.max_len])
        out["completion_ids"] = completions
        lengths = [len(ids) for ids in completions]
        record = self.rounds[-1]
        record["real_tokens"] = int(sum(len(self.prompt_ids(p)) for p in prompts) + sum(lengths))
        record["fingerprint"][1] = sorted(lengths)
        record["lengths"] = [(len(self.prompt_ids(p)), c) for p, c in zip(prompts, lengths)]
        record["unique_tokens"] = unique_tokens([self.prompt_ids(p) + c for p, c in zip(prompts, completions)])
        return out


#: The trainer comparisons' prefix structures (:class:`PrefixRollout`'s keywords): a block every prompt begins with (a
#: tool schema, which prompt groups do not share), and tree-search rollouts (each prompt's completions in a round share
#: a trunk, then one of two branches, then a leaf of their own).
PREFIX_STRUCTURES = {"shared block": dict(shared=20), "tree rollout": dict(trunk=5, branches=2, branch=4)}


def comparison_prefix_rollout(*structures: str) -> PrefixRollout:
    """The trainer comparisons' :class:`PrefixRollout` with every structure of ``structures`` (names of
    :data:`PREFIX_STRUCTURES`) at once: prompts of 3-9 tokens of their own, leaves of 1-11 tokens, completions capped at
    the comparison runs' 24 tokens, seed 4."""
    structure = {key: value for name in structures for key, value in PREFIX_STRUCTURES[name].items()}
    return PrefixRollout(
        lambda rng, n, rank: rng.integers(1, 12, n),
        lambda rng: rng.integers(3, 10),
        max_completion_length=24,
        seed=4,
        **structure,
    )


def prefix_batch(
    prompt_lengths,
    leaf_lengths,
    repeats,
    *,
    shared: int = 0,
    trunk: int = 0,
    branches: int = 0,
    branch: int = 0,
    seed: int = 0,
    token_high: int = 40,
    pad_id: int = 0,
):
    """TRL-style tensors ``(prompt_ids, prompt_mask, completion_ids, completion_mask)`` of a generation batch with
    prefix structure: prompt ``k`` is the ``shared`` block (the same for every prompt) then ``prompt_lengths[k]`` own
    tokens, repeated ``repeats[k]`` times; the completions of a prompt are :func:`tree_completion`'s (``trunk``,
    ``branches`` x ``branch``, then a leaf of each of ``leaf_lengths``). Token ids in ``[3, token_high)``."""
    import torch
    from trl.trainer.utils import pad

    generator = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(3, token_high, (int(n),), generator=generator).tolist()

    block = draw(shared)
    prompts, completions, leaves = [], [], iter(leaf_lengths)
    for length, count in zip(prompt_lengths, repeats):
        prompt, named = block + draw(length), {}

        def rng_of(name, named=named):
            def drawn(n):
                if name not in named:
                    named[name] = draw(n)
                return named[name]

            return drawn

        for occurrence in range(count):
            prompts.append(torch.tensor(prompt))
            leaf = draw(next(leaves))
            completions.append(torch.tensor(tree_completion(rng_of, occurrence, trunk, branches, branch, leaf)))
    return (
        pad(prompts, padding_value=pad_id, padding_side="left"),
        pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        pad(completions, padding_value=pad_id, padding_side="right"),
        pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
    )
