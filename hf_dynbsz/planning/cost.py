"""The cost model: how much compute a micro-batch is, read from the model's config.

:class:`ModelFlops` counts the multiply-accumulates of one forward pass of a decoder from its config;
:class:`WorkloadModel` is those numbers normalised to "token equivalents", the cost the partitioner
(:mod:`hf_dynbsz.planning.partition`) and the cross-rank balancing (:mod:`hf_dynbsz.planning.balance`) even out,
and the work the ``dynbsz/mfu`` metric counts. :func:`config_value` is the one reader of a model-config value the
planning layer (and the modules above it) use.

Pure Python + numpy: no torch or transformers import (the planner reads a config on any machine).
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_dynbsz.planning.coerce import check_choice, check_length_list, check_optional_int
from hf_dynbsz.planning.tokens import ATTENTION_KINDS, LAYOUTS, microbatch_tokens, round_up

__all__ = [
    "GENERIC_DECODER",
    "CONFIG_VALUE_KINDS",
    "ModelFlops",
    "WorkloadModel",
    "config_value",
    "text_config_of",
]

Lengths = Sequence[int] | np.ndarray  # tokens per sequence

#: What :func:`config_value` makes of a value: ``"any"`` as it is, ``"size"`` one count read leniently,
#: ``"positive_int"`` one positive integer or an error.
CONFIG_VALUE_KINDS = ("any", "size", "positive_int")


# --------------------------------------------------------------------------- #
# Reading a config
# --------------------------------------------------------------------------- #
def config_value(config: Any, name: str, default: Any = None, *, kind: str = "any") -> Any:
    """``config.<name>``, the one reader of a model-config value (a transformers config or any namespace).

    ``kind`` says how lenient the read is (the callers' differences are these arguments, not other readers):

    * ``"any"`` (the default): the value as it is (a list stays a list), or ``default`` when the attribute is
      missing, is ``None``, or raises on access.
    * ``"size"``: one count for an estimate. A list or tuple (a per-layer value, e.g. Gemma-3n's
      ``intermediate_size``) reads as its largest number, a float as ``int()`` of it; a value that is missing,
      ``None``, raises on access, is a bool or is not a number (a list without numbers included) reads as
      ``default``.
    * ``"positive_int"`` (strict, for the cost model): a missing or ``None`` attribute reads as ``default``; any
      other value must be one integer >= 1 (not a bool, a float or a list), else ``ValueError`` naming
      ``config.<name>`` and the fix. An attribute that raises on access raises here too, its error unchanged.

    A per-layer attribute of a heterogeneous config raises on global access (transformers'
    ``AmbiguousGlobalPerLayerAttributeError``, a ``RuntimeError``): it is caught by behaviour (any ``Exception``
    from ``getattr``), as this pure-Python layer cannot import transformers, and reads as ``default`` except with
    ``kind="positive_int"``.
    """
    if kind not in CONFIG_VALUE_KINDS:
        raise ValueError(f"kind must be one of {CONFIG_VALUE_KINDS}, got {kind!r}")
    if kind == "positive_int":
        value = getattr(config, name, None)  # a per-layer attribute's error propagates: the cost model refuses it
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"config.{name} must be a positive integer, got {value!r}: set {name} in the model's config to one "
                "integer >= 1 (or leave it out where it has a default)"
            )
        return int(value)
    try:
        value = getattr(config, name, default)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError: a per-layer value
        return default
    if value is None:
        return default
    if kind == "size":
        if isinstance(value, (list, tuple)):
            value = max((v for v in value if isinstance(v, (int, float))), default=default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return default
        return int(value)
    return value


# --------------------------------------------------------------------------- #
# Workload model
# --------------------------------------------------------------------------- #
#: A generic 7B-class decoder: the cost model when no config (or none readable) is given.
GENERIC_DECODER = types.SimpleNamespace(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008, hidden_act="silu"
)
_GATED_MLP_ACTIVATIONS = frozenset({"silu", "swish", "swiglu"})


def text_config_of(config):
    """The language model's config of a config: a transformers config's ``get_text_config()`` (itself for a text
    model, and where none is clear), or a namespace's ``text_config`` when it has no ``hidden_size`` of its own."""
    if config is not None and callable(getattr(config, "get_text_config", None)):
        try:
            return config.get_text_config()
        except Exception:  # noqa: BLE001 - several candidate text configs (encoder-decoder audio models)
            return config
    if getattr(config, "hidden_size", None) is None and getattr(config, "text_config", None) is not None:
        return config.text_config
    return config


@dataclass(frozen=True)
class ModelFlops:
    """Multiply-accumulates (MACs) of one forward pass of a decoder, read from its config.

    ``per_token``: the projections and MLP of every layer for one token; ``per_pair``: every layer's attention
    work for one (query, key) pair (scores and weighted values); ``per_logit_token``: the LM head for one token
    that gets logits. See :meth:`WorkloadModel.from_model_config` for the formulas; the workload model is these
    numbers normalised, so the partitioner and the ``dynbsz/mfu`` metric count the same work.
    """

    per_token: int
    per_pair: int
    per_logit_token: int

    @classmethod
    def from_model_config(cls, config) -> ModelFlops:
        """From a transformers config (a multimodal one is read through its ``text_config``) or a namespace."""
        config = text_config_of(config)
        hidden = config_value(config, "hidden_size", kind="positive_int")
        layers = config_value(config, "num_hidden_layers", kind="positive_int")
        if hidden is None or layers is None:
            raise ValueError(
                "config must define hidden_size and num_hidden_layers (positive integers), "
                f"got hidden_size={getattr(config, 'hidden_size', None)!r}, "
                f"num_hidden_layers={getattr(config, 'num_hidden_layers', None)!r}"
            )
        heads = config_value(config, "num_attention_heads", 1, kind="positive_int")
        head_dim = config_value(config, "head_dim", max(1, hidden // heads), kind="positive_int")
        kv_heads = config_value(config, "num_key_value_heads", heads, kind="positive_int")
        intermediate = config_value(config, "intermediate_size", kind="positive_int")
        activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        if intermediate is None:
            intermediate = 4 * hidden
        mlp_matrices = 3 if str(activation).lower() in _GATED_MLP_ACTIVATIONS else 2
        q_dim = heads * head_dim
        kv_dim = kv_heads * head_dim
        return cls(
            per_token=layers * (2 * hidden * q_dim + 2 * hidden * kv_dim + mlp_matrices * hidden * intermediate),
            per_pair=layers * 2 * q_dim,
            per_logit_token=hidden * (config_value(config, "vocab_size", 0, kind="positive_int") or 0),
        )

    def training_flops(
        self, prompt_lengths: Lengths, completion_lengths: Lengths, shared_prompt_tokens: int = 0
    ) -> float:
        """FLOPs of one forward and backward pass (3 forwards' worth, 2 FLOPs per MAC) over samples of these lengths.

        Every token goes through the layers, each sample attends causally to itself (``L (L + 1) / 2`` pairs), the
        LM head runs on completion tokens only (TRL's ``logits_to_keep``), and ``shared_prompt_tokens`` prompt
        tokens that shared prompts did not compute are taken off (their layer work). Gradient-checkpointing
        recomputation is not counted: this is model FLOPs, the numerator of MFU.
        """
        prompts = np.asarray(prompt_lengths, dtype=np.float64)  # a completion may be empty (fully masked)
        completions = np.asarray(completion_lengths, dtype=np.float64)
        totals = prompts + completions
        macs = (
            self.per_token * (totals.sum() - shared_prompt_tokens)
            + self.per_pair * (totals * (totals + 1) / 2).sum()
            + self.per_logit_token * completions.sum()
        )
        return 6.0 * float(macs)


@dataclass(frozen=True)
class WorkloadModel:
    """Relative compute cost of a micro-batch: linear_weight * tokens + quadratic_weight * attention term.

    The linear term covers the work that grows with the number of tokens
    (attention projections and MLP); the attention term counts (query, key)
    pairs.  Only ratios matter: :meth:`from_model_config` normalises
    ``linear_weight`` to 1.0, so a cost is measured in "token equivalents"
    (the projection + MLP work of one token).
    """

    linear_weight: float
    quadratic_weight: float

    def __post_init__(self) -> None:
        for name in ("linear_weight", "quadratic_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"WorkloadModel.{name} must be a finite number >= 0, got {value!r}")
        if self.linear_weight == 0 and self.quadratic_weight == 0:
            raise ValueError("WorkloadModel needs linear_weight > 0 or quadratic_weight > 0, got both 0")

    @classmethod
    def from_model_config(cls, config, layout: str = "padding_free", attention: str = "varlen") -> WorkloadModel:
        """Derive the weights from the per-token FLOPs of one transformer layer.

        ``config`` is anything with ``hidden_size``, ``num_hidden_layers`` and
        ``num_attention_heads`` attributes (a transformers ``PretrainedConfig``
        or a ``types.SimpleNamespace``); ``intermediate_size`` (default
        ``4 * hidden_size``), ``num_key_value_heads`` and ``head_dim`` are used
        when present.  A multimodal config without ``hidden_size`` is read
        through its ``text_config``.

        Per token and layer (multiply-accumulates): Q/O projections
        ``2 * h * q_dim``, K/V projections ``2 * h * kv_dim`` (``4 * h**2``
        without grouped-query attention) and the MLP ``m * h * intermediate``
        with ``m = 3`` for gated (SwiGLU, ``hidden_act`` silu/swish) MLPs and
        ``m = 2`` otherwise.  Per (query, key) pair and layer: ``2 * q_dim``
        (scores and weighted values).  Causal variable-length kernels
        (``layout="padding_free"``, ``attention="varlen"``, e.g. flash-attention)
        skip the masked half of the pairs, so the pair weight is halved there;
        dense attention (padded rows or one packed row with a mask) computes
        all pairs.  Backward passes scale both terms alike and drop out.
        """
        return cls.from_flops(ModelFlops.from_model_config(config), layout=layout, attention=attention)

    @classmethod
    def from_flops(cls, flops: ModelFlops, layout: str = "padding_free", attention: str = "varlen") -> WorkloadModel:
        """The weights of :meth:`from_model_config` from a model's :class:`ModelFlops`."""
        layout = check_choice("layout", layout, LAYOUTS)
        attention = check_choice("attention", attention, ATTENTION_KINDS)
        computed_pair_fraction = 0.5 if (layout == "padding_free" and attention == "varlen") else 1.0
        return cls(linear_weight=1.0, quadratic_weight=flops.per_pair * computed_pair_fraction / flops.per_token)

    @classmethod
    def default(cls, layout: str = "padding_free", attention: str = "varlen") -> WorkloadModel:
        """A generic 7B-class decoder (hidden 4096, 32 layers, SwiGLU MLP 11008), for when no config is given."""
        return cls.from_model_config(GENERIC_DECODER, layout=layout, attention=attention)

    def cost(
        self,
        lengths_in_microbatch,
        layout: str = "padding_free",
        pad_to_multiple_of: int | None = None,
        attention: str = "varlen",
    ) -> float:
        """Relative compute of one micro-batch (token equivalents when ``linear_weight`` is 1).

        * padding_free + ``"varlen"`` attention: ``linear * tokens + quad * sum(L_i**2)``
          (every sequence attends only to itself); ``tokens`` is
          :func:`microbatch_tokens` (the sum, rounded up when padding to a multiple).
        * padding_free + ``"dense"`` attention (one row of ``T`` tokens with a mask):
          ``linear * T + quad * T**2``.
        * padded: ``rows`` rows of ``R = round_up(max L)``:
          ``linear * rows * R + quad * rows * R**2`` (``attention`` is ignored).
        """
        layout = check_choice("layout", layout, LAYOUTS)
        attention = check_choice("attention", attention, ATTENTION_KINDS)
        pad_to_multiple_of = check_optional_int("pad_to_multiple_of", pad_to_multiple_of)
        values = check_length_list(lengths_in_microbatch)
        if not values:
            return 0.0
        tokens = microbatch_tokens(values, layout, pad_to_multiple_of)
        if layout == "padded":
            row = round_up(max(values), pad_to_multiple_of)
            pairs = len(values) * row * row
        elif attention == "dense":
            pairs = tokens * tokens
        else:
            pairs = sum(v * v for v in values)
        return float(self.of(tokens, pairs))

    def of(self, tokens, pairs):
        """The one cost formula, ``linear x tokens + quadratic x pairs`` (numbers or numpy arrays): of a pass in
        :meth:`cost`, of an item in :func:`item_costs`."""
        return self.linear_weight * tokens + self.quadratic_weight * pairs
