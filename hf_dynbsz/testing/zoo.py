"""Tiny random-weight models of every text-only causal-LM architecture of transformers (the zoo).

Shared by ``tests/test_model_zoo.py`` (every architecture trained by stock TRL and by the plugin) and the README's
compatibility table. Nothing is downloaded: each config is the architecture's default config made tiny (hidden size
32, 2 layers or one of each layer kind the default has, 4 heads, head size 8, vocabulary 64, at most 1M parameters),
its distinctive features kept on and small enough to matter for sequences of 20-60 tokens: sliding windows and
chunks of 8, multi-head latent attention with query/key heads wider than value heads, attention sinks,
soft-capping, indexers choosing the top 4 keys, per-layer head sizes, 4 experts with 2 per token. Dropout is off.

    config = tiny_causal_lm_config("llama")            # or raises TinyConfigUnavailable(reason)
    model = build_tiny_causal_lm_of_type("llama", seed=0)
"""

from __future__ import annotations

import copy
import re

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "SEGMENT_RECURRENCE_FAMILIES",
    "TinyConfigUnavailable",
    "build_tiny_causal_lm_of_type",
    "causal_lm_types",
    "save_tiny_families",
    "tiny_causal_lm_config",
]


class TinyConfigUnavailable(Exception):
    """No tiny config of this model_type can be built here (the message says why)."""


H, LAYERS, HEADS, KV, HD, FF, EXPERT_FF = 32, 2, 4, 2, 8, 64, 32
WINDOW = 8  # sliding / local / chunked attention windows: smaller than the 20-60 token test sequences
MAX_PARAMS = 1_000_000

# Generic size overrides, applied to every attribute of these names that the default config has (as a real
# field holding a number, not a property/alias).
SIZES = {
    # width
    **dict.fromkeys(
        [
            "hidden_size",
            "n_embd",
            "d_model",
            "n_embed",
            "embed_dim",
            "model_dim",
            "emb_dim",
            "embedding_dim",
            "word_embed_proj_dim",
            "embedding_size",
            "input_embedding_size",
            "output_embedding_size",
            "backbone_hidden_size",
        ],
        H,
    ),
    # depth
    **dict.fromkeys(
        [
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "n_layers",
            "decoder_layers",
            "encoder_layers",
            "num_blocks",
            "num_decoder_layers",
            "num_encoder_layers",
        ],
        LAYERS,
    ),
    # heads
    **dict.fromkeys(
        [
            "num_attention_heads",
            "n_head",
            "num_heads",
            "n_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "attention_heads",
            "num_decoder_attention_heads",
            "num_encoder_attention_heads",
            "swa_num_attention_heads",
        ],
        HEADS,
    ),
    **dict.fromkeys(
        ["head_dim", "attention_head_size", "kv_channels", "d_head", "dim_head", "attention_head_dim", "swa_head_dim"],
        HD,
    ),
    # MLP
    **dict.fromkeys(
        [
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "d_ff",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "ffn_hidden_size",
            "dff",
            "dim_ff",
            "d_inner",
            "feed_forward_size",
            "intermediate_size_mlp",
            "dense_intermediate_size",
            "first_dense_intermediate_size",  # Ergo's leading dense layers
            "mlp_only_intermediate_size",  # Kolibri-1.1's dense-MLP layers
        ],
        FF,
    ),
    # vocab / positions
    **dict.fromkeys(
        [
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "max_target_positions",
            "max_source_positions",
            "context_length",
        ],
        512,
    ),
    # MoE
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk"], 2),
    **dict.fromkeys(
        [
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
        ],
        EXPERT_FF,
    ),
    # multi-head latent attention: q/k head = nope 8 + rope 4 = 12, value head 8
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "o_lora_rank": 16,
    # DeepSeek-V3.2-style indexer (sparse attention over the top-k keys)
    "index_topk": 4,
    **dict.fromkeys(["index_n_heads", "index_num_heads"], 2),
    "index_head_dim": 8,
    # local attention windows
    **dict.fromkeys(
        [
            "sliding_window",
            "attention_chunk_size",
            "window_size",
            "attention_window_size",
            "sliding_window_size",
            "local_attention_window_len",
        ],
        WINDOW,
    ),
    # linear attention / SSM
    **dict.fromkeys(["linear_num_heads", "linear_num_key_heads", "linear_num_value_heads"], 4),
    **dict.fromkeys(["linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"], HD),
    "state_size": 8,
    "time_step_rank": 4,
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    "ssm_state_size": 8,
    "mamba_chunk_size": 8,
    "chunk_size": 8,
    # mamba-2 heads: n_heads * head_dim = expand (2) * hidden (32) = 64
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads"], 8),
    **dict.fromkeys(["mamba_d_head", "mamba_head_dim", "mamba_headdim"], 8),
    "mamba_d_ssm": 2 * H,
    "n_groups": 2,
    **dict.fromkeys(["num_query_groups", "swa_num_key_value_heads"], KV),
    "query_pre_attn_scalar": HD,  # Gemma-2/3: attention scale 1/sqrt(query_pre_attn_scalar) (= head_dim upstream)
    "keep_window_size": WINDOW,  # Doge: dynamic mask keeps the top-k keys per query
    "adapter_rank": 8,  # Zamba2: LoRA adapters of the shared transformer block
    # per-layer embeddings (Gemma-3n / Gemma-4; their vocabulary is set to `vocab_size` below)
    "hidden_size_per_layer_input": 8,
    # partial rotary of GPT-J / CodeGen style models (rotary_dim of head_dim 8)
    "rotary_dim": 4,
}
# attributes only changed when the default is > 0 (0 = feature off, keep it off): shared experts, leading dense
# layers before the MoE ones (1 dense + 1 MoE layer), LongCat zero experts; multi-token-prediction layers are dropped
# (transformers does not build them for the causal LM)
POSITIVE_ONLY = {
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "shared_intermediate_size": EXPERT_FF,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "moe_layer_start_index": 1,
    "zero_expert_num": 2,
    "num_nextn_predict_layers": 0,
}
# attributes set even when the default is None
NONE_OK = ("head_dim", "num_experts_per_tok", "n_routed_experts", "intermediate_size", "n_inner")
LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_blocks")
# per-layer lists holding layer *indices* (not one entry per layer)
INDEX_LISTS = (
    "moe_layers",
    "full_attn_idxs",
    "mlp_only_layers",
    "hybrid_layer_ids",
    "attn_layer_indices",
    "index_layers",
)
# one entry per layer holding the index of the layer it reads (its own index: none), e.g. the layer whose keys and
# values it attends to: a selection of layers keeps the layers read by those chosen and renumbers the entries
REFERENCE_LISTS = ("kv_source_layers",)


