"""Segment attention: padding-free rows and shared prompts on every attention kernel (torch layer).

A padding-free row is cut into *segments*, each attending only to itself:

* a plain sequence (prompt + completion): causal attention over it;
* a prompt shared by several completions of that prompt (GRPO's ``num_generations`` samples):
  ``[prefix | block_1 | ... | block_k]``, where ``prefix`` is the prompt without its last token and ``block_j`` is
  the prompt's last token followed by completion ``j``. Prefix tokens attend causally to the prefix; a block's tokens
  attend to the whole prefix and causally to their own block, never to a sibling. Position ids continue from the
  prefix in every block, so each block computes exactly what its own sequence would (its first token, the prompt's
  last, predicts the completion's first token, as in stock's separate sequence).

:func:`segment_attention_forward` is registered in transformers' ``AttentionInterface`` as
:data:`ATTENTION_NAME`; :func:`segment_attention` switches a model to it around the passes that carry a
:class:`SegmentLayout` (forward keyword ``dynbsz_segments``, which transformers hands down to the attention
function; ``masking_utils`` builds no mask for an implementation it does not know, so the function owns masking).
It is stateless, so gradient checkpointing recomputes it exactly. Two formulations, never a dense mask over a
whole row:

* sdpa / eager base implementations: ``scaled_dot_product_attention`` per span; plain sequences (and shared
  prefixes) of equal length batched into one causal call, the blocks of a shared segment attending to ``[prefix ;
  block]`` under a ``(block, prefix + block)`` mask: the attention work of the separate sequences, not more;
* flash-attention base implementations: one varlen call whose query spans are the prefixes and blocks and whose
  key spans are ``[prefix ; own block]`` (keys gathered; causal masks of flash-attention >= 2.1 align bottom-right),
  through transformers' own flash-attention integration. CI has no GPU: the index arithmetic is tested on CPU with
  :func:`reference_varlen_attention` standing in for the kernel.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .schedule import VARLEN_ATTENTION_PREFIXES, segment_attention_blocker

__all__ = ["ATTENTION_NAME", "Segment", "SegmentLayout", "segment_attention", "segment_attention_forward",
           "segment_attention_unsupported", "reference_varlen_attention"]

ATTENTION_NAME = "hf_dynbsz_segments"


@dataclass(frozen=True)
class Segment:
    """One segment of a padding-free row: ``prefix`` shared tokens (0 for a plain sequence), then ``blocks``."""

    start: int
    prefix: int
    blocks: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.prefix + sum(self.blocks)

    @property
    def plain(self) -> bool:
        return self.prefix == 0 and len(self.blocks) == 1


class SegmentLayout:
    """The segments of one padding-free row and the index tensors the kernels need, built once per pass.

    Every attention layer of the pass (and the recomputation of gradient checkpointing) reuses them.
    """

    def __init__(self, segments: list[Segment], base_implementation: str) -> None:
        self.segments = segments
        self.base_implementation = base_implementation
        self._cache: dict = {}

    @property
    def flash(self) -> bool:
        """Whether the base implementation is a flash-attention varlen kernel (else: sdpa per segment)."""
        return bool(self.base_implementation) and self.base_implementation.startswith(VARLEN_ATTENTION_PREFIXES)

    @property
    def width(self) -> int:
        return self.segments[-1].end if self.segments else 0

    # ---- sdpa formulation ---------------------------------------------------------------------------------------
    def sdpa_groups(self, device):
        """``([(queries, keys, rows, mask, skip)], restore)``: the ``scaled_dot_product_attention`` calls of a layer.

        Each call attends ``rows`` query spans of equal length to their key spans (``queries``, ``keys``: row positions,
        span after span) and keeps the outputs of each span's queries after the first ``skip``. Plain sequences and
        shared prefixes of one length are batched into one causal call (mask None). The blocks of shared segments
        with the same prefix and block length are batched too, their queries attending to ``[prefix ; block]``:
        when the block is at least as long as the prefix, as one causal call over ``[prefix ; block]`` whose prefix
        queries are dropped (the fast causal kernel; it recomputes the prefix's own causal attention, at most half a
        block's); otherwise the block's queries alone under a ``(block, prefix + block)`` mask (prefix open, block
        causal). Either way the work is about that of the separate sequences, never the square of a whole segment.
        ``restore`` puts the calls' kept outputs, concatenated, back in row order.
        """
        key = ("sdpa", device)
        if key not in self._cache:
            causal: dict[int, list[int]] = defaultdict(list)  # length -> starts of causal spans
            blocks: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # (prefix, block) -> starts
            for segment in self.segments:
                if segment.prefix:
                    causal[segment.prefix].append(segment.start)
                offset = segment.start + segment.prefix
                for block in segment.blocks:
                    if segment.prefix:
                        blocks[segment.prefix, block].append((segment.start, offset))
                    else:
                        causal[block].append(offset)
                    offset += block
            calls = []
            for length, starts in causal.items():
                spans = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1).to(device)
                calls.append((spans, spans, len(starts), None, 0))
            for (prefix, block), starts in blocks.items():
                own = torch.tensor([b for _, b in starts]).unsqueeze(1) + torch.arange(block)
                keys = torch.cat([torch.tensor([p for p, _ in starts]).unsqueeze(1) + torch.arange(prefix), own], 1)
                if block >= prefix:
                    calls.append((keys.reshape(-1).to(device), keys.reshape(-1).to(device), len(starts), None, prefix))
                    continue
                mask = torch.ones(block, prefix + block, dtype=torch.bool)
                mask[:, prefix:] = torch.ones(block, block, dtype=torch.bool).tril()
                calls.append((own.reshape(-1).to(device), keys.reshape(-1).to(device), len(starts), mask.to(device), 0))
            order = torch.cat([queries.view(rows, -1)[:, skip:].reshape(-1) for queries, _, rows, _, skip in calls])
            if order.numel() != self.width or not torch.equal(order.sort().values, torch.arange(self.width, device=device)):
                raise ValueError("segments must cover the row exactly (trailing padding included)")
            self._cache[key] = (calls, torch.argsort(order))
        return self._cache[key]

    # ---- varlen (flash) formulation ------------------------------------------------------------------------------
    def varlen_spans(self, device):
        """``(cu_seqlens_q, cu_seqlens_k, key_index, max_q, max_k)`` of the varlen formulation.

        Query spans tile the row in order (so queries need no gathering): each plain sequence, each prefix, each
        block. A span's keys are itself, except a block's: ``[its segment's prefix ; the block]``.
        """
        key = ("varlen", device)
        if key not in self._cache:
            query_lengths, key_ranges = [], []
            for segment in self.segments:
                prefix = (segment.start, segment.start + segment.prefix)
                if segment.prefix:
                    query_lengths.append(segment.prefix)
                    key_ranges.append([prefix])
                offset = segment.start + segment.prefix
                for block in segment.blocks:
                    query_lengths.append(block)
                    key_ranges.append(([prefix] if segment.prefix else []) + [(offset, offset + block)])
                    offset += block
            key_lengths = [sum(end - start for start, end in ranges) for ranges in key_ranges]
            key_index = torch.cat([torch.arange(start, end) for ranges in key_ranges for start, end in ranges])
            cu_q = torch.tensor([0, *query_lengths]).cumsum(0).to(device, torch.int32)
            cu_k = torch.tensor([0, *key_lengths]).cumsum(0).to(device, torch.int32)
            self._cache[key] = (cu_q, cu_k, key_index.to(device), max(query_lengths), max(key_lengths))
        return self._cache[key]


def segment_mask(prefix: int, blocks: tuple[int, ...]) -> torch.Tensor:
    """``(L, L)`` bool mask of a shared segment (True = may attend): prefix causal, each block on the prefix and
    causally on itself."""
    length = prefix + sum(blocks)
    owner = torch.full((length,), -1, dtype=torch.long)  # -1: prefix, j: block j
    offset = prefix
    for number, block in enumerate(blocks):
        owner[offset : offset + block] = number
        offset += block
    position = torch.arange(length)
    causal = position.unsqueeze(1) >= position.unsqueeze(0)
    key_owner, query_owner = owner.unsqueeze(0), owner.unsqueeze(1)
    return causal & ((key_owner == -1) | (key_owner == query_owner))


def reference_varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, scale: float | None,
                               dropout: float = 0.0) -> torch.Tensor:
    """What a causal flash-attention varlen kernel computes, in plain PyTorch (CPU tests stand it in for the kernel).

    ``query`` ``(total_q, heads, d)``, ``key``/``value`` ``(total_k, kv_heads, d)``; span ``i`` of the queries attends
    to span ``i`` of the keys, causally aligned bottom-right (query ``t`` of a span of ``q`` sees keys ``0 ..
    t + k - q``). Returns ``(total_q, heads, d)``.
    """
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        q = query[cu_seqlens_q[i] : cu_seqlens_q[i + 1]].transpose(0, 1).unsqueeze(0)
        k = key[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].transpose(0, 1).unsqueeze(0)
        v = value[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].transpose(0, 1).unsqueeze(0)
        q_len, k_len = q.size(2), k.size(2)
        mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= (
            torch.arange(q_len, device=q.device).unsqueeze(1) + k_len - q_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def _flash_varlen(module, layout, query, key, value, cu_q, cu_k, max_q, max_k, scaling, dropout):
    """transformers' flash-attention integration on varlen spans (the base implementation's kernel)."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    return _flash_attention_forward(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), None, query_length=query.size(0), is_causal=True,
        dropout=dropout, softmax_scale=scaling, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q,
        max_length_k=max_k, target_dtype=get_target_dtype(query, module),
        attn_implementation=layout.base_implementation,
    ).squeeze(0)


