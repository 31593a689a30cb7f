"""Segment attention: padding-free rows and prefix trees through the model's own attention kernel (torch layer).

A padding-free row holds its samples as the nodes of their prefix tree, each node attending to its root-to-node path
and causally to itself (a plain sequence is a root alone; a prompt shared by its completions, ``[prefix | block_1 |
... | block_k]``, a root with a child per completion): :mod:`~hf_dynbsz.execution.attention.layout` holds the row's
tree (planning's :class:`~hf_dynbsz.planning.prefix_tree.PrefixTree`, the one model of it) and the index tensors the
kernels read. :func:`segment_attention_forward` is registered in transformers'
``AttentionInterface`` as :data:`ATTENTION_NAME`; :func:`segment_attention` switches a model to it, and
:func:`use_segments` names the :class:`SegmentLayout` of the pass about to run. ``masking_utils`` builds no mask for
an implementation it does not know, so this function owns masking. It is stateless and computes each span with **the
base implementation's own function**, so everything that function does (soft-capping, attention sinks, value heads
of another size than query heads, sliding windows, GQA, dtype handling) is the model's own. One module per kernel:

* sdpa / eager: spans of equal shape batched into one call of the model's own function
  (:mod:`~hf_dynbsz.execution.attention.spans`);
* flex_attention: one call per layer under a block mask drawn from the nodes
  (:mod:`~hf_dynbsz.execution.attention.flex`);
* varlen_attn (models on sdpa or eager, on CUDA, where :mod:`hf_dynbsz.planning.model_support` finds nothing against
  it): one call per layer of torch's own FlashAttention-2 varlen kernel, each node's path's keys and values
  gathered in front of it (:mod:`~hf_dynbsz.execution.attention.varlen`);
* flash-attention: one varlen call through transformers' own flash-attention integration
  (:mod:`~hf_dynbsz.execution.attention.flash`).

The kernels that tests replace with a stand-in of the same contract are this package's names, read at every call:
:data:`VARLEN_KERNEL` (flash-attention's varlen call), :data:`VARLEN_ATTN_KERNEL` (torch's ``varlen_attn``; None:
torch's own) and :data:`FLEX_KERNEL` (flex_attention, compiled once per row width).

Which models it may run is decided in :mod:`hf_dynbsz.planning.model_support`; the self-check
(:mod:`hf_dynbsz.execution.self_check`) verifies it on the first step's samples.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from hf_dynbsz.execution.attention.common import ATTENTION_NAME
from hf_dynbsz.execution.attention.flash import flash_attention, flash_varlen
from hf_dynbsz.execution.attention.flex import (
    FLEX_BLOCK_SIZE,
    FLEX_FALLBACK_OPTIONS,
    FLEX_KERNEL,
    _FlexKernel,
    flex_attention,
    flex_row_width,
)
from hf_dynbsz.execution.attention.layout import (
    _ACTIVE,
    Part,
    SegmentLayout,
    active_segments,
    use_segments,
)
from hf_dynbsz.execution.attention.spans import SPAN_CALLS_PER_LAYER, SpanCall, _padded_partition, span_attention
from hf_dynbsz.execution.attention.varlen import device_facts, varlen_attention, varlen_attn_keywords
from hf_dynbsz.planning.cost import text_config_of

__all__ = [
    "ATTENTION_NAME",
    "FLEX_BLOCK_SIZE",
    "FLEX_FALLBACK_OPTIONS",
    "FLEX_KERNEL",
    "Part",
    "SPAN_CALLS_PER_LAYER",
    "SegmentLayout",
    "SpanCall",
    "VARLEN_ATTN_KERNEL",
    "VARLEN_KERNEL",
    "active_segments",
    "device_facts",
    "flex_row_width",
    "segment_attention",
    "segment_attention_forward",
    "use_segments",
    "varlen_attn_keywords",
]

_PRIVATE = (_ACTIVE, _FlexKernel, _padded_partition)  # importable from here as before (tests read them)

#: The varlen kernel of the flash formulation; tests replace it with a reference kernel.
VARLEN_KERNEL = flash_varlen

#: torch's ``varlen_attn`` as segment attention calls it; None: ``torch.nn.attention.varlen.varlen_attn``, looked up
#: at the first call. CPU tests put a reference kernel of the same contract here (torch has no CPU kernel).
VARLEN_ATTN_KERNEL = None


def segment_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query`` ``(1, heads, T, d)``, ``key``/``value`` ``(1, kv_heads, T, d /
    d_v)``; returns ``((1, T, heads, d_v), None)``. Attends within the segments of the active layout only."""
    with torch.profiler.record_function("dynbsz/attention"):
        return _segment_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _segment_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    layout = _ACTIVE[0]
    if layout is None or query.size(0) != 1:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention runs padding-free rows of hf_dynbsz only (one row with its "
            "segments); this forward carries none."
        )
    if attention_mask is not None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention got an attention mask (or bias) from "
            f"{type(module).__name__}; it cannot place it on the segments of a padding-free row."
        )
    # The layer's window: what it passes (None on a full-attention layer), else its own attribute.
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    inputs = (module, layout, query, key, value, scaling, dropout, window)
    if layout.flash:
        return flash_attention(*inputs, kernel=VARLEN_KERNEL, **kwargs)
    if layout.varlen:
        return varlen_attention(*inputs, kernel=VARLEN_ATTN_KERNEL, **kwargs)
    if layout.flex:
        return flex_attention(*inputs, kernel=FLEX_KERNEL, **kwargs)
    return span_attention(*inputs, **kwargs)


AttentionInterface.register(ATTENTION_NAME, segment_attention_forward)


@contextlib.contextmanager
def segment_attention(model, enabled: bool = True, name: str = ATTENTION_NAME):
    """Run ``model``'s attention through :func:`segment_attention_forward` inside the context (forward AND backward:
    gradient checkpointing recomputes the forward during backward). The layouts of the passes are given by
    :func:`use_segments`; the active one is cleared on exit. ``name``: the registered implementation to switch to
    (:data:`hf_dynbsz.execution.sequence_parallel.ULYSSES_ATTENTION_NAME` wraps this one for sharded rows)."""
    if not enabled:
        yield
        return
    config = text_config_of(model.config)
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
        _ACTIVE[0] = None