def _is_dropout(name: str) -> bool:
    n = name.lower()
    return (
        "dropout" in n
        or "pdrop" in n
        or n.endswith("drop_rate")
        or n.endswith("layerdrop")
        or (re.search(r"_prob$", n) is not None and ("drop" in n or "attention_probs" in n or n.startswith("mask_")))
    )


def _fields(config) -> dict:
    """Real (settable) attributes of a config instance, by name."""
    out = {}
    for name, value in vars(config).items():
        if name.startswith("_"):
            continue
        if isinstance(getattr(type(config), name, None), property):
            continue
        out[name] = value
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _layer_count(fields: dict):
    for name in LAYER_COUNT_NAMES:
        if _is_number(fields.get(name)):
            return name, int(fields[name])
    return None, None


def _reference_lists(fields: dict, n_layers: int) -> dict:
    """The :data:`REFERENCE_LISTS` of a config with ``n_layers`` layers, by name."""
    return {
        k: list(v)
        for k, v in fields.items()
        if k in REFERENCE_LISTS
        and isinstance(v, (list, tuple))
        and len(v) == n_layers
        and all(isinstance(i, int) and 0 <= i < n_layers for i in v)
    }


def _select_layers(fields: dict, n_layers: int, min_layers: int = LAYERS):
    """Pick the fewest layer indices of the default config such that every value of every per-layer list
    (layer_types, mlp_layer_types, no-rope flags, index lists, ...) still occurs, and every kind of entry of a
    reference list (a layer reading its own or another layer's); the layers read by those picked are kept too, and
    index and reference lists renumbered. Returns (indices, lists)."""
    references = _reference_lists(fields, n_layers)
    per_layer = {
        k: list(v)
        for k, v in fields.items()
        if isinstance(v, (list, tuple)) and len(v) == n_layers and k not in INDEX_LISTS and k not in references
    }
    index_lists = {
        k: list(v)
        for k, v in fields.items()
        if k in INDEX_LISTS and isinstance(v, (list, tuple)) and all(isinstance(i, int) for i in v)
    }
    columns = dict(per_layer)
    for k, v in index_lists.items():
        columns[k] = [i in v for i in range(n_layers)]
    for k, v in references.items():
        columns[k] = [v[i] == i for i in range(n_layers)]
    need = {(k, repr(v)) for k, col in columns.items() for v in col}
    chosen: list[int] = []
    while need:
        best = max(range(n_layers), key=lambda i: (len({(k, repr(col[i])) for k, col in columns.items()} & need), -i))
        chosen.append(best)
        need -= {(k, repr(col[best])) for k, col in columns.items()}
    for i in range(n_layers):
        if len(chosen) >= min_layers:
            break
        if i not in chosen:
            chosen.append(i)
    read = {v[i] for v in references.values() for i in chosen} - set(chosen)
    while read:  # the layers those chosen read (and those they read)
        chosen.extend(read)
        read = {v[i] for v in references.values() for i in chosen} - set(chosen)
    chosen = sorted(chosen)
    new = {k: [v[i] for i in chosen] for k, v in per_layer.items()}
    for k, v in index_lists.items():
        new[k] = [j for j, i in enumerate(chosen) if i in v]
    for k, v in references.items():
        new[k] = [chosen.index(v[i]) for i in chosen]
    return chosen, new


