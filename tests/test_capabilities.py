"""Specification of hf_dynbsz.planning.capabilities: what a run uses, decided once at start from the model, the
settings and the launch."""

from __future__ import annotations

from hf_dynbsz import DynamicBatchGRPOConfig
from hf_dynbsz.parallel.distributed import fsdp_units, gathering_reason
from hf_dynbsz.planning.capabilities import SEGMENT_RECURRENCE_GATHERED, Capabilities
from hf_dynbsz.planning.schedule import SINGLE_PROCESS
from hf_dynbsz.testing import base_config_kwargs, build_char_tokenizer, build_tiny_hybrid_lm

#: What :func:`hf_dynbsz.parallel.distributed.gathered_calls` answers under ZeRO-3 on several processes.
ZERO3 = "under DeepSpeed ZeRO-3 on several processes each call of a module gathers its parameters"


def capabilities(tmp_path, gathered: str | None) -> Capabilities:
    model = build_tiny_hybrid_lm(build_char_tokenizer())
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), router_aux_loss_coef=0.0))
    return Capabilities.of(
        args, model, SINGLE_PROCESS, aux_loss=False, external_generation=False, gathered=lambda names: gathered
    )


def test_a_hybrid_model_trains_padding_free_rows_through_segment_recurrence(tmp_path):
    first = capabilities(tmp_path, gathered=None).layouts[0]
    assert first.name == "padding_free" and first.sharing and first.segment_recurrence


def test_where_a_mixers_calls_gather_parameters_a_hybrid_model_trains_padded_rows_with_the_reason(tmp_path):
    """Segment recurrence calls a mixer's modules once per run length, which differs between processes; ZeRO-3 on
    several processes gathers a module's parameters at each call, with every process (and FSDP a module it shards on
    its own: ``tests/test_distributed.py``)."""
    chosen = capabilities(tmp_path, gathered=ZERO3)
    assert chosen.enabled and {layout.name for layout in chosen.layouts} == {"padded"}
    assert not any(layout.segment_recurrence for layout in chosen.layouts)
    assert any(SEGMENT_RECURRENCE_GATHERED.format(why=ZERO3) in note for note in chosen.notes), chosen.notes


def pair(tmp_path, teacher, student=None, **settings):
    """The capabilities of a distillation of ``student`` (a tiny Qwen2) by ``teacher``."""
    from hf_dynbsz import DynamicBatchDistillationConfig
    from hf_dynbsz.planning.model_support import ModelSupport
    from hf_dynbsz.testing import build_tiny_causal_lm, distillation_config

    args = distillation_config("distillation_dynamic", str(tmp_path), **settings)
    assert isinstance(args, DynamicBatchDistillationConfig)
    student = student or build_tiny_causal_lm(build_char_tokenizer())
    own = Capabilities.of(args, student, SINGLE_PROCESS, aux_loss=False, external_generation=False)
    return own, own.with_teacher(args, ModelSupport.of(model=teacher))


def test_a_distillation_pair_keeps_the_layouts_both_models_allow(tmp_path):
    """A hybrid teacher allows the student's padding-free rows with its own sequence mixers run per sequence: the pair
    keeps them, with segment recurrence and the teacher's mixers; image steps of a vision-language model run stock."""
    from hf_dynbsz.testing import build_tiny_teacher

    own, same = pair(tmp_path, build_tiny_teacher(build_char_tokenizer()))
    assert same.layouts == own.layouts and same.enabled and same.scheduler.layout == "padding_free"
    own, hybrid = pair(tmp_path, build_tiny_hybrid_lm(build_char_tokenizer()))
    assert [layout.name for layout in hybrid.layouts] == [layout.name for layout in own.layouts]
    assert hybrid.layouts[0].segment_recurrence and hybrid.scheduler.segment_recurrence
    assert hybrid.support.sequence_mixers and not own.support.sequence_mixers


def test_a_teacher_on_another_attention_keeps_the_common_layouts_or_turns_repacking_off_with_the_reason(tmp_path):
    """The student's padding-free rows run segment attention on sdpa, an eager teacher's on eager: the pair keeps the
    padded rows both run (one note says which were left), or with packing_layout="padding_free" none (stock math)."""
    from hf_dynbsz.testing import build_tiny_teacher

    def eager_teacher():
        return build_tiny_teacher(build_char_tokenizer(), attn_implementation="eager")

    own, common = pair(tmp_path, eager_teacher())
    assert common.enabled and {layout.name for layout in common.layouts} == {"padded"} < {
        one.name for one in own.layouts
    }
    assert any("the teacher model does not run padding_free" in note for note in common.notes), common.notes
    own, none = pair(tmp_path, eager_teacher(), packing_layout="padding_free")
    assert own.enabled and not none.enabled and not none.layouts
    assert any("stock DistillationTrainer math runs: the teacher model" in note for note in none.notes), none.notes


# ---- which calls gather parameters: hf_dynbsz.parallel.distributed.gathering_reason ------------------------------
def fsdp_plugin(policy: str, **fields):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=policy, **fields)


def test_under_fsdps_transformer_wrap_a_hybrid_models_mixers_run_within_their_layers_gather(tmp_path):
    """accelerate's default FSDP wrap shards the decoder layers on their own (the model's ``_no_split_modules``): a
    mixer's calls run within its layer's gather, so padding-free rows with segment recurrence stay on."""
    model = build_tiny_hybrid_lm(build_char_tokenizer())
    units = fsdp_units(fsdp_plugin("transformer_based_wrap"), model)
    assert units == {"Qwen3NextDecoderLayer"}
    assert gathering_reason("FSDP", units, model, ("Qwen3NextGatedDeltaNet",)) is None
    assert fsdp_units(fsdp_plugin("no_wrap"), model) == frozenset()  # only the whole model is sharded


def test_an_fsdp_wrap_that_shards_a_mixer_on_its_own_turns_segment_recurrence_off_with_the_reason(tmp_path):
    model = build_tiny_hybrid_lm(build_char_tokenizer())
    wrapped = ["Qwen3NextDecoderLayer", "Qwen3NextGatedDeltaNet"]
    for plugin in (
        fsdp_plugin("transformer_based_wrap", transformer_cls_names_to_wrap=wrapped),
        fsdp_plugin("size_based_wrap"),  # any module large enough: none is known to stay whole
    ):
        reason = gathering_reason("FSDP", fsdp_units(plugin, model), model, ("Qwen3NextGatedDeltaNet",))
        assert reason is not None and reason.startswith("under FSDP on several processes"), reason
        chosen = capabilities(tmp_path, gathered=reason)
        assert {layout.name for layout in chosen.layouts} == {"padded"}
        assert any(SEGMENT_RECURRENCE_GATHERED.format(why=reason) in note for note in chosen.notes), chosen.notes
    assert gathering_reason("DeepSpeed ZeRO-3", None, model, ("Qwen3NextGatedDeltaNet",)) == ZERO3
    assert gathering_reason(None, None, model, ("Qwen3NextGatedDeltaNet",)) is None  # DDP, ZeRO-1/2, one process
