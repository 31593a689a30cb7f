"""Specification of hf_dynbsz.planning.model_support: what runs for a model is read off the model, once, and never
raises."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from transformers import CONFIG_MAPPING

from hf_dynbsz.planning.cost import GENERIC_DECODER, ModelFlops
from hf_dynbsz.planning.model_support import VARLEN_ATTN, DeviceFacts, Layout, ModelSupport
from hf_dynbsz.planning.settings import SharePrefix


def support_of(model_type, attn_implementation="sdpa", **config):
    return ModelSupport.of(CONFIG_MAPPING[model_type](**config), attn_implementation=attn_implementation)


def names(layouts):
    return [
        (layout.name, bool(layout.sharing), layout.segment_attention, layout.attention_mask, layout.attention)
        for layout in layouts
    ]


# ---- the layouts a run may use, fastest first -------------------------------------------------------------------
def test_a_plain_decoder_starts_padding_free_with_shared_prompts_and_can_step_down_to_stocks_layout():
    layouts, notes = support_of("llama").layouts()
    assert [layout.sharing for layout in layouts] == [SharePrefix.TREE, SharePrefix.GROUPS] + [SharePrefix.NONE] * 3
    assert names(layouts) == [
        ("padding_free", True, "sdpa", False, "varlen"),
        ("padding_free", True, "sdpa", False, "varlen"),
        ("padding_free", False, "sdpa", False, "varlen"),
        ("padded", False, None, False, "dense"),
        ("padded", False, None, True, "dense"),
    ]
    assert notes == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "qwen3_moe", "qwen2_vl"])
def test_a_prefix_tree_comes_first_and_steps_down_to_prompt_groups(model_type):
    """share_prompt_prefix="tree" on every family with shared prompts (hybrid, MoE, vision-language): the tree's rung,
    then the prompt groups' (where the self-check steps down), then no sharing; "groups" starts at the groups' rung,
    True (the default rule) at the tree's."""
    support = ModelSupport.of(CONFIG_MAPPING[model_type](), attn_implementation="sdpa")
    tree, notes = support.layouts(share_prompt_prefix="tree")
    assert [layout.sharing for layout in tree[:3]] == [SharePrefix.TREE, SharePrefix.GROUPS, SharePrefix.NONE]
    assert notes == []
    assert tree[0].describe().startswith("padding_free, prefix tree, segment attention (sdpa)")
    assert tree[1:] == support.layouts(share_prompt_prefix="groups")[0] and tree == support.layouts()[0]
    padded, notes = support.layouts("padded", share_prompt_prefix="tree")
    assert not any(layout.sharing for layout in padded)
    assert notes == ["share_prompt_prefix is not applied: packing_layout='padded'"]


@pytest.mark.parametrize(
    "attn, expected",
    [
        ("flash_attention_2", "flash_attention_2"),
        ("kernels-community/flash-attn3", "kernels-community/flash-attn3"),
        ("eager", "eager"),
        (None, "eager"),
    ],
)
def test_segment_attention_wraps_the_models_own_kernel(attn, expected):
    layouts, _ = ModelSupport.of(CONFIG_MAPPING["qwen2"](), attn_implementation=attn).layouts()
    assert layouts[0].segment_attention == expected


def test_an_explicit_layout_keeps_to_its_kind():
    support = support_of("llama")
    assert {layout.name for layout in support.layouts("padded")[0]} == {"padded"}
    assert {layout.name for layout in support.layouts("padding_free")[0]} == {"padding_free"}
    assert not any(layout.sharing for layout in support.layouts("auto", share_prompt_prefix=False)[0])
    with pytest.raises(ValueError, match="packing_layout must be one of .* got 'packed'"):
        support.layouts("packed")


