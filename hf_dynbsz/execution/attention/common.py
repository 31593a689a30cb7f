"""What every kernel of segment attention shares: its registered name and the dtype of its inputs (torch layer)."""

from __future__ import annotations

import torch

__all__ = ["ATTENTION_NAME", "autocast_inputs"]

#: The name segment attention is registered under in transformers' ``AttentionInterface``.
ATTENTION_NAME = "hf_dynbsz_segments"


def autocast_inputs(query, key, value):
    """``query``, ``key``, ``value`` in autocast's dtype where autocast is on for their device, as sdpa receives them.

    Autocast casts sdpa's inputs but not flex_attention's, and a model's rotary or per-head norms can promote queries
    and keys to fp32 while values stay bf16: flex_attention's compiled backward then finds no kernel for the mixed
    dtypes on CUDA (``InductorError: LoweringException: NoValidChoicesError``, pytorch/pytorch#176025), and even
    when dtypes agree it would run in fp32 where stock's sdpa runs in bf16.
    """
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)