# ---------------------------------------------------------------------------------------------------------------
# Per-model_type fix-ups: OVERRIDES[model_type](kwargs, default_config) edits the constructor kwargs in place after
# the generic pass; UNAVAILABLE[model_type] is the reason no tiny model of the type can be built.
# ---------------------------------------------------------------------------------------------------------------
def _set(**values):
    def apply(kwargs, default):
        kwargs.update(copy.deepcopy(values))

    return apply


def _blt(kwargs):
    """BLT sub-configs: global width = encoder width * cross_attn_k (2), so no projection; byte n-gram hash tables
    of `vocab_size` rows; the encoder's local attention window comes from local_attention_window_len."""
    vocab = kwargs["vocab_size"]
    local = dict(
        vocab_size=vocab, hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, max_position_embeddings=512
    )
    kwargs.update(
        encoder_hash_byte_group_vocab=vocab,
        local_attention_window_len=WINDOW,
        patcher_config=dict(local, num_hidden_layers=2, sliding_window=WINDOW),
        encoder_config=dict(local, num_hidden_layers=1, hidden_size_global=2 * H),
        decoder_config=dict(local, num_hidden_layers=2, hidden_size_global=2 * H),
        global_config=dict(
            hidden_size=2 * H,
            num_attention_heads=HEADS,
            num_hidden_layers=2,
            intermediate_size=2 * FF,
            max_position_embeddings=512,
        ),
    )


_ASSISTANT = (
    "speculative-decoding drafter (Gemma-4 assistant): its forward needs the target model's inputs_embeds "
    "and shared_kv_states, ignores input_ids and cannot run as a standalone causal LM"
)
UNAVAILABLE: dict[str, str] = {
    "gemma4_assistant": _ASSISTANT,
    "gemma4_unified_assistant": _ASSISTANT,
}

