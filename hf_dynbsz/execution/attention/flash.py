"""Segment attention on flash-attention: one varlen call per layer through transformers' integration (torch layer).

The query spans are the row's nodes (plain sequences, shared prefixes, blocks: any node of its prefix tree) and the key
spans ``[path ; own]`` (keys gathered: :func:`~hf_dynbsz.execution.attention.varlen.build_varlen_spans`); causal
masks of flash-attention >= 2.1 align bottom-right, and so do sliding windows. CI has no GPU: the index arithmetic is
tested on CPU with a reference varlen kernel (:mod:`hf_dynbsz.testing`) standing in for the kernel
(``hf_dynbsz.execution.attention.VARLEN_KERNEL``).
"""

from __future__ import annotations

import torch

__all__ = ["flash_attention", "flash_varlen"]


def flash_varlen(module, layout, query, key, value, cu_q, cu_k, max_q, max_k, scaling, dropout, **features):
    """transformers' flash-attention integration on varlen spans (the base implementation's kernel): ``query``
    ``(Tq, heads, d)``, ``key``/``value`` ``(Tk, kv_heads, d / d_v)``; ``features``: the layer's ``sliding_window``,
    ``softcap`` and ``s_aux``. Values with another head size than queries (multi-head latent attention) are padded
    to it and the output cropped, as transformers' own integration does."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    value_dim = value.size(-1)
    if value_dim != query.size(-1):
        value = torch.nn.functional.pad(value, [0, query.size(-1) - value_dim])
    sinks = features.get("s_aux")
    out = _flash_attention_forward(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        None,
        query_length=query.size(0),
        is_causal=True,
        dropout=dropout,
        softmax_scale=scaling,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max_q,
        max_length_k=max_k,
        target_dtype=get_target_dtype(query, module),
        sliding_window=features.get("sliding_window"),
        softcap=features.get("softcap"),
        s_aux=sinks.to(query.dtype) if sinks is not None else None,
        attn_implementation=layout.base_implementation,
    ).squeeze(0)
    return out[..., :value_dim]


def flash_attention(module, layout, query, key, value, scaling, dropout, window, kernel=flash_varlen, **kwargs):
    """The whole row in one varlen call of the flash-attention formulation (``kernel``: :func:`flash_varlen`, or a
    stand-in of its contract)."""
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans(query.device)
    features = {name: kwargs.get(name) for name in ("softcap", "s_aux")}
    out = kernel(
        module,
        layout,
        query[0].transpose(0, 1),
        key[0, :, key_index].transpose(0, 1),
        value[0, :, key_index].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        scaling,
        dropout,
        sliding_window=window,
        **features,
    )
    return out.unsqueeze(0), None
