"""Segment attention through torch's own FlashAttention-2 varlen kernel, and the varlen spans (torch layer).

Models on sdpa or eager, on CUDA where :mod:`hf_dynbsz.planning.model_support` finds nothing against it: one call per
layer of ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; no flash-attn install) over the whole row. The query
spans tile the row, one per node of its prefix tree; a span's keys are its path's and its own: each node's ancestors'
keys and values are gathered in front of it, causal bottom-right (:func:`build_varlen_spans`, which the flash-attention
formulation reads too). Padding is a span of its own, so no token follows ``cu_seq[-1]`` (pytorch#176793). Partial
attentions are never merged through their log-sum-exp (the kernel's backward drops the log-sum-exp's gradient). The
installed signature is read at run time (:func:`varlen_attn_keywords`: ``is_causal`` or ``window_size``, ``scale``,
``enable_gqa``); inputs are cast to autocast's dtype, one dtype for query, key and value. CI has no GPU: a reference
kernel of the same contract (:func:`hf_dynbsz.testing.reference_varlen_attn`) stands in for it on CPU
(``hf_dynbsz.execution.attention.VARLEN_ATTN_KERNEL``). :func:`device_facts` reads the device for the planner.
"""

from __future__ import annotations

import functools
import inspect

import torch

from hf_dynbsz.execution.attention.common import autocast_inputs
from hf_dynbsz.planning.model_support import DeviceFacts

__all__ = ["build_varlen_spans", "device_facts", "varlen_attention", "varlen_attn_keywords"]


def build_varlen_spans(layout):
    """``(cu_seqlens_q, cu_seqlens_k, key_index, max_q, max_k)`` of ``layout`` on the host (see
    :meth:`~hf_dynbsz.execution.attention.layout.SegmentLayout.varlen_spans`)."""
    parts = layout.parts()
    query_lengths = [len(part.own) for part in parts]
    key_lengths = [part.depth + len(part.own) for part in parts]
    key_index = torch.cat([torch.arange(r.start, r.stop) for part in parts for r in (*part.path, part.own)])
    cu_q = torch.tensor([0, *query_lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *key_lengths]).cumsum(0).to(torch.int32)
    return cu_q, cu_k, key_index, max(query_lengths), max(key_lengths)


def _varlen_attn_kernel(kernel):
    """``kernel``, or torch's ``varlen_attn`` when it is None."""
    if kernel is not None:
        return kernel
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.lru_cache(maxsize=8)
def varlen_attn_keywords(kernel) -> frozenset[str]:
    """The parameters ``kernel`` (a ``varlen_attn``) takes, read once: torch 2.10's has ``is_causal`` and no
    ``scale``; 2.11 takes ``window_size`` (``(-1, 0)`` is causal) instead of ``is_causal``; 2.12 adds ``enable_gqa``."""
    return frozenset(inspect.signature(kernel).parameters)


def _torch_varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling, window: int | None, kernel=None):
    """One ``varlen_attn`` call: ``query`` ``(Tq, heads, d)``, ``key``/``value`` ``(Tk, kv_heads, d)``, causal and
    aligned bottom-right in each span, within ``window`` positions when the layer has one. Keywords the installed
    kernel lacks are made up exactly: no ``enable_gqa``, key and value heads are repeated (as transformers'
    ``repeat_kv``); no ``scale``, the queries are scaled so that the kernel's default scale gives ``scaling``. A
    window without ``window_size`` raises (the planner rules that out: ``ModelSupport.varlen_attn_reason``)."""
    kernel = _varlen_attn_kernel(kernel)
    keywords = varlen_attn_keywords(kernel)
    query, key, value = autocast_inputs(query, key, value)
    key, value = key.to(query.dtype), value.to(query.dtype)  # one dtype for all three
    options = {}
    heads, kv_heads = query.size(1), key.size(1)
    if kv_heads != heads:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    if window is not None and window < max_k:
        if "window_size" not in keywords:
            raise RuntimeError("this torch's varlen_attn takes no window_size; the layer has a sliding window")
        options["window_size"] = (window - 1, 0)  # the key aligned with the query and window - 1 before it
    elif "window_size" in keywords:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    default_scale = query.size(-1) ** -0.5
    if "scale" in keywords:
        options["scale"] = scaling
    elif scaling is not None and scaling != default_scale:
        query = query * (scaling / default_scale)
    return kernel(query, key, value, cu_q, cu_k, max_q, max_k, **options)


def varlen_attention(module, layout, query, key, value, scaling, dropout, window, kernel=None, **kwargs):
    """The whole row in one ``varlen_attn`` call (:func:`_torch_varlen`; ``kernel``: a stand-in of its contract, None
    for torch's); each node's path's keys and values are gathered in front of it."""
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or dropout:
        raise RuntimeError(
            f"{type(module).__name__} passes {', '.join(unsupported) or f'dropout={dropout}'} to its attention, which "
            "torch's varlen_attn does not compute (hf_dynbsz.planning.model_support rules such models out)"
        )
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans(query.device)
    if layout.gathers:
        key, value = key.index_select(2, key_index), value.index_select(2, key_index)
    out = _torch_varlen(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
        scaling, window, kernel,
    )  # fmt: skip
    return out.unsqueeze(0), None


def device_facts(device, mixed_precision: str | None, dtype: torch.dtype) -> DeviceFacts:
    """The :class:`~hf_dynbsz.planning.model_support.DeviceFacts` of ``device`` for a run whose forwards compute in
    ``mixed_precision``'s dtype ("bf16", "fp16") or else ``dtype`` (the weights')."""
    device = torch.device(device)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    keywords = varlen_attn_keywords(varlen_attn) if varlen_attn is not None else frozenset()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision), dtype)
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(device))
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return DeviceFacts(
        type=device.type,
        capability=capability,
        torch_version=(major, minor),
        varlen_attn=varlen_attn is not None,
        varlen_window="window_size" in keywords,
        compute_dtype=str(compute).removeprefix("torch."),
    )
