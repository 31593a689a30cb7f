"""Segment recurrence: padding-free rows and shared prompts through layers that carry state along a sequence.

The counterpart of segment attention (:mod:`hf_dynbsz.execution.attention`) for the sequence mixers of hybrid and
state-space models: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid), Kimi's and Bailing's delta attention, MiniMax's
lightning attention, the Mamba / Mamba-2 mixers (Mamba, Jamba, Bamba, Zamba, Falcon-H1, Nemotron-H), short causal
convolutions (LFM2, Inkling) and RecurrentGemma's recurrent block. Run over a padding-free row as it stands, such a
layer carries its convolution window and recurrent state from one sequence into the next. Here each one runs **per
sequence**, so every sequence starts from a zero state, exactly as it does alone:

* a plain sequence runs alone;
* a shared prompt ``[prefix | block_1 | ... | block_k]`` runs as ``[prefix ; block_j]`` for each block: a block
  starts from the state the prefix ends in, as generation's cache does, and the prefix's own outputs are taken from
  the first of those runs (the layer is causal, so they are the same in every run). The prefix is recomputed in
  these layers only; attention, MLPs and the LM head still see it once;
* runs are batched into few calls of the layer: each run is right-padded to its *bucket* length (16, 24, 32, 48,
  64, 96, ...: less than half as many tokens again), and the runs of a bucket make one call. A mixer is causal, so
  tokens after a run's end (copies of its last token) change none of its outputs, and they are dropped;
* tokens of the row outside every segment (padding to a multiple) get a zero output;
* a mixer's other outputs (attention weights, final states: per run, and read by no layer in training) are None.

Each layer runs **its own forward** (its own kernels: the torch fallbacks transformers ships on CPU, or the
flash-linear-attention / causal-conv1d / mamba-ssm kernels on GPU when installed), only on gathered rows: every
tensor argument laid out along the row (``(1, width, ...)``: hidden states, position ids, position embeddings, a 2-D
mask) is gathered the same way, anything else passes as it is. Which modules are sequence mixers is decided in
:mod:`hf_dynbsz.planning.model_support` (``ModelSupport.sequence_mixers``); the self-check
(:mod:`hf_dynbsz.execution.self_check`) verifies the result on the first step's samples. The segments come from the
layout :func:`~hf_dynbsz.execution.attention.use_segments` named for the pass; a pass without one (padded rows) runs
the layers untouched, so a model without sequence mixers, or a padded pass, sees the identity.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch

from hf_dynbsz.execution.attention import SegmentLayout, active_segments

__all__ = ["RecurrenceCall", "recurrence_calls", "segment_recurrence"]


@dataclass(frozen=True)
class RecurrenceCall:
    """One batched call of a sequence mixer: ``rows`` runs of ``length`` tokens.

    ``gather``: ``(rows, length)`` row positions of each run's tokens; ``keep``: ``(rows, length)`` True where a run's
    output is the row's output at that position (False: a prefix recomputed to start a block from its state).
    """

    gather: torch.Tensor
    keep: torch.Tensor


#: The shortest bucket: runs up to this many tokens share one call.
SHORTEST_BUCKET = 16


def bucket_length(tokens: int) -> int:
    """The length a run of ``tokens`` is padded to: the smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and
    one and a half times them) that holds it."""
    length = SHORTEST_BUCKET
    while length < tokens:
        length = length * 3 // 2 if length & (length - 1) == 0 else length * 4 // 3
    return length


def recurrence_calls(layout: SegmentLayout, device) -> tuple[list[RecurrenceCall], torch.Tensor]:
    """``(calls, positions)``: the batched runs of a sequence mixer over ``layout``'s row, and the row positions of
    their kept outputs (concatenated call after call, ``keep`` order). Built once per pass and device."""
    key = ("recurrence", device)
    cache = layout._cache  # noqa: SLF001 - the layout's per-pass cache, shared with segment attention
    if key not in cache:
        buckets: dict[int, list[tuple[list[int], int]]] = defaultdict(list)  # length -> (positions, kept from)
        for segment in layout.segments:
            prefix = list(range(segment.start, segment.start + segment.prefix))
            offset = segment.start + segment.prefix
            for index, block in enumerate(segment.blocks):
                positions = prefix + list(range(offset, offset + block))
                buckets[bucket_length(len(positions))].append((positions, 0 if index == 0 else segment.prefix))
                offset += block
        calls, kept = [], []
        for length in sorted(buckets):
            runs = buckets[length]
            gather = torch.tensor([positions + positions[-1:] * (length - len(positions)) for positions, _ in runs])
            steps = torch.arange(length).unsqueeze(0)
            keep = (steps >= torch.tensor([[start] for _, start in runs])) & (
                steps < torch.tensor([[len(positions)] for positions, _ in runs])
            )
            calls.append(RecurrenceCall(gather.to(device), keep.to(device)))
            kept.append(gather[keep])
        cache[key] = (calls, torch.cat(kept).to(device) if kept else torch.zeros(0, dtype=torch.long, device=device))
    return cache[key]


def _along_row(value, width: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == width


def _gathered(value, width: int, gather: torch.Tensor):
    """``value`` with its row dimension gathered into ``gather``'s runs, when it is laid out along the row (tuples
    and lists of such tensors too: position embeddings); anything else as it is."""
    if _along_row(value, width):
        return value[0].index_select(0, gather.reshape(-1)).view(*gather.shape, *value.shape[2:])
    if isinstance(value, (tuple, list)) and any(_along_row(item, width) for item in value):
        return type(value)(_gathered(item, width, gather) for item in value)
    return value


def _per_segment(forward, layout: SegmentLayout, args: tuple, kwargs: dict):
    """``forward(*args, **kwargs)`` over a padding-free row, run per sequence (see the module docstring)."""
    hidden = args[0] if args else next(iter(kwargs.values()))
    width = hidden.shape[1]
    calls, positions = recurrence_calls(layout, hidden.device)
    outputs, extras = [], None
    for call in calls:
        out = forward(
            *(_gathered(value, width, call.gather) for value in args),
            **{name: _gathered(value, width, call.gather) for name, value in kwargs.items()},
        )
        if isinstance(out, tuple):  # (hidden states, attention weights or final states): the rest is per run
            out, extras = out[0], (None,) * (len(out) - 1)
        outputs.append(out[call.keep])
    row = out.new_zeros(width, *out.shape[2:]).index_copy(0, positions, torch.cat(outputs))
    row = row.unsqueeze(0)
    return (row, *extras) if extras is not None else row


def _wrap(module):
    forward = module.forward

    def segmented_forward(*args, **kwargs):
        layout = active_segments()
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        if layout is None or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[0] != 1:
            return forward(*args, **kwargs)
        return _per_segment(forward, layout, args, kwargs)

    return segmented_forward


@contextlib.contextmanager
def segment_recurrence(model, mixer_classes: tuple[str, ...]):
    """Run every module of ``model`` whose class is named in ``mixer_classes`` per sequence of the active layout
    inside the context (forward and gradient checkpointing's recomputation). The identity for an empty tuple, and
    for passes without a layout."""
    if not mixer_classes:
        yield
        return
    modules = [module for module in model.modules() if type(module).__name__ in mixer_classes]
    own = [module.__dict__.get("forward") for module in modules]  # a forward set on the instance (hooks) stays
    for module in modules:
        module.forward = _wrap(module)
    try:
        yield
    finally:
        for module, forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