def test_without_segment_attention_sdpa_pads_and_flash_packs_by_its_own_varlen_kernel():
    blocked = dataclasses.replace(support_of("llama"), segment_attention_blocker="no AttentionInterface")
    layouts, notes = blocked.layouts()
    assert names(layouts)[0] == ("padded", False, None, False, "dense")
    assert notes == ["share_prompt_prefix is not applied: no AttentionInterface"]
    # an explicit padding_free on sdpa: transformers' own block mask over the row (dense, but exact)
    assert names(blocked.layouts("padding_free")[0]) == [("padding_free", False, None, False, "dense")]
    flash = dataclasses.replace(blocked, attn_implementation="flash_attention_2")
    assert names(flash.layouts()[0])[0] == ("padding_free", False, None, False, "varlen")


def unknown_state_kind(**config):
    """A decoder whose config names a layer kind that carries state and that segment recurrence does not know."""
    config = CONFIG_MAPPING["llama"](**config)
    config.layer_types = ["full_attention", "retention"]
    return ModelSupport.of(config, attn_implementation="sdpa")


@pytest.mark.parametrize(
    ("model_type", "blocked"),
    [
        ("retention", "retention"),  # a layer kind segment recurrence does not know
        ("llama", None),
        ("gemma3_text", None),  # sliding-window layers see other tokens only through attention
        ("mistral", None),  # a default sliding window of 4096: segment attention draws it
    ],
)
def test_layers_that_carry_unknown_state_along_a_row_block_padding_free(model_type, blocked):
    support = unknown_state_kind() if model_type == "retention" else support_of(model_type)
    assert (support.padding_free_blocker is None) == (blocked is None)
    if blocked:
        assert blocked in support.padding_free_blocker
        for attention in ("sdpa", "flash_attention_2"):  # not even a varlen kernel keeps a recurrent state apart
            layouts, _ = dataclasses.replace(support, attn_implementation=attention).layouts()
            assert {layout.name for layout in layouts} == {"padded"}
            with pytest.raises(ValueError, match=r"packing_layout='padding_free' cannot train this model exactly"):
                support.layouts("padding_free")


@pytest.mark.parametrize(
    ("model_type", "kinds"), [("qwen3_next", ("linear_attention",)), ("jamba", ("linear_attention", "mamba"))]
)
def test_the_planner_takes_known_state_carrying_kinds_as_segment_recurrence(model_type, kinds):
    """Without the model (``hf-dynbsz plan --model_config``) the layer kinds are all there is: the trainer decides
    from the modules, and the self-check verifies."""
    support = support_of(model_type)
    assert support.padding_free_blocker is None and support.sequence_mixers == kinds
    layout = support.layouts()[0][0]
    assert layout.segment_recurrence and layout.sharing
    assert layout.describe().endswith("segment recurrence")


@pytest.mark.parametrize(
    ("model_type", "mixers"),
    [
        ("qwen3_next", ("Qwen3NextGatedDeltaNet",)),
        ("jamba", ("JambaMambaMixer",)),
        ("mamba2", ("Mamba2Mixer",)),  # no attention at all: no position ids or segment attention needed
        ("lfm2", ("Lfm2ShortConv",)),
        ("recurrent_gemma", ("RecurrentGemmaRecurrentBlock",)),
        ("minimax", ("MiniMaxLightningAttention",)),
    ],
)
def test_a_models_sequence_mixers_are_read_off_its_modules(model_type, mixers):
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    support = ModelSupport.of(model=build_tiny_causal_lm_of_type(model_type))
    assert support.sequence_mixers == mixers
    assert support.padding_free_blocker is None and support.segment_attention_blocker is None


@pytest.mark.parametrize(
    ("model_type", "loose"),
    [("rwkv", "RwkvSelfAttention"), ("xlstm", "xLSTMBackend"), ("zaya", "Conv1d")],  # zaya: inside its attention
)
def test_state_outside_a_sequence_mixer_keeps_padded_rows(model_type, loose):
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    support = ModelSupport.of(model=build_tiny_causal_lm_of_type(model_type))
    assert support.sequence_mixers == ()
    assert f"its {loose} modules carry state along a row" in support.padding_free_blocker
    assert {layout.name for layout in support.layouts()[0]} == {"padded"}


