"""One pass of a bare model (no trainer) as the executor runs it, for the tests of the torch layer: a micro-batch
built by the packing collator, run through segment attention and segment recurrence. Heavy libraries are imported
inside the function."""

from __future__ import annotations

__all__ = ["packed_logps"]


def packed_logps(
    model,
    table,
    indices,
    groups=None,
    attention: str | None = None,
    pad_to_multiple_of: int | None = None,
    *,
    layout: str = "padding_free",
    attention_mask: bool = False,
    mixers: tuple[str, ...] = (),
    pad_token_id: int = 0,
):
    """``(micro-batch, log-probs, entropies)`` of samples ``indices`` of ``table`` (a ``SequenceTable``) in one pass,
    log-probs and entropies completion-aligned ``(rows, width)``; ``model`` has TRL's fused LM head.

    ``groups``: prompt groups whose prompts the row shares (None: none shared); ``attention``: the base
    implementation segment attention wraps (None: the model's own attention, as padded rows run); ``layout``,
    ``attention_mask``, ``pad_to_multiple_of``: the collator's; ``mixers``: the class names of the sequence mixers
    segment recurrence runs per sequence (empty: none).
    """
    from hf_dynbsz.execution.attention import segment_attention, use_segments
    from hf_dynbsz.execution.packing import build_microbatch
    from hf_dynbsz.execution.recurrence import segment_recurrence

    mb = build_microbatch(
        table,
        indices,
        layout=layout,
        pad_token_id=pad_token_id,
        attention=attention,
        groups=groups,
        attention_mask=attention_mask,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    with segment_attention(model, attention is not None), segment_recurrence(model, mixers):
        use_segments(mb.segments)
        out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
    return mb, mb.to_completion_layout(out.log_probs), mb.to_completion_layout(out.entropy)
