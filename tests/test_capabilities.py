"""Specification of hf_dynbsz.planning.capabilities: what a run uses, decided once at start from the model, the
settings and the launch."""

from __future__ import annotations

from hf_dynbsz import DynamicBatchGRPOConfig
from hf_dynbsz.planning.capabilities import SEGMENT_RECURRENCE_UNDER_ZERO3, Capabilities
from hf_dynbsz.planning.schedule import SINGLE_PROCESS
from hf_dynbsz.testing import base_config_kwargs, build_char_tokenizer, build_tiny_hybrid_lm


def capabilities(tmp_path, zero3: bool) -> Capabilities:
    model = build_tiny_hybrid_lm(build_char_tokenizer())
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), router_aux_loss_coef=0.0))
    return Capabilities.of(args, model, SINGLE_PROCESS, aux_loss=False, external_generation=False, zero3=zero3)


def test_a_hybrid_model_trains_padding_free_rows_through_segment_recurrence(tmp_path):
    first = capabilities(tmp_path, zero3=False).layouts[0]
    assert first.name == "padding_free" and first.share_prompts and first.segment_recurrence


def test_under_zero3_on_several_processes_a_hybrid_model_trains_padded_rows_with_the_reason(tmp_path):
    """Segment recurrence calls a mixer's modules once per run length, which differs between processes; ZeRO-3
    gathers a module's parameters at each call, with every process."""
    chosen = capabilities(tmp_path, zero3=True)
    assert chosen.enabled and {layout.name for layout in chosen.layouts} == {"padded"}
    assert not any(layout.segment_recurrence for layout in chosen.layouts)
    assert any(SEGMENT_RECURRENCE_UNDER_ZERO3 in note for note in chosen.notes), chosen.notes