OVERRIDES: dict = {
    # bamba's default has no attention layer at all (and generate() then fails on a mamba-only cache): add one
    "bamba": _set(attn_layer_indices=[1]),
    # granite-4.0-h style hybrid: the default is all-mamba; keep one mamba and one (NoPE) attention layer
    "granitemoehybrid": _set(layer_types=["linear_attention", "full_attention"]),
    # mamba2 uses `num_heads` for SSM heads: num_heads * head_dim must equal expand * hidden = 64
    "mamba2": _set(num_heads=8, head_dim=8, n_groups=2),
    # the config's n_routed_experts / n_shared_experts default to None, which the modeling code cannot build
    "dots1": _set(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1),
    # DBRX attention reads attn_config.rope_theta (not a field of DbrxAttentionConfig); experts live in ffn_config
    "dbrx": _set(
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000.0, "attn_pdrop": 0.0},
        ffn_config={"ffn_hidden_size": EXPERT_FF, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    # LFM2: default layer_types are all attention; real checkpoints interleave short-conv and attention layers.
    # block_multiple_of rounds the (auto-adjusted) MLP width up to a multiple of 256
    "lfm2": _set(layer_types=["conv", "full_attention"], full_attn_idxs=[1], block_multiple_of=32),
    "lfm2_moe": _set(layer_types=["conv", "full_attention"]),
    # Cohere Compass (North) text: default is all full attention; the model supports sliding layers and NoPE layers
    # (rope_parameters[layer_type] = None); keep a RoPE sliding layer and a NoPE full layer like Cohere2
    "cohere_compass_text": _set(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
    ),
    # Gemma-3n: keep sliding+full, activation-sparse and dense MLP, KV-producing and KV-sharing layers
    "gemma3n_text": _set(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        intermediate_size=[FF] * 4,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        num_kv_shared_layers=2,
        laurel_rank=4,
    ),
    # Gemma-4: full-attention layers get their own (larger) head dim through per_layer_config
    "gemma4_text": _set(global_head_dim=16),
    "gemma4_unified_text": _set(global_head_dim=16),
    # dots3 note: sliding layers are MLA with their own sizes, given through swa_* kwargs
    "dots3_note_text": _set(
        swa_num_attention_heads=HEADS,
        swa_num_key_value_heads=HEADS,
        swa_q_lora_rank=16,
        swa_kv_lora_rank=16,
        swa_head_dim=12,
        swa_qk_nope_head_dim=8,
        swa_v_head_dim=8,
    ),
    # Inkling: relative-position logits over rel_extent distances (kept < test length so they matter)
    "inkling_text": _set(d_rel=4, rel_extent=16),
    # Qwen4-Exp: the QSA indexer fields default to None (no model can be built); also turn on the hashed n-gram
    # per-layer embeddings (PLE) on the linear-attention layer with a tiny n-gram vocabulary
    "qwen4_exp_text": _set(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=8,
        indexer_compress_ratio=2,
        hc_lowrank=4,
        ple_layer_ids=[1],
        ple_embed_dim=16,
        heads_per_ngram=2,
        ngram_vocab_size_base=61,
        make_ngram_vocab_size_divisible_by=8,
    ),
    # Dory (transformers 5.24): input, recurrent and output sections of 8 / 20 / 8 layers (the generic 2 layers would
    # leave the recurrent section at -14 layers); one layer each, the looped one with full attention, looped twice
    "dory": _set(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
    ),
    # Kolibri-1.1: indexed attention rounds keys and values to NVFP4 in blocks of 16 (head_dim a multiple of 16); an
    # indexer's pool of index_pool_size keys (blocks of index_compression) and the index_topk keys chosen from it
    # besides sink and local tokens are made small enough to select among 20-60 tokens (defaults 16384 / 8 / 128).
    # Layers: the generic selection gives a sliding layer, an indexer and an indexer reading its keys and values, but
    # no reindexer (an indexed layer rescoring the pool of the indexer before it), which most of the default's indexed
    # layers are: a sliding dense-MLP layer, an indexer with its own keys and values, a reindexer and an indexer that
    # both read them (the default's layers 4, 9 and 14)
    "kolibri1_1": _set(
        head_dim=16,
        index_pool_size=8,
        index_compression=2,
        index_num_sink_tokens=2,
        index_num_local_tokens=4,
        num_hidden_layers=4,
        layer_types=["sliding_attention"] + ["indexed_attention"] * 3,
        index_layers=[1, 3],
        kv_source_layers=[0, 1, 1, 1],
        mlp_only_layers=[0],
    ),
    # Jamba: default periods (attention every 8th layer from 4, MoE every 2nd from 1) leave 2 layers all-mamba;
    # layer 0 = mamba + MoE, layer 1 = attention + dense MLP
    "jamba": _set(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0),
    # RecurrentGemma: block_types is a cyclic pattern (recurrent, recurrent, attention); 2 layers would drop attention
    "recurrent_gemma": _set(block_types=["recurrent", "attention"], lru_width=H),
    # xLSTM: the generation cache sizes q/k and v heads from hidden*factor rounded up to a multiple of 64, the layers
    # without rounding; hidden 128 is the smallest width where both agree with the default qk_dim_factor 0.5
    "xlstm": _set(hidden_size=128, embedding_dim=128, ffn_proj_factor=0.5),
    # BLT (byte latent transformer): entropy patcher LM + local encoder/decoder + global transformer over patches
    "blt": lambda kwargs, default: _blt(kwargs),
    # Laguna: default is all full attention with one head count; the architecture has sliding layers (own RoPE) and
    # per-layer head counts, keep both: a sliding layer with 8 heads and a full layer with 4
    "laguna": _set(
        layer_types=["sliding_attention", "full_attention"], num_attention_heads_per_layer=[2 * HEADS, HEADS]
    ),
    # MiniMax-01: lightning (linear) attention is computed in blocks of block_size tokens (default 256)
    "minimax": _set(block_size=WINDOW),
    # MiniMax-M3: real checkpoints mix full layers and block-sparse "minimax_m3_sparse" layers (lightning indexer
    # picking index_topk_blocks key blocks of index_block_size tokens); default is all full + all MoE
    "minimax_m3_vl_text": _set(
        layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"],
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
    ),
    # ModernBERT decoder derives sliding_window = local_attention // 2
    "modernbert-decoder": _set(local_attention=2 * WINDOW),
    # DeepSeek-V4: head_dim is the (single-KV-head) attention head, RoPE on qk_rope_head_dim of it; compressed-KV
    # attention compresses every compress_rate tokens (defaults 4 / 128 would leave nothing to compress)
    "deepseek_v4": _set(
        head_dim=16,
        qk_rope_head_dim=4,
        o_groups=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    ),
    # Llama-4: NoPE layers scale queries by log1p(floor((pos + 1) / floor_scale)); 8192 would never trigger here
    "llama4_text": _set(floor_scale=WINDOW),
    # Inkling-2: full-attention layers scale q by log((pos + 1) / log_scaling_n_floor) beyond the floor (128000)
    "inkling2_text": _set(d_rel=4, rel_extent=16, log_scaling_n_floor=WINDOW),
    # XLM is bidirectional unless `causal` (its is_decoder). (XLNet's attn_type="uni" is not used: with a padding
    # attention_mask and batch > 1 its forward fails on a broadcast in this transformers version)
    "xlm": _set(causal=True),
    # ZAYA supports only top-1 routing
    "zaya": _set(num_experts_per_tok=1, router_hidden_size=16),
    # Reformer: axial position embeddings force seq_len == prod(axial_pos_shape) in training; use plain position
    # embeddings, chunk lengths 4 (local attention sees its chunk + the previous one), LSH buckets auto
    "reformer": _set(
        axial_pos_embds=False,
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
        num_buckets=None,
        attn_layers=["local", "lsh"],
    ),
    # RoCBert: shape / pronunciation embedding tables default to 24858 x 512 and 910 x 768
    "roc_bert": _set(shape_vocab_size=64, shape_embed_dim=8, pronunciation_vocab_size=64, pronunciation_embed_dim=8),
}


def _random_hash_routing(model):
    """DeepSeek-V4 hash-MoE layers route by a frozen token-id -> experts table that from_config leaves all zeros
    (every token -> expert 0); give each token distinct random experts."""
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            n_experts = module.num_experts
            rows = [torch.randperm(n_experts, generator=g)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


# model fix-ups after from_config: model_type -> callable(model) -> None
MODEL_FIXUPS: dict = {
    "deepseek_v4": _random_hash_routing,
    # X-MOD routes every layer through a language adapter and needs a default language
    "xmod": lambda model: model.set_default_language("en_XX"),
}


def _is_multimodal(config) -> str | None:
    try:
        text = config.get_text_config()
    except Exception:  # several text configs (e.g. musicgen: text_encoder + decoder)
        text = None
    subs = [k for k in getattr(config, "sub_configs", {}) or {}]
    if text is not config or hasattr(config, "vision_config") or hasattr(config, "audio_config"):
        return f"multimodal: {type(config).__name__} wraps sub-configs {', '.join(subs) or 'text_config'}"
    return None


def _default_config(model_type: str):
    return CONFIG_MAPPING[model_type]()


#: The hybrid and state-space families whose sequence mixers segment recurrence runs per sequence
#: (:mod:`hf_dynbsz.execution.recurrence`); ``tests/test_model_zoo.py`` checks this against its table.
SEGMENT_RECURRENCE_FAMILIES = (
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "falcon_mamba",
    "jamba",
    "kimi_linear",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "mamba",
    "mamba2",
    "minimax",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "recurrent_gemma",
    "zamba",
    "zamba2",
)

#: Layer patterns of :func:`tiny_causal_lm_config`: one layer of every kind (the zoo's, with the per-type patterns of
#: :data:`OVERRIDES`), or the default config's own pattern cut to its shortest prefix holding every kind.
LAYER_PATTERNS = ("one_per_kind", "default")
#: Config fields that only place the layer kinds: with ``layer_pattern="default"`` the default's own values stay and the
#: per-type overrides of these are not applied.
PATTERN_FIELDS = frozenset(
    {
        "num_hidden_layers",
        "layer_types",
        "block_types",
        "full_attn_idxs",
        "attn_layer_indices",
        "attn_layer_period",
        "attn_layer_offset",
        "expert_layer_period",
        "expert_layer_offset",
        "hybrid_layer_ids",
        "layers_block_type",
        "mlp_layer_types",
    }
)
#: The fewest layers of a default pattern: several recurrent layers in a row where the default has them.
MIN_DEFAULT_PATTERN_LAYERS = 3
#: Families whose default config has no layer of the kind their checkpoints are built around (an all-attention LFM2,
#: an all-Mamba Bamba that generation cannot run): the checkpoints' pattern, recurrent layers in a row, then attention.
DEFAULT_PATTERN_OVERRIDES: dict[str, dict] = {
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[3]),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "conv", "conv", "full_attention"], full_attn_idxs=[3]),
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=["conv", "conv", "conv", "full_attention"]),
}