def test_indexed_sparse_attention_runs_stock_math():
    """DeepSeek-V3.2's indexer picks keys over the whole padded row: even stock's log-probs of a sample change with
    the width it is padded to, so no repacking can be stock's."""
    support = support_of("deepseek_v32")
    assert "width it is padded to" in support.repacking_blocker
    layouts, notes = support.layouts()
    assert layouts == [] and notes[0].startswith("dynamic batching is off, stock TRL math runs")


def test_repacked_vision_language_models_share_image_prompts_in_padding_free_rows():
    support = support_of("qwen2_vl")
    assert support.vision_language == "repacked" and support.multimodal_rope
    assert names(support.layouts()[0])[0] == ("padding_free", True, "sdpa", False, "varlen")
    assert names(support.layouts()[0])[-1] == ("padded", False, None, True, "dense")  # padded rows keep their mask
    assert not support_of("llava").multimodal_rope  # image tokens positioned like text
    other = support_of("idefics3")  # a family outside REPACKED_VISION_MODEL_TYPES: padded, with a mask
    assert other.vision_language == "stock" and "position ids" in other.padding_free_blocker
    assert names(other.layouts()[0]) == [("padded", False, None, True, "dense")]


def test_model_only_checks(tmp_path):
    """What only the model tells: AttentionInterface dispatch, RoBERTa-style positions, bidirectional attention."""
    import torch
    from transformers import AutoModelForCausalLM

    config = CONFIG_MAPPING["roberta"](
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=40,
        is_decoder=True,
        pad_token_id=1,
    )
    roberta = AutoModelForCausalLM.from_config(config)
    support = ModelSupport.of(model=roberta)
    assert support.position_offset == 2  # padding_idx + 1
    assert support.segment_attention_blocker is None and support.unmasked_padding_blocker is None
    encoder = AutoModelForCausalLM.from_config(
        dataclasses.replace(config, is_decoder=False)
        if dataclasses.is_dataclass(config)
        else CONFIG_MAPPING["roberta"](**{**config.to_dict(), "is_decoder": False})
    )
    bidirectional = ModelSupport.of(model=encoder)
    assert "both directions" in bidirectional.segment_attention_blocker
    assert names(bidirectional.layouts()[0]) == [("padded", False, None, True, "dense")]
    no_backend = SimpleNamespace(config=roberta.config, _supports_attention_backend=False, modules=lambda: [])
    assert "AttentionInterface" in ModelSupport.of(model=no_backend).segment_attention_blocker
    del torch


def test_unknown_attention_implementations_are_named():
    blocker = support_of("llama", attn_implementation="paged|sdpa").segment_attention_blocker
    assert "attn_implementation='paged|sdpa'" in blocker and "flex_attention" in blocker  # and what it wraps


def test_flex_attention_gets_padding_free_rows_with_shared_prompts():
    support = support_of("llama", attn_implementation="flex_attention")
    assert support.segment_attention_blocker is None
    layouts, _ = support.layouts()
    assert layouts[0].sharing and layouts[0].segment_attention == "flex_attention"


# ---- a config it does not understand never raises ----------------------------------------------------------------
def test_the_cost_model_never_stops_a_model():
    """Gemma-4's head_dim is per layer (reading it raises), BLT has no top-level hidden_size: both get a cost model."""
    gemma4 = support_of("gemma4_text")
    assert gemma4.flops.per_token > 0 and not gemma4.notes
    blt = support_of("blt")
    assert blt.flops == ModelFlops.from_model_config(GENERIC_DECODER)
    assert "generic" in blt.notes[0]
    multi_head_latent = support_of("deepseek_v3", qk_nope_head_dim=128, qk_rope_head_dim=64)
    assert multi_head_latent.flops.per_pair == multi_head_latent.flops.per_pair  # read without error
    assert ModelSupport.of(None).flops == ModelFlops.from_model_config(GENERIC_DECODER)