#: The varlen kernel of the flash formulation; tests replace it with :func:`reference_varlen_attention`.
VARLEN_KERNEL = _flash_varlen


def segment_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                              dynbsz_segments: SegmentLayout | None = None, **kwargs):
    """transformers attention function: ``query`` ``(1, heads, T, d)``, ``key``/``value`` ``(1, kv_heads, T, d)``;
    returns ``((1, T, heads, d), None)``. Attends within the segments of ``dynbsz_segments`` only."""
    layout = dynbsz_segments
    if layout is None or query.size(0) != 1:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs padding-free rows of hf_dynbsz only (one row with its "
                           "segments); this forward carries none.")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{ATTENTION_NAME} attention does not support {name}={kwargs[name]!r}; hf_dynbsz should "
                             "have kept this model on its own attention (segment_attention_unsupported).")
    if layout.flash:
        cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans(query.device)
        out = VARLEN_KERNEL(module, layout, query[0].transpose(0, 1), key[0, :, key_index].transpose(0, 1),
                            value[0, :, key_index].transpose(0, 1), cu_q, cu_k, max_q, max_k, scaling, dropout)
        return out.unsqueeze(0), None
    calls, restore = layout.sdpa_groups(query.device)
    heads, dim = query.size(1), query.size(3)
    outputs = []
    for queries, keys, rows, mask, skip in calls:

        def take(tensor, positions):
            picked = tensor.index_select(2, positions)  # (1, h, rows * length, d)
            return picked.view(tensor.size(1), rows, positions.numel() // rows, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(take(query, queries), take(key, keys), take(value, keys), attn_mask=mask,
                                             dropout_p=dropout, is_causal=mask is None, scale=scaling,
                                             enable_gqa=True)  # (rows, h, length, d)
        outputs.append(out[:, :, skip:].transpose(0, 1).reshape(heads, -1, dim))
    output = torch.cat(outputs, dim=1).index_select(1, restore)  # (heads, T, d) in row order
    return output.transpose(0, 1).unsqueeze(0).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, segment_attention_forward)


def segment_attention_unsupported(model) -> str | None:
    """Why segment attention cannot run ``model`` exactly, or None when it can.

    :func:`hf_dynbsz.schedule.segment_attention_blocker`'s config checks, plus what only the model tells: its
    attention layers must dispatch through transformers' ``AttentionInterface``, it must be a text model (vision-
    language models compute position ids of their own) and have no attention sinks.
    """
    config = model.config
    text_config = config.get_text_config()
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not dispatch its attention through transformers' AttentionInterface"
    if text_config is not config:
        return "multimodal models compute position ids of their own"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    return segment_attention_blocker(text_config, getattr(text_config, "_attn_implementation", None))


@contextlib.contextmanager
def segment_attention(model, enabled: bool = True):
    """Run ``model``'s attention through :func:`segment_attention_forward` inside the context (forward AND backward:
    gradient checkpointing recomputes the forward during backward)."""
    if not enabled:
        yield
        return
    config = model.config.get_text_config()
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
