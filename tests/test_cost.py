"""Specification of ``hf_dynbsz.planning.cost``: the one config reader and the cost model read off a config.

:func:`config_value` reads a model-config value one of three ways (``kind``); :class:`ModelFlops` counts a decoder's
multiply-accumulates; :class:`WorkloadModel` normalises them to the relative cost the partitioner balances.
"""

from __future__ import annotations

import types

import pytest

from hf_dynbsz.planning.cost import GENERIC_DECODER, ModelFlops, WorkloadModel, config_value, text_config_of


class AmbiguousGlobalPerLayerAttributeError(RuntimeError):
    """Stands in for transformers' error of a per-layer attribute read globally (the planning layer never imports
    transformers: the reader catches it by behaviour)."""


class PerLayerConfig(types.SimpleNamespace):
    """A heterogeneous config whose ``intermediate_size`` differs per layer: reading it globally raises."""

    @property
    def intermediate_size(self):
        raise AmbiguousGlobalPerLayerAttributeError("intermediate_size differs per layer; read it per layer")


# --------------------------------------------------------------------------- the config reader
def test_a_missing_or_none_attribute_reads_as_the_default_in_every_kind():
    config = types.SimpleNamespace(head_dim=None)
    for kind in ("any", "size", "positive_int"):
        assert config_value(config, "vocab_size", kind=kind) is None
        assert config_value(config, "vocab_size", 7, kind=kind) == 7
        assert config_value(config, "head_dim", 7, kind=kind) == 7


def test_a_value_reads_as_it_is_by_default():
    config = types.SimpleNamespace(model_type="llama", layer_types=["full_attention", "sliding_attention"], flag=False)
    assert config_value(config, "model_type") == "llama"
    assert config_value(config, "layer_types") == ["full_attention", "sliding_attention"]  # a list stays a list
    assert config_value(config, "flag", True) is False  # only None falls back, not a falsy value
    assert config_value(None, "model_type", "none") == "none"


def test_a_per_layer_attribute_that_raises_reads_as_the_default_unless_strict():
    config = PerLayerConfig(hidden_size=64)
    assert config_value(config, "intermediate_size") is None
    assert config_value(config, "intermediate_size", 3) == 3
    assert config_value(config, "intermediate_size", 0, kind="size") == 0
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError, match="per layer"):  # strict: the error, unchanged
        config_value(config, "intermediate_size", kind="positive_int")


def test_a_size_is_one_count_read_leniently():
    config = types.SimpleNamespace(
        intermediate_size=[8192, 16384, "x"],  # per layer (Gemma-3n): the largest number
        hidden_size=2048.0,
        heads=True,
        act="silu",
        empty=[],
        words=["a", "b"],
    )
    assert config_value(config, "intermediate_size", 0, kind="size") == 16384
    assert config_value(config, "hidden_size", 0, kind="size") == 2048
    assert isinstance(config_value(config, "hidden_size", 0, kind="size"), int)
    assert config_value(config, "heads", 0, kind="size") == 0  # a bool is not a count
    assert config_value(config, "act", 0, kind="size") == 0
    assert config_value(config, "empty", 0, kind="size") == 0
    assert config_value(config, "words", 0, kind="size") == 0


def test_a_strict_read_wants_one_positive_integer_and_names_the_setting():
    config = types.SimpleNamespace(hidden_size=64, intermediate_size=[128, 256], heads=True, layers=0, width=64.0)
    assert config_value(config, "hidden_size", kind="positive_int") == 64
    for name in ("intermediate_size", "heads", "layers", "width"):
        with pytest.raises(ValueError, match=rf"config\.{name} must be a positive integer, got .*: set {name} in"):
            config_value(config, name, kind="positive_int")


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        config_value(types.SimpleNamespace(), "hidden_size", kind="int")


# --------------------------------------------------------------------------- text config
def test_text_config_of_a_namespace_without_sizes_is_its_text_config():
    text = types.SimpleNamespace(hidden_size=64)
    assert text_config_of(types.SimpleNamespace(text_config=text)) is text
    assert text_config_of(text) is text
    assert text_config_of(None) is None


def test_text_config_of_a_config_with_get_text_config_calls_it():
    text = types.SimpleNamespace(hidden_size=64)

    class Composite:
        def get_text_config(self):
            return text

    class Ambiguous:
        def get_text_config(self):
            raise ValueError("several text configs")

    assert text_config_of(Composite()) is text
    ambiguous = Ambiguous()
    assert text_config_of(ambiguous) is ambiguous


# --------------------------------------------------------------------------- model flops
def test_model_flops_refuse_a_per_layer_size():
    config = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=[1, 2])
    with pytest.raises(ValueError, match="config.intermediate_size must be a positive integer"):
        ModelFlops.from_model_config(config)
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError):
        ModelFlops.from_model_config(PerLayerConfig(hidden_size=64, num_hidden_layers=2))