def tiny_causal_lm_config(
    model_type: str,
    *,
    vocab_size: int = 64,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    layer_pattern: str = "one_per_kind",
):
    """A tiny config (random weights later) of transformers' causal-LM architecture `model_type`, or raise
    `TinyConfigUnavailable(reason)` when none can be built.

    ``layer_pattern``: ``"one_per_kind"`` (the fewest layers with one of every kind, the zoo's) or ``"default"`` (the
    default config's own layer pattern, cut to its shortest prefix that holds every kind of layer and MLP, at least
    :data:`MIN_DEFAULT_PATTERN_LAYERS` layers: a Jamba keeps four Mamba layers in a row with MoE between them)."""
    if layer_pattern not in LAYER_PATTERNS:
        raise ValueError(f"layer_pattern must be one of {LAYER_PATTERNS}, got {layer_pattern!r}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TinyConfigUnavailable(f"{model_type!r} is not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if model_type in UNAVAILABLE:
        raise TinyConfigUnavailable(UNAVAILABLE[model_type])
    default = _default_config(model_type)
    reason = _is_multimodal(default)
    if reason:
        raise TinyConfigUnavailable(reason)
    fields = _fields(default)
    kwargs: dict = {}
    _tiny_sizes(fields, kwargs)  # 1) sizes
    if layer_pattern == "default":  # 2) layers: the default's pattern, or one layer of every kind
        _default_pattern_prefix(default, fields, kwargs)
    else:
        _one_layer_per_kind(fields, kwargs)
    for name, value in fields.items():  # 3) dropouts off
        if _is_dropout(name) and _is_number(value):
            kwargs[name] = 0.0 if isinstance(value, float) else 0
    _small_vocabulary(fields, kwargs, vocab_size, pad_token_id, eos_token_id)  # 4) vocab and special tokens
    override = OVERRIDES.get(model_type)  # 5) per-type overrides
    if override is not None:
        pattern = {name: kwargs[name] for name in PATTERN_FIELDS if name in kwargs}
        override(kwargs, default)
        if layer_pattern == "default":  # the default's own pattern stays
            kwargs = {name: value for name, value in kwargs.items() if name not in PATTERN_FIELDS} | pattern
            kwargs.update(copy.deepcopy(DEFAULT_PATTERN_OVERRIDES.get(model_type, {})))
    return _instantiate(CONFIG_MAPPING[model_type], kwargs)


def _tiny_sizes(fields: dict, kwargs: dict) -> None:
    """Step 1 of :func:`tiny_causal_lm_config`: widths, heads, experts and windows of :data:`SIZES` into ``kwargs``."""
    for name, value in SIZES.items():
        if _is_number(fields.get(name)):
            kwargs[name] = value
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope and "factor" in rope:
        # YaRN / llama3 scaling: keep max_position_embeddings = original * factor consistent (no parameters depend
        # on it)
        kwargs.pop("max_position_embeddings", None)
    for name, value in POSITIVE_ONLY.items():
        if _is_number(fields.get(name)) and fields[name] > 0:
            kwargs[name] = value
    for name in NONE_OK:  # None defaults the modeling code cannot cope with (or derives from the full size)
        if name in fields and fields[name] is None and name in SIZES:
            kwargs[name] = SIZES[name]
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # MLA: head_dim is the rotary part of q/k
        kwargs["head_dim"] = SIZES["qk_rope_head_dim"]
    elif (
        _is_number(fields.get("v_head_dim"))
        and _is_number(fields.get("head_dim"))
        and fields["v_head_dim"] != fields["head_dim"]
    ):  # e.g. MiMo-V2: q/k heads wider than value heads
        kwargs["head_dim"], kwargs["v_head_dim"] = HD + 4, HD
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = KV
    if _is_number(fields.get("num_key_value_heads")):
        heads = fields.get("num_attention_heads") or HEADS
        kv = fields["num_key_value_heads"]
        kwargs["num_key_value_heads"] = 1 if kv == 1 else (KV if kv < heads else HEADS)
    for group, topk in (("n_group", "topk_group"), ("num_expert_group", "topk_group")):
        if _is_number(fields.get(group)) and fields[group] > 1:  # group-limited routing stays on
            kwargs[group], kwargs[topk] = 2, 1


def _one_layer_per_kind(fields: dict, kwargs: dict) -> None:
    """Step 2 of :func:`tiny_causal_lm_config`: the layer count and per-layer lists, one layer of every kind."""
    layer_name, n_layers = _layer_count(fields)
    if not n_layers:
        return
    chosen, lists = _select_layers(fields, n_layers)
    kwargs[layer_name] = max(len(chosen), LAYERS)
    for k, v in lists.items():
        size_key = next((n for n in (k, re.sub(r"_per_layer$", "", k)) if _is_number(SIZES.get(n))), None)
        if size_key and all(_is_number(x) for x in v):  # e.g. per-layer intermediate sizes / head counts
            v = [SIZES[size_key]] * len(v)
        kwargs[k] = v
    if "moe_layer_end_index" in fields and _is_number(fields["moe_layer_end_index"]):
        kwargs["moe_layer_end_index"] = kwargs[layer_name] - 1
    if "max_window_layers" in fields and _is_number(fields["max_window_layers"]):
        kwargs["max_window_layers"] = min(fields["max_window_layers"], kwargs[layer_name])


def _default_pattern_prefix(default, fields: dict, kwargs: dict) -> None:
    """Step 2 of :func:`tiny_causal_lm_config` with ``layer_pattern="default"``: the default's layers cut to the
    shortest prefix holding every value of every per-layer pattern (fields, and patterns derived from periods such as
    Jamba's ``layers_block_type``), at least :data:`MIN_DEFAULT_PATTERN_LAYERS`; per-layer lists cut to it, index lists
    kept below it. A pattern derived from periods follows the new layer count by itself."""
    layer_name, n_layers = _layer_count(fields)
    if not n_layers:
        return
    references = _reference_lists(fields, n_layers)
    patterns = [
        list(v)
        for k, v in fields.items()
        if isinstance(v, (list, tuple)) and len(v) == n_layers and k not in INDEX_LISTS and k not in references
    ]
    patterns += [[v[i] == i for i in range(n_layers)] for v in references.values()]  # reads its own or another's
    for name in ("layers_block_type", "layer_types"):  # derived patterns (properties)
        derived = getattr(default, name, None)
        if isinstance(derived, (list, tuple)) and len(derived) == n_layers:
            patterns.append(list(derived))
    index_lists = {k: list(v) for k, v in fields.items() if k in INDEX_LISTS and isinstance(v, (list, tuple))}
    firsts = [next(i for i, item in enumerate(p) if repr(item) == repr(value)) for p in patterns for value in p]
    prefix = min(n_layers, max([MIN_DEFAULT_PATTERN_LAYERS - 1, *firsts]) + 1)
    kwargs[layer_name] = prefix
    for k, v in fields.items():
        if isinstance(v, (list, tuple)) and len(v) == n_layers and k not in INDEX_LISTS:
            size_key = next((n for n in (k, re.sub(r"_per_layer$", "", k)) if _is_number(SIZES.get(n))), None)
            sized = size_key and all(_is_number(x) for x in v)  # e.g. per-layer intermediate sizes / head counts
            kwargs[k] = [SIZES[size_key]] * prefix if sized else list(v[:prefix])
    for k, v in index_lists.items():
        kwargs[k] = [i for i in v if isinstance(i, int) and i < prefix]
    for name in ("moe_layer_end_index", "max_window_layers"):
        if _is_number(fields.get(name)):
            kwargs[name] = min(fields[name], prefix - (name == "moe_layer_end_index"))


def _small_vocabulary(fields: dict, kwargs: dict, vocab_size: int, pad_token_id: int, eos_token_id: int) -> None:
    """Step 4 of :func:`tiny_causal_lm_config`: the vocabulary size, special tokens inside it, an untied LM head."""
    for name in ("vocab_size", "decoder_vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input"):
        if _is_number(fields.get(name)):
            kwargs[name] = vocab_size
    kwargs.update(pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    for name, value in fields.items():
        if name in kwargs or value is None:
            continue
        if re.search(r"_token_(id|index)$", name) or name in ("mask_index", "unk_index", "lang_id"):
            if _is_number(value) and value >= vocab_size:
                kwargs[name] = eos_token_id if ("eos" in name or "start" in name or "eod" in name) else 2
    if "is_decoder" in fields:
        kwargs["is_decoder"] = True
    if "tie_word_embeddings" in fields:
        kwargs["tie_word_embeddings"] = False


def _instantiate(config_class, kwargs: dict):
    """``config_class(**kwargs)``; when that fails with an untied LM head asked for, once more without asking (the
    first error is raised if that fails too)."""
    try:
        return config_class(**kwargs)
    except Exception as first:
        if kwargs.get("tie_word_embeddings") is not False:
            raise
        kwargs.pop("tie_word_embeddings")
        try:
            return config_class(**kwargs)
        except Exception:
            raise first from None


def _count_params_meta(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_tiny_causal_lm_of_type(
    model_type: str, *, seed: int = 0, attn_implementation: str | None = None, **config_kwargs
):
    """Build the tiny random-weight float32 model of `model_type` (config_kwargs go to tiny_causal_lm_config;
    `attn_implementation`: transformers' choice when None)."""
    config = tiny_causal_lm_config(model_type, **config_kwargs)
    n = _count_params_meta(config)
    if n > MAX_PARAMS:
        raise ValueError(f"tiny {model_type} would have {n:,} parameters (> {MAX_PARAMS:,})")
    torch.manual_seed(seed)
    attention = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention)
    fixup = MODEL_FIXUPS.get(model_type)
    if fixup is not None:
        fixup(model)
    return model


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal LM (multimodal ones included: they raise when built)."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def save_tiny_families(tmp_path_factory, families) -> dict[str, str]:
    """Each of ``families``' tiny model (:func:`build_tiny_causal_lm_of_type` over the test alphabet's character
    tokenizer: pad 0, eos 1) saved with the tokenizer in a fresh folder of ``tmp_path_factory``: ``{family: path}``."""
    from hf_dynbsz.testing.fixtures import TEST_ALPHABET, build_char_tokenizer

    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    paths = {}
    for family in families:
        model = build_tiny_causal_lm_of_type(family, vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[family] = str(path)
    return paths
