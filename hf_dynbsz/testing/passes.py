"""One pass of a bare model (no trainer) as the executor runs it, for the tests of the torch layer: a micro-batch
built by the packing collator, run through segment attention and segment recurrence; and the self-check's passes over
such a model; a step's samples cut at random into such passes. Heavy libraries are imported inside the functions."""

from __future__ import annotations

import contextlib

__all__ = ["bare_check_passes", "packed_logps", "packed_pass", "random_passes"]


@contextlib.contextmanager
def packed_pass(
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
    sharing: str | None = None,
):
    """Yields ``(micro-batch, log-probs, entropies)`` of samples ``indices`` of ``table`` (a ``SequenceTable``) in one
    pass, log-probs and entropies completion-aligned ``(rows, width)``; ``model`` has TRL's fused LM head. Segment
    attention and recurrence stay on inside the context, so a backward there (and gradient checkpointing's
    recomputation) runs the pass as the executor's does.

    ``groups``: prompt groups whose prompts the row shares (None: none shared); ``sharing``: instead, the rule the
    row's samples share positions by (a :class:`~hf_dynbsz.planning.settings.SharePrefix` or its value, "tree" or
    "groups": :meth:`SequenceTable.prefix_keys`; none or None: nothing); ``attention``: the base
    implementation segment attention wraps (None: the model's own attention, as padded rows run); ``layout``,
    ``attention_mask``, ``pad_to_multiple_of``: the collator's; ``mixers``: the class names of the sequence mixers
    segment recurrence runs per sequence (empty: none).
    """
    from hf_dynbsz.execution.attention import segment_attention, use_segments
    from hf_dynbsz.execution.packing import build_microbatch
    from hf_dynbsz.execution.recurrence import segment_recurrence
    from hf_dynbsz.execution.rope import stock_rope, use_rope_widths

    mb = build_microbatch(
        table,
        indices,
        layout=layout,
        pad_token_id=pad_token_id,
        attention=attention,
        groups=groups,
        attention_mask=attention_mask,
        pad_to_multiple_of=pad_to_multiple_of,
        keys=table.prefix_keys(sharing) if sharing else None,
    )
    with segment_attention(model, attention is not None), segment_recurrence(model, mixers), stock_rope(model):
        use_segments(mb.segments)
        use_rope_widths(mb.rope_widths)
        out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
        yield mb, mb.to_completion_layout(out.log_probs), mb.to_completion_layout(out.entropy)


def packed_logps(model, table, indices, groups=None, attention=None, pad_to_multiple_of=None, **options):
    """``(micro-batch, log-probs, entropies)`` of one :func:`packed_pass` (same arguments)."""
    with packed_pass(model, table, indices, groups, attention, pad_to_multiple_of, **options) as result:
        return result


def random_passes(model, batch, layout: str, seed: int, passes: int = 4):
    """A step's samples (a ``StepBatch``) cut at random into ``passes`` packed passes of ``layout``, as a step's
    samples may be: per pass ``(micro-batch, log-probs, entropies, the samples' rows)`` (:func:`packed_logps`)."""
    import random

    order = list(range(len(batch)))
    random.Random(seed).shuffle(order)
    cuts = sorted(random.Random(seed + 10).sample(range(1, len(order)), passes - 1))
    for start, end in zip([0, *cuts], [*cuts, len(order)]):
        mb, logps, entropies = packed_logps(model, batch.table, order[start:end], layout=layout)
        yield mb, logps, entropies, batch.rows(order[start:end], logps.size(1))


def bare_check_passes(model, table, gradients: bool = True):
    """The self-check's two callables for a bare ``model`` (TRL's fused LM head) and ``table``, as
    :class:`~hf_dynbsz.execution.check_passes.CheckPasses` gives them for a run: ``run_layout(layout, indices,
    gradients=True)`` and ``run_alone(index, gradients=True)``, each returning a
    :class:`~hf_dynbsz.execution.check_passes.Probe` with the gradients of
    :func:`~hf_dynbsz.execution.check_passes.check_loss` (when ``gradients``, and ``gradients`` was given here), over
    the samples of :func:`~hf_dynbsz.execution.check_passes.gradient_table` as in a run. As in a
    run, sequence mixers decide on prefix states in the first pass of a layout with shared prompts: make it one
    without gradients."""
    import torch

    from hf_dynbsz.execution.check_passes import Probe, check_loss, checked_parameters, gradient_table, gradients_of
    from hf_dynbsz.planning.model_support import ModelSupport
    from hf_dynbsz.testing.oracles import logps_alone

    parameters = checked_parameters(model) if gradients else []
    tables = {False: table, True: gradient_table(table)}  # by whether a pass computes gradients

    def probe(logps, indices, want):
        if not (want and parameters):
            return Probe(logps.detach())
        completions = tables[True].completion_lengths.tolist()
        return Probe(logps.detach(), gradients_of(check_loss(logps, indices, completions), parameters))

    def run_layout(layout, indices, want=True):
        rows = tables[bool(want and parameters)]
        mixers = ModelSupport.of(model=model).sequence_mixers if layout.segment_recurrence else ()
        options = dict(layout=layout.name, attention_mask=layout.attention_mask, mixers=mixers, sharing=layout.sharing)
        with torch.set_grad_enabled(bool(want and parameters)):
            with packed_pass(model, rows, indices, None, layout.segment_attention, **options) as (_, logps, _):
                return probe(logps, indices, want)

    def run_alone(index, want=True):
        with torch.set_grad_enabled(bool(want and parameters)):
            return probe(logps_alone(model, tables[bool(want and parameters)], index).unsqueeze(0), [index], want)

    return run_layout, run_alone