def test_model_flops_of_the_generic_decoder():
    flops = ModelFlops.from_model_config(GENERIC_DECODER)
    assert flops.per_token == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert flops.per_pair == 32 * 2 * 4096
    assert flops.per_logit_token == 0  # no vocab_size


# --------------------------------------------------------------------------- workload model
def test_workload_from_config_uses_per_token_flops_of_a_layer():
    config = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = WorkloadModel.from_model_config(config, layout="padded")
    # Per token: Q, K, V, O projections 4*h^2 + non-gated MLP 2*h*(4h); per (query, key) pair: 2*h.
    linear = 2 * (4 * 64**2 + 2 * 64 * 4 * 64)
    quadratic = 2 * (2 * 64)
    assert model.linear_weight == 1.0
    assert model.quadratic_weight == pytest.approx(quadratic / linear)


def test_workload_missing_intermediate_size_means_four_times_hidden():
    base = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8)
    implicit = WorkloadModel.from_model_config(types.SimpleNamespace(**base))
    explicit = WorkloadModel.from_model_config(types.SimpleNamespace(**base, intermediate_size=4 * 256))
    assert implicit == explicit


def test_workload_gated_mlp_and_grouped_query_attention():
    gated = types.SimpleNamespace(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=512,
        hidden_act="silu",
    )
    model = WorkloadModel.from_model_config(gated, layout="padded")
    linear = 2 * 128 * 128 + 2 * 128 * (2 * 16) + 3 * 128 * 512
    assert model.quadratic_weight == pytest.approx(2 * 128 / linear)


def test_workload_is_not_hard_coded_to_one_model_size():
    small = WorkloadModel.from_model_config(
        types.SimpleNamespace(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864)
    )
    large = WorkloadModel.from_model_config(
        types.SimpleNamespace(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)
    )
    # Attention matters relatively more for narrow models: the quadratic share shrinks with width.
    assert small.quadratic_weight > large.quadratic_weight > 0


def test_workload_causal_varlen_kernels_compute_half_the_pairs():
    config = types.SimpleNamespace(hidden_size=512, num_hidden_layers=4, num_attention_heads=8)
    varlen = WorkloadModel.from_model_config(config, layout="padding_free", attention="varlen")
    dense = WorkloadModel.from_model_config(config, layout="padding_free", attention="dense")
    padded = WorkloadModel.from_model_config(config, layout="padded")
    assert varlen.quadratic_weight == pytest.approx(dense.quadratic_weight / 2)
    assert padded == dense


def test_workload_reads_text_config_of_multimodal_configs():
    text = types.SimpleNamespace(hidden_size=256, num_hidden_layers=2, num_attention_heads=4)
    wrapper = types.SimpleNamespace(text_config=text)
    assert WorkloadModel.from_model_config(wrapper) == WorkloadModel.from_model_config(text)


def test_workload_default_is_a_generic_7b_decoder():
    generic = types.SimpleNamespace(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008, hidden_act="silu"
    )
    assert WorkloadModel.default() == WorkloadModel.from_model_config(generic)
    assert 0 < WorkloadModel.default().quadratic_weight < 1e-3


def test_workload_rejects_configs_without_sizes():
    with pytest.raises(ValueError, match="hidden_size"):
        WorkloadModel.from_model_config(types.SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        WorkloadModel.from_model_config(types.SimpleNamespace(hidden_size=64, num_hidden_layers=0))


def test_workload_cost_formulas():
    model = WorkloadModel(linear_weight=2.0, quadratic_weight=0.5)
    # padding_free + varlen: linear * sum(L) + quad * sum(L_i^2)
    assert model.cost([3, 4]) == 2.0 * 7 + 0.5 * (9 + 16)
    # padding_free + dense: one row of T tokens
    assert model.cost([3, 4], attention="dense") == 2.0 * 7 + 0.5 * 49
    assert model.cost([3, 4], attention="dense", pad_to_multiple_of=8) == 2.0 * 8 + 0.5 * 64
    # padded: rows x longest (rounded)
    assert model.cost([3, 4], layout="padded") == 2.0 * 8 + 0.5 * 2 * 16
    assert model.cost([3, 4], layout="padded", pad_to_multiple_of=8) == 2.0 * 16 + 0.5 * 2 * 64
    assert model.cost([]) == 0.0


def test_workload_rejects_bad_weights():
    with pytest.raises(ValueError, match="quadratic_weight"):
        WorkloadModel(1.0, -1.0)
    with pytest.raises(ValueError, match="both 0"):
        WorkloadModel(0.0, 0.0)