def _default_configs():
    """Every config class of transformers that builds without arguments (all but a handful of composite ones)."""
    for model_type in sorted(CONFIG_MAPPING):
        try:
            CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that needs arguments is not ours to read
            continue
        yield model_type


@pytest.mark.parametrize("model_type", list(_default_configs()))
def test_every_config_of_transformers_is_read_without_raising(model_type):
    config = CONFIG_MAPPING[model_type]()
    support = ModelSupport.of(config, attn_implementation="sdpa")
    layouts, notes = support.layouts()
    assert all(isinstance(layout, Layout) for layout in layouts)
    assert layouts or support.repacking_blocker in notes[0]  # no layout: stock math, with its reason


def test_describe_names_every_limit():
    support = dataclasses.replace(unknown_state_kind(), position_offset=2)
    lines = support.describe()
    assert any(line.startswith("padding-free rows: off") for line in lines)
    assert any("position ids start at 2" in line for line in lines)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_auto_on_cuda_leaves_out_the_span_formulations_padding_free_rows(attention):
    support = support_of("llama", attn_implementation=attention)
    layouts, notes = support.layouts("auto", True, device_type="cuda")
    assert [layout.name for layout in layouts] == ["padded", "padded"]
    assert any("6.4x slower than stock" in note for note in notes)
    assert support.layouts("padding_free", True, device_type="cuda")[0][0].sharing  # asked for: given
    assert support.layouts("auto", True, device_type="cpu")[0][0].name == "padding_free"
    flex = support_of("llama", attn_implementation="flex_attention").layouts("auto", True, device_type="cuda")[0]
    assert flex[0].segment_attention == "flex_attention"


# ---- torch's varlen_attn on CUDA: where it runs, and the one reason where it does not -------------------------------
#: A device where varlen_attn runs: an H100 (sm90), torch 2.13, bf16 mixed precision.
CAPABLE = DeviceFacts(
    type="cuda", capability=(9, 0), torch_version=(2, 13), varlen_attn=True, varlen_window=True,
    compute_dtype="bfloat16",
)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_on_a_capable_gpu_sdpa_and_eager_take_varlen_attn_padding_free_rows(attention):
    support = support_of("llama", attn_implementation=attention)
    layouts, notes = support.layouts("auto", True, CAPABLE)
    assert names(layouts) == [
        ("padding_free", True, VARLEN_ATTN, False, "varlen"),  # a prefix tree (True: the default rule)
        ("padding_free", True, VARLEN_ATTN, False, "varlen"),  # prompt groups
        ("padding_free", False, VARLEN_ATTN, False, "varlen"),
        ("padded", False, None, False, "dense"),
        ("padded", False, None, True, "dense"),
    ]
    assert notes == [] and support.varlen_attn_reason(CAPABLE) is None
    assert support.layouts("padding_free", True, CAPABLE)[0][0].segment_attention == VARLEN_ATTN
    # flex_attention and flash-attention keep their own kernel; a CPU keeps the span formulation
    assert (
        support_of("llama", attn_implementation="flex_attention").layouts("auto", True, CAPABLE)[0][0].segment_attention
        == "flex_attention"
    )  # noqa: E501
    assert support.layouts("auto", True, dataclasses.replace(CAPABLE, type="cpu"))[0][0].segment_attention == attention


