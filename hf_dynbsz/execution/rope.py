"""LongRoPE factors per sample, as stock's forward picks them (torch layer).

transformers' LongRoPE (``rope_type="longrope"``: Phi-3/3.5/4-mini long-context models and others) has two sets of
rotary frequencies, and picks one per forward (``dynamic_rope_update``): the long factors once the forward's
``max(position_ids) + 1`` passes ``original_max_position_embeddings``, the short ones below. Stock TRL's forwards run
padded micro-batches without position ids, so the model numbers the positions ``0 .. W - 1`` over the padded width
``W`` (the generation round's longest prompt plus its longest completion, on that process), and every sample of the
round takes the factors of ``W``, whatever its own length: the no-grad passes, chunked by ``batch_size``, keep the
round's width too. A repacked pass holds samples of several rounds (and processes) and its own widest position says
nothing about theirs.

So each sample carries its *rope width* (:func:`~hf_dynbsz.planning.model_support.rope_width` of stock's width,
:attr:`~hf_dynbsz.execution.packing.SequenceTable.rope_widths`), each pass names its tokens' rope widths
(:func:`use_rope_widths`, the micro-batch's :attr:`~hf_dynbsz.execution.packing.MicroBatch.rope_widths`), and inside
:func:`stock_rope` the model's LongRoPE modules compute both sets of frequencies with their own code and give each token
the set of its sample: :func:`stock_factors_forward`. Samples of different rope widths share no position of a prefix
tree (:meth:`~hf_dynbsz.execution.packing.SequenceTable.prefix_keys`). Which models this applies to is decided in
:mod:`hf_dynbsz.planning.model_support` (``long_rope``); dynamic NTK, whose frequencies depend on every earlier
forward, is refused there (stock math runs).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hf_dynbsz.planning.model_support import LONG_ROPE, long_rope_modules

__all__ = ["active_rope_widths", "original_positions", "stock_factors_forward", "stock_rope", "use_rope_widths"]

#: The rope widths of the forward being run (``(rows or 1, tokens)``, like its position ids), or None.
_ACTIVE: list[torch.Tensor | None] = [None]


def use_rope_widths(widths: torch.Tensor | None) -> None:
    """Make ``widths`` (each token's rope width, shaped like the pass's position ids; None: the model picks by the
    pass's own positions, as for a lockstep pass) those of the next forward (and of its backward's recomputation)."""
    _ACTIVE[0] = widths


def active_rope_widths() -> torch.Tensor | None:
    """The rope widths :func:`use_rope_widths` named for the forward being run."""
    return _ACTIVE[0]


@contextlib.contextmanager
def stock_rope(model):
    """Inside the context (forward AND backward: a rotary module inside a checkpointed layer runs again in the
    backward), ``model``'s LongRoPE modules give each token the factors of its rope width
    (:func:`stock_factors_forward`); nothing changes for a model without any. Re-entering it for the same model
    changes nothing; the active widths are cleared on the exit that restores the modules."""
    patched = [module for module in long_rope_modules(model) if "forward" not in vars(module)]
    for module in patched:
        module.forward = functools.partial(stock_factors_forward, module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
        if patched:
            _ACTIVE[0] = None


def stock_factors_forward(module, x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
    """``module``'s rotary embeddings (cos, sin) at ``position_ids``, each token's from the factors its rope width
    picks (:func:`use_rope_widths`): the model's own forward with its frequencies set, as ``dynamic_rope_update`` sets
    them, for a forward of the short width (position 0) and of the long one (position ``original``), merged token by
    token. Without widths (or for a layer type that is not LongRoPE), the model's own forward."""
    decorated = type(module).forward
    keywords = {} if layer_type is None else {"layer_type": layer_type}
    widths = _ACTIVE[0]
    kind = module.rope_type if layer_type is None else module.rope_type[layer_type]
    if widths is None or kind != LONG_ROPE:
        return decorated(module, x, position_ids, **keywords)
    original = original_positions(module, layer_type)
    short, long = (
        _with_frequencies_of(module, decorated, x, position_ids, width, keywords) for width in (1, original + 1)
    )
    chosen = (widths > original).unsqueeze(-1)
    if isinstance(short, torch.Tensor):
        return torch.where(chosen, long, short)
    return type(short)(torch.where(chosen, one, other) for other, one in zip(short, long))


def _with_frequencies_of(module, decorated, x, position_ids, width: int, keywords: dict):
    """``module``'s plain forward at ``position_ids`` after the model's own ``dynamic_rope_update`` set its frequencies
    for a forward ``width`` positions wide (one probe position, ``width - 1``)."""
    decorated(module, x, position_ids.new_full((1, 1), width - 1), **keywords)
    return decorated.__wrapped__(module, x, position_ids, **keywords)


def original_positions(module, layer_type=None) -> int:
    """The ``original_max_position_embeddings`` ``module`` picks its factors by (of ``layer_type``'s parameters
    where the model keeps one set per layer type), read as ``dynamic_rope_update`` reads it."""
    parameters = module.config.rope_parameters
    if layer_type is not None:
        parameters = parameters[layer_type]
    return int(parameters["original_max_position_embeddings"])