@pytest.mark.parametrize(
    "device, reason",
    [
        (dataclasses.replace(CAPABLE, compute_dtype="float32"), "computes in bf16 or fp16 only"),
        (dataclasses.replace(CAPABLE, capability=(7, 5)), "(sm75) is below sm80"),
        (dataclasses.replace(CAPABLE, varlen_attn=False, torch_version=(2, 9)), "torch 2.9 has no"),
        ("cuda", "torch unknown has no"),  # a device known by its type alone
    ],
)
def test_a_device_varlen_attn_cannot_use_falls_back_to_todays_ladder_with_one_reason(device, reason):
    support = support_of("qwen2")
    assert reason in support.varlen_attn_reason(device)
    layouts, notes = support.layouts("auto", True, device)
    assert [layout.name for layout in layouts] == ["padded", "padded"]  # padded rows, as before varlen_attn
    (note,) = [note for note in notes if "varlen_attn" in note]
    assert reason in note and "6.4x slower than stock" in note
    pinned, pinned_notes = support.layouts("padding_free", True, device)  # asked for: the span formulation
    assert pinned[0].segment_attention == "sdpa" and any(reason in note for note in pinned_notes)


@pytest.mark.parametrize(
    "model_type, config, reason",
    [
        ("gemma2", {}, "soft-capped (attn_logit_softcapping=50.0)"),
        ("gpt_oss", {}, "sinks"),
        ("deepseek_v3", {}, "value heads (128) differ in size from its query and key heads (192)"),
        ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ("mistral", {}, None),  # a sliding window, and a torch whose varlen_attn takes window_size
        ("qwen2", {}, None),
    ],
)
def test_what_varlen_attn_cannot_compute_as_the_model_does_is_named(model_type, config, reason):
    support = support_of(model_type, attn_implementation="eager", **config)
    assert support.varlen_attn_reason(CAPABLE) == (reason and support.varlen_attn_blocker)
    if reason:
        assert reason in support.varlen_attn_reason(CAPABLE)
        assert support.layouts("auto", True, CAPABLE)[0][0].name == "padded"


def test_sliding_windows_need_a_varlen_attn_that_takes_window_size():
    no_window = dataclasses.replace(CAPABLE, varlen_window=False, torch_version=(2, 10))
    assert support_of("mistral").sliding_windows and "window_size" in support_of("mistral").varlen_attn_reason(
        no_window
    )
    assert not support_of("qwen2").sliding_windows  # use_sliding_window=False
    assert support_of("qwen2").varlen_attn_reason(no_window) is None
    assert support_of("gemma3_text").sliding_windows  # sliding_attention layers


# ---- sliding windows that reach attention through the model's mask only ----------------------------------------
def tiny_model_with_window(model_type: str, window: int | None = 8):
    """The zoo's tiny ``model_type`` (its config's defaults made small) with ``sliding_window=window``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.zoo import tiny_causal_lm_config

    config = tiny_causal_lm_config(model_type)
    config.sliding_window = window
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("model_type", ["phimoe", "doge"])
def test_a_window_the_attention_modules_do_not_carry_refuses_segment_attention_at_start(model_type):
    """PhiMoE and Doge apply their sliding window through create_sliding_window_causal_mask alone; segment attention
    reads the window from the attention call, so it would attend past it: padding-free rows are not used, with the
    reason (the share_prompt_prefix note the run logs), and padded rows run the model's own mask."""
    support = ModelSupport.of(model=tiny_model_with_window(model_type))
    assert "sliding window (sliding_window=8) reaches attention only through the mask" in (
        support.segment_attention_blocker
    )
    layouts, notes = support.layouts()
    assert all(layout.name == "padded" for layout in layouts)
    assert notes == [f"share_prompt_prefix is not applied: {support.segment_attention_blocker}"]
    assert ModelSupport.of(model=tiny_model_with_window(model_type, None)).segment_attention_blocker is None


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text", "moshi"])
def test_a_window_the_attention_modules_carry_or_the_model_never_applies_keeps_segment_attention(model_type):
    """Mistral passes its window to the attention call, Qwen2 and Gemma-3 hold it on their attention modules, and
    Moshi never applies its config's window (stock's forward attends fully too)."""
    model = tiny_model_with_window(model_type, 8 if model_type != "gemma3_text" else 4)
    assert ModelSupport.of(model=model).segment_attention_blocker is None
