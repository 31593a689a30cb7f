"""What the plugin can run exactly for one model: decided here, once, from the model itself.

Every decision that depends on the model is taken by :meth:`ModelSupport.of`: which layouts can keep each sample's
log-probs equal to the sample computed alone (padding-free rows, shared prompts, padded rows with or without an
attention mask), whether segment attention (:mod:`hf_dynbsz.execution.attention`) can run the model, which position ids
a sample needs, how image inputs train, and the FLOPs model the partitioner balances. It reads the config (and, in
training, the model: its attention modules, embeddings and layer classes) by attribute and never raises: what it
does not understand turns the feature off, with one reason each. The layouts it allows are tried at start by the
self-check (:mod:`hf_dynbsz.execution.self_check`), fastest first; a layout whose log-probs differ from the per-sample
reference is left for the next.

Pure Python: no torch import (the planner reads a config on any machine).
"""

from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass, replace
from typing import Any

from hf_dynbsz.planning.cost import GENERIC_DECODER, ModelFlops, config_value, text_config_of
from hf_dynbsz.planning.settings import SharePrefix

__all__ = [
    "DeviceFacts",
    "Layout",
    "router_aux_loss_coef",
    "ModelSupport",
    "REPACKED_VISION_MODEL_TYPES",
    "VARLEN_ATTENTION_PREFIXES",
    "VARLEN_ATTN",
    "base_model",
    "images_stay_on_their_process",
    "long_rope_modules",
    "rope_width",
    "vision_language_mode",
]

#: Attention implementations whose kernels treat a padding-free row as separate sequences (varlen kernels).
VARLEN_ATTENTION_PREFIXES = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")

#: Layer types that see other tokens only through attention (or not at all): a padding-free row keeps its
#: sequences apart in them. Any other type (linear attention, Mamba, short convolutions, indexer attention, ...) may
#: carry state along the row, from one sequence into the next.
MASK_RESPECTING_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe", "dense", "sparse"}
)

#: Config keys of per-layer kinds (``layer_types`` and the names hybrid models give them).
LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types", "attn_type_list")

#: Class names of modules that carry state from one token to the next outside attention (recurrences,
#: state-space mixers, convolutions over the sequence): a padding-free row would carry it across sequences.
STATEFUL_MODULE = re.compile(
    r"Mamba|Mixer|SSM|Ssm|RWKV|Rwkv|LSTM|Lstm|Recurrent|RgLru|RGLRU|GatedDeltaNet|"
    r"LinearAttention|ShortConv|Lightning|Retention|^Conv1d$"
)

#: Class names of *sequence mixers*: the module of a layer that carries state along a sequence, taken whole. Segment
#: recurrence (:mod:`hf_dynbsz.execution.recurrence`) runs each per sequence of a padding-free row: Mamba / Mamba-2
#: mixers, Gated DeltaNet, delta and lightning attention, short convolutions, RecurrentGemma's recurrent block.
SEQUENCE_MIXER = re.compile(
    r"(Mixer|GatedDeltaNet|DeltaAttention|LightningAttention|ShortConv|ShortConvolution|RecurrentBlock)$"
)

#: Class names of modules that hold layers or work per token (a decoder layer, a model, a norm, an MLP, an
#: embedding): a name of :data:`STATEFUL_MODULE` on them ("MambaRMSNorm", "RecurrentGemmaDecoderLayer") is the
#: family's, not state carried along the sequence.
CONTAINER_OR_PER_TOKEN = re.compile(r"(DecoderLayer|Block|Layer|Model|ForCausalLM|Norm|NormGated|Mlp|MLP|Embedding)$")

#: Config layer kinds that carry state which segment recurrence can keep apart, when the model's modules show it
#: (the planner, reading a config without a model, takes them as segmentable; the trainer decides from the modules).
SEGMENTED_LAYER_KINDS = frozenset({"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "recurrent"})

#: Vision-language model types whose image steps are repacked, each sample's image inputs moving with it (tested
#: against stock TRL). Any other model with a ``vision_config`` runs its image steps with stock's micro-batches.
REPACKED_VISION_MODEL_TYPES = ("llava", "qwen2_5_vl", "qwen2_vl")

#: Repacked vision-language model types that position their tokens in three dimensions (M-RoPE: time, height,
#: width) with their own ``get_rope_index``: a padding-free row carries each sample's positions as that function
#: computes them for the sample alone (:func:`hf_dynbsz.execution.multimodal.rope_positions`). The other repacked types
#: position image tokens like text.
MULTIMODAL_ROPE_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")

#: Why a vision-language model outside :data:`REPACKED_VISION_MODEL_TYPES` trains in padded micro-batches only.
VISION_LANGUAGE_PADDED = (
    "a vision-language model computes its own (multimodal) position ids from the attention mask, "
    "which a padding-free row does not carry"
)

#: The base implementations segment attention runs per segment.
SEGMENT_ATTENTION_BASES = ("sdpa", "eager", "flex_attention")
#: The segment attention base of torch's own FlashAttention-2 varlen kernel (``torch.nn.attention.varlen.varlen_attn``):
#: one call per layer over a padding-free row, for models on sdpa or eager on CUDA (:meth:`ModelSupport.layouts`).
VARLEN_ATTN = "varlen_attn"
#: The first torch release with ``varlen_attn`` (and its backward).
VARLEN_ATTN_MIN_TORCH = (2, 10)
#: The oldest CUDA compute capability FlashAttention-2 runs on (Ampere).
VARLEN_ATTN_MIN_CAPABILITY = (8, 0)
#: The precisions ``varlen_attn`` computes in.
VARLEN_ATTN_DTYPES = ("bfloat16", "float16")
#: The bases segment attention runs as spans: a call per span shape and layer (a few padded calls on CUDA).
SPAN_FORMULATION_BASES = ("sdpa", "eager")
#: Why packing_layout "auto" trains padded rows on CUDA with sdpa or eager (benchmarks/results/gpu_check.md).
SPANS_ON_CUDA = (
    "on a GPU their segment attention made a kernel call per span shape and layer, and a step ran 6.4x slower "
    "than stock (H200, 0.5B model, bf16, long-tailed completions) where padded rows ran 1.1x faster; it now "
    "makes at most 4 padded calls per layer, not yet measured on a GPU; "
    "packing_layout='padding_free' gives them, and attn_implementation='flex_attention' (or "
    "flash-attention) gives padding-free rows in one call per layer"
)


#: The rotary embedding type whose frequencies transformers picks per forward by the forward's widest position
#: (``dynamic_rope_update``): the long factors once ``max(position_ids) + 1`` passes
#: ``original_max_position_embeddings``, the short ones below. Phi-3/3.5/4-mini long-context models use it.
LONG_ROPE = "longrope"


def rope_width(stock_width: int, originals: tuple[int, ...]) -> int:
    """The width a sample's LongRoPE factors are picked by, in tokens: the least width past the same
    ``original_max_position_embeddings`` of ``originals`` (every LongRoPE model of the run,
    :attr:`ModelSupport.long_rope`) as ``stock_width`` (the padded width of stock's micro-batch that holds the sample:
    each of stock's forwards runs positions ``0 .. width - 1``); 0 where it passes none (the short factors of every
    model). Samples of one rope width take the same factors in every model, so the prefix tree shares positions
    between them only (:meth:`~hf_dynbsz.execution.packing.SequenceTable.prefix_keys`)."""
    passed = [original for original in originals if stock_width > original]
    return max(passed) + 1 if passed else 0


def vision_language_mode(config: Any) -> str | None:
    """How the image steps of a model of this (top-level) config train: None for a text model, ``"repacked"`` for
    :data:`REPACKED_VISION_MODEL_TYPES` (any layout, image prompts shared, samples balanced across processes with
    their images), ``"stock"`` for other vision-language models (stock's fixed micro-batches, image inputs stay on
    their process; their text-only steps are repacked)."""
    if config is None or config_value(config, "vision_config") is None:
        return None
    return "repacked" if config_value(config, "model_type") in REPACKED_VISION_MODEL_TYPES else "stock"


def images_stay_on_their_process(vision_language: str | None) -> bool:
    """Whether cross-rank balancing is off for a model of this :func:`vision_language_mode`: a family whose image
    steps run stock's micro-batches keeps its samples (and their image inputs) on their process."""
    return vision_language == "stock"


def base_model(model: Any) -> Any:
    """The model under PEFT's wrapper (``get_base_model()``), or ``model`` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


@dataclass(frozen=True)
class Layout:
    """One way to lay a pass out: the rungs the self-check walks down, fastest first.

    ``name``: ``"padding_free"`` (the pass's samples in one row) or ``"padded"`` (a row per sample, right-padded to the
    pass's longest). ``sharing`` (:class:`~hf_dynbsz.planning.settings.SharePrefix`): what the samples of a
    padding-free row share through segment attention: each prompt in its group (``GROUPS``), every prefix the pass's
    samples have in common whatever their prompts (``TREE``, :mod:`hf_dynbsz.planning.prefix_tree`), or nothing
    (``NONE``). ``segment_attention``: the base implementation segment attention runs per
    segment, None for the model's own attention. ``segment_recurrence``: the model's sequence mixers run per sequence of
    the row (:mod:`hf_dynbsz.execution.recurrence`). ``attention_mask``: padded rows carry an attention mask (right
    padding would otherwise reach real tokens, or the model positions tokens from the mask). ``attention``: the cost the
    partitioner balances, ``"varlen"`` (each sequence attends to itself) or ``"dense"`` (a row or padded batch costs its
    square).
    """

    name: str
    sharing: SharePrefix = SharePrefix.NONE
    segment_attention: str | None = None
    attention_mask: bool = False
    attention: str = "dense"
    segment_recurrence: bool = False

    def describe(self) -> str:
        """One phrase for logs and the plan table, e.g. "padding_free, shared prompts, segment attention (sdpa)"."""
        parts = [self.name]
        if self.sharing:
            parts.append("prefix tree" if self.sharing is SharePrefix.TREE else "shared prompts")
        if self.segment_attention:
            parts.append(f"segment attention ({self.segment_attention})")
        if self.segment_recurrence:
            parts.append("segment recurrence")
        if self.attention_mask:
            parts.append("attention mask")
        return ", ".join(parts)


@dataclass(frozen=True)
class DeviceFacts:
    """Where a run trains, as the decisions of this module need it; read by the torch layer
    (:func:`hf_dynbsz.execution.attention.device_facts`), given here as plain values (no torch in ``planning``).

    ``type``: "cuda", "cpu", ...; ``capability``: the CUDA compute capability ``(major, minor)`` (None elsewhere);
    ``torch_version``: ``(major, minor)`` of the installed torch; ``varlen_attn``: whether
    ``torch.nn.attention.varlen.varlen_attn`` is importable; ``varlen_window``: whether it takes ``window_size``
    (torch 2.11 and newer: sliding windows); ``compute_dtype``: what the forwards compute in ("bfloat16" under bf16
    mixed precision, else the weights' dtype name).
    """

    type: str = "cpu"
    capability: tuple[int, int] | None = None
    torch_version: tuple[int, int] | None = None
    varlen_attn: bool = False
    varlen_window: bool = False
    compute_dtype: str = "float32"

    @classmethod
    def of(cls, device: DeviceFacts | str) -> DeviceFacts:
        """``device`` itself, or facts of a device known only by its type (nothing else known of it)."""
        return device if isinstance(device, DeviceFacts) else cls(type=device)


@dataclass(frozen=True)
class ModelSupport:
    """What the plugin can run exactly for one model; build it with :meth:`of`.

    Each ``*_blocker`` is None when the feature can run, else why not (one line, logged once):

    * ``padding_free_blocker``: a padding-free row would mix its sequences (layers that carry state along the row
      outside the :data:`SEQUENCE_MIXER` modules segment recurrence runs per sequence, a vision-language model
      outside :data:`REPACKED_VISION_MODEL_TYPES` positioning its own tokens);
    * ``segment_attention_blocker``: segment attention cannot run the model (attention not dispatched through
      transformers' ``AttentionInterface``, a base implementation it does not wrap, bidirectional attention, ...);
    * ``unmasked_padding_blocker``: right padding without an attention mask can reach real tokens (bidirectional
      attention), or the model positions tokens from the mask;
    * ``repacking_blocker``: no layout can be exact, stock math runs (a sample's log-probs depend on the row it is
      padded to, in stock's own forward too);
    * ``router_aux_blocker``: the MoE router aux loss (when TRL trains one) cannot be repacked;
      ``router_aux`` is ``(experts, experts per token)`` when it can (:mod:`hf_dynbsz.execution.router_loss`);
    * ``varlen_attn_blocker``: torch's ``varlen_attn`` cannot compute the model's attention exactly as its own
      function does (soft-capping, attention sinks, value heads of another size than query heads, attention
      dropout); the device's side is :meth:`varlen_attn_reason`'s. ``sliding_windows``: some layer attends within
      a sliding window (``varlen_attn`` needs ``window_size`` for it).

    ``long_rope``: the ``original_max_position_embeddings`` of the model's LongRoPE rotary embeddings
    (:data:`LONG_ROPE`; empty: none). Stock's forward picks their factors by its padded width, so every pass gives each
    sample the factors of stock's micro-batch that holds it (:func:`rope_width`, :mod:`hf_dynbsz.execution.rope`). A
    rotary embedding that rescales with the forwards seen so far (dynamic NTK), or a LongRoPE one the plugin cannot give
    per-sample factors, is a ``repacking_blocker``.

    ``position_offset`` is added to every position id (RoBERTa-style models number positions from
    ``padding_idx + 1``). ``multimodal_rope``: padding-free rows carry each sample's M-RoPE positions
    (:data:`MULTIMODAL_ROPE_MODEL_TYPES`). ``model_flops``: the FLOPs read off the config (None when it gives none:
    :attr:`flops` is then a generic decoder's, see ``notes``). ``attn_implementation`` is the model's own attention
    implementation. ``sequence_mixers``: the class names of the modules segment recurrence runs per sequence in
    padding-free rows (empty: none; the planner without a model gives the config's layer kinds instead).
    """

    model_type: str | None = None
    attn_implementation: str | None = None
    vision_language: str | None = None
    padding_free_blocker: str | None = None
    segment_attention_blocker: str | None = None
    unmasked_padding_blocker: str | None = None
    repacking_blocker: str | None = None
    router_aux: tuple[int, int] | None = None
    router_aux_blocker: str | None = None
    varlen_attn_blocker: str | None = None
    sliding_windows: bool = False
    position_offset: int = 0
    multimodal_rope: bool = False
    long_rope: tuple[int, ...] = ()
    sequence_mixers: tuple[str, ...] = ()
    model_flops: ModelFlops | None = None
    notes: tuple[str, ...] = ()

    @property
    def flops(self) -> ModelFlops:
        """The cost model: the FLOPs read off this model's config, else a generic 7B-class decoder's."""
        return self.model_flops or ModelFlops.from_model_config(GENERIC_DECODER)

    # ------------------------------------------------------------------ reading a model
    @classmethod
    def of(cls, config: Any = None, model: Any = None, attn_implementation: str | None = None) -> ModelSupport:
        """What runs for ``model`` (training) or for a model of ``config`` (the planner). Never raises.

        ``config`` defaults to ``model.config``; None (the planner without ``--model_config``) is a standard
        decoder with the generic cost model. ``attn_implementation`` defaults to the text config's.
        """
        if config is None and model is not None:
            config = config_value(model, "config")
        text = text_config_of(config)
        if attn_implementation is None and text is not None:
            attn_implementation = config_value(text, "_attn_implementation")
        vision = vision_language_mode(config)
        flops, notes = _flops(text)
        support = cls(
            model_type=config_value(config, "model_type"),
            attn_implementation=attn_implementation,
            vision_language=vision,
            model_flops=flops,
            notes=notes,
        )
        decoder = _language_model(model) if vision else model  # what a padding-free row runs through
        state, mixers = _state_carrying_layers(text, decoder)
        padding_free = VISION_LANGUAGE_PADDED if vision == "stock" else state
        attention_free = bool(mixers) and model is not None and not _self_attention_modules(decoder)
        if padding_free is None and model is not None and not attention_free and not _takes_position_ids(model):
            padding_free = "its forward takes no position ids, so positions would run on along a padding-free row"
        segment = None if attention_free else _segment_attention_blocker(config, text, decoder, attn_implementation)
        unmasked = "image inputs are positioned from the attention mask" if vision else None
        bidirectional = _bidirectional(text, decoder)
        if bidirectional:
            segment = segment or bidirectional
            unmasked = bidirectional
        router_aux, router_blocker = _router_aux_form(text, model)
        multimodal_rope = vision == "repacked" and config_value(config, "model_type") in MULTIMODAL_ROPE_MODEL_TYPES
        long_rope, rope_blocker = _long_rope(text, decoder, multimodal_rope)
        return replace(
            support,
            padding_free_blocker=padding_free,
            segment_attention_blocker=segment,
            unmasked_padding_blocker=unmasked,
            repacking_blocker=_content_selected_keys(text) or rope_blocker,
            router_aux=router_aux,
            router_aux_blocker=router_blocker,
            varlen_attn_blocker=_varlen_attn_blocker(text, decoder),
            sliding_windows=_sliding_windows(text),
            position_offset=_position_offset(model),
            sequence_mixers=mixers if padding_free is None else (),
            multimodal_rope=multimodal_rope,
            long_rope=long_rope,
        )

    # ------------------------------------------------------------------ what a run uses
    def layouts(
        self,
        packing_layout: str = "auto",
        share_prompt_prefix: bool | str | SharePrefix = True,
        device_type: str | DeviceFacts = "cpu",
    ) -> tuple[list[Layout], list[str]]:
        """The layouts a run may use, fastest first, and one note per feature asked for but not available.

        ``device_type``: where the run trains, a type ("cuda", "cpu") or the :class:`DeviceFacts` of the device. On
        CUDA, models on sdpa or eager run their padding-free rows through torch's ``varlen_attn`` (one call per
        layer, :data:`VARLEN_ATTN`) wherever :meth:`varlen_attn_reason` allows it (a type alone says too little:
        it does not). Where it does not, "auto" leaves out the padding-free rows of segment attention's span
        formulation, which ran a step 6.4x slower than stock with a call per span shape and layer, where padded
        rows ran it 1.1x faster (:data:`SPANS_ON_CUDA`), with the reason as a note. flash-attention and
        flex_attention keep their padding-free rows (one call per layer).

        ``packing_layout`` "auto" starts from padding-free rows where each sequence can attend to itself alone
        (segment attention, or a flash-attention varlen kernel) and goes down to padded rows; "padding_free"
        allows only padding-free rows and "padded" only padded ones (an error when the model rules them all out).
        The first layout is what training starts with; the self-check steps down the list when a layout's
        log-probs differ from each sample's own. The last rung is available to "auto" and "padded": padded rows
        with an attention mask (stock's own layout, per sample). Empty (with the reason as the note) when no
        layout can be exact: stock math runs.

        ``share_prompt_prefix`` (a checked value, :meth:`~hf_dynbsz.planning.settings.SharePrefix.of`): with the tree
        the padding-free rungs are a prefix tree's, then prompt groups', then no sharing; with groups the last two;
        with none the last. Every family whose rows share prompts takes the tree: what a node computes is what the
        samples under it compute alone wherever a shared prompt's block does (the self-check steps down to groups
        for a model that says otherwise).
        """
        if packing_layout not in ("auto", "padding_free", "padded"):
            raise ValueError(f"packing_layout must be one of 'auto', 'padding_free', 'padded', got {packing_layout!r}.")
        sharing = SharePrefix.of(share_prompt_prefix)
        if self.repacking_blocker:
            return [], [f"dynamic batching is off, stock TRL math runs: {self.repacking_blocker}"]
        notes = []
        varlen = bool(self.attn_implementation) and self.attn_implementation.startswith(VARLEN_ATTENTION_PREFIXES)
        base, note = self._segment_base(packing_layout, DeviceFacts.of(device_type))
        if note and packing_layout != "padded" and self.padding_free_blocker is None:
            notes.append(note)
        ladder: list[Layout] = []
        if packing_layout != "padded" and self.padding_free_blocker is None:
            recurrence = bool(self.sequence_mixers)
            if base is not None:
                rules = [SharePrefix.TREE, SharePrefix.GROUPS, SharePrefix.NONE]  # the asked rule, then the ones below
                for rule in rules[rules.index(sharing) :]:
                    ladder.append(Layout("padding_free", rule, base, attention="varlen", segment_recurrence=recurrence))
            elif varlen:
                ladder.append(Layout("padding_free", attention="varlen"))
            elif packing_layout == "padding_free":  # transformers' own block mask over the row: dense, but asked for
                ladder.append(Layout("padding_free", attention="dense"))
        if packing_layout == "padding_free" and not ladder:
            raise ValueError(
                f"packing_layout='padding_free' cannot train this model exactly: "
                f"{self.padding_free_blocker}. Use packing_layout='auto' (padded for this model) or "
                "'padded'."
            )
        if packing_layout != "padding_free":
            if self.unmasked_padding_blocker is None:
                ladder.append(Layout("padded"))
            ladder.append(Layout("padded", attention_mask=True))
        if sharing and not ladder[0].sharing:
            why = (
                self.padding_free_blocker
                if packing_layout != "padded" and self.padding_free_blocker
                else self.segment_attention_blocker
                if packing_layout != "padded"
                else "packing_layout='padded'"
            )
            notes.append(f"share_prompt_prefix is not applied: {why or 'packing_layout resolves to padded rows'}")
        return ladder, notes

    def _segment_base(self, packing_layout: str, device: DeviceFacts) -> tuple[str | None, str | None]:
        """``(base, note)``: the base segment attention runs padding-free rows with on ``device`` (None: none), and
        why a span base (sdpa, eager) does not run as itself on CUDA (None: nothing to say).

        On CUDA sdpa and eager take torch's ``varlen_attn`` (:data:`VARLEN_ATTN`: one call per layer) wherever
        :meth:`varlen_attn_reason` finds nothing against it; otherwise "auto" trains padded rows
        (:data:`SPANS_ON_CUDA`) and "padding_free" the span formulation, each with the reason."""
        if self.segment_attention_blocker:
            return None, None
        base = self.attn_implementation or "eager"
        if base not in SPAN_FORMULATION_BASES or device.type != "cuda":
            return base, None
        why = self.varlen_attn_reason(device)
        if why is None:
            return VARLEN_ATTN, None
        if packing_layout == "padding_free":
            return base, f"padding-free rows run {base}'s span formulation, not torch's varlen_attn: {why}"
        return None, f"padding-free rows are not used on {base}: varlen_attn cannot run them ({why}); {SPANS_ON_CUDA}"

    def varlen_attn_reason(self, device: DeviceFacts | str) -> str | None:
        """Why torch's ``varlen_attn`` cannot compute this model's attention on ``device`` exactly as the model's own
        function does (one line), or None when it can. The first of: not CUDA, the model's own features
        (``varlen_attn_blocker``), torch without ``varlen_attn`` (below 2.10), a GPU below sm80, fp32 forwards,
        sliding windows on a torch whose ``varlen_attn`` takes no ``window_size``."""
        device = DeviceFacts.of(device)
        if device.type != "cuda":
            return f"it runs on CUDA only, this run trains on {device.type}"
        if self.varlen_attn_blocker:
            return self.varlen_attn_blocker
        if not device.varlen_attn:
            version = ".".join(map(str, device.torch_version)) if device.torch_version else "unknown"
            return f"torch {version} has no torch.nn.attention.varlen.varlen_attn (it arrived in torch 2.10)"
        if device.capability is None or tuple(device.capability) < VARLEN_ATTN_MIN_CAPABILITY:
            found = "unknown" if device.capability is None else "sm{}{}".format(*device.capability)
            return f"the GPU's compute capability ({found}) is below sm80, FlashAttention-2's least"
        if device.compute_dtype not in VARLEN_ATTN_DTYPES:
            return (
                f"the forwards compute in {device.compute_dtype} and varlen_attn computes in bf16 or fp16 only "
                "(bf16=True trains in bf16 mixed precision)"
            )
        if self.sliding_windows and not device.varlen_window:
            return "the model has sliding-window layers and this torch's varlen_attn takes no window_size (torch 2.11)"
        return None

    def router_aux_mode(self, coef: float) -> str | None:
        """The plan table's ``router aux loss`` row: None without one (``coef`` 0), "repacked", or why not."""
        if not coef:
            return None
        return "repacked" if self.router_aux is not None else self.router_aux_blocker

    def describe(self) -> list[str]:
        """One line per limit of this model (for logs and ``hf-dynbsz plan``)."""
        lines = []
        for label, reason in (
            ("repacking", self.repacking_blocker),
            ("padding-free rows", self.padding_free_blocker),
            ("segment attention", self.segment_attention_blocker),
            ("padded rows without a mask", self.unmasked_padding_blocker),
        ):
            if reason:
                lines.append(f"{label}: off ({reason})")
        if self.position_offset:
            lines.append(f"position ids start at {self.position_offset} (the model numbers them from padding_idx + 1)")
        if self.long_rope and not self.repacking_blocker:
            lines.append(
                f"LongRoPE (original_max_position_embeddings {', '.join(map(str, self.long_rope))}): each sample takes "
                "the rotary factors of the stock micro-batch that holds it"
            )
        return lines + list(self.notes)


# ---------------------------------------------------------------------- what is read, and how
def _flops(text_config: Any) -> tuple[ModelFlops | None, tuple[str, ...]]:
    """The FLOPs of the text config, or None with a note: a cost estimate never stops a run."""
    if text_config is None:
        return None, ()
    readable = types.SimpleNamespace(
        **{
            name: config_value(text_config, name)
            for name in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "head_dim",
                "num_key_value_heads",
                "intermediate_size",
                "hidden_act",
                "hidden_activation",
                "vocab_size",
            )
        }
    )
    if not isinstance(readable.intermediate_size, int):  # per-layer lists (Gemma-3n)
        readable.intermediate_size = None
    nope, rope = config_value(text_config, "qk_nope_head_dim"), config_value(text_config, "qk_rope_head_dim")
    if isinstance(nope, int) and isinstance(rope, int):  # multi-head latent attention: query/key heads of nope + rope
        readable.head_dim = nope + rope
    try:
        return ModelFlops.from_model_config(readable), ()
    except (ValueError, TypeError) as error:
        return None, (f"cost model: a generic 7B-class decoder's ({error})",)


def _layer_kinds(text_config: Any) -> set[str]:
    kinds: set[str] = set()
    for key in LAYER_KIND_KEYS:
        values = config_value(text_config, key)
        if isinstance(values, (list, tuple)):
            kinds |= {str(value) for value in values}
    return kinds


def _state_carrying_layers(text_config: Any, model: Any) -> tuple[str | None, tuple[str, ...]]:
    """``(why a padding-free row would carry state from one sequence into the next, or None; the sequence mixers
    segment recurrence runs per sequence)``.

    With a model: every module that carries state (:data:`STATEFUL_MODULE`, less :data:`CONTAINER_OR_PER_TOKEN`)
    must be a :data:`SEQUENCE_MIXER` or inside one; the mixers' class names are returned. Without one (the
    planner): the config's layer kinds, segmentable when all are in :data:`SEGMENTED_LAYER_KINDS`.
    """
    carrying = sorted(_layer_kinds(text_config) - MASK_RESPECTING_LAYER_TYPES)
    why = _carries_state(f"{', '.join(carrying)} layers")
    if model is None or not callable(getattr(model, "named_modules", None)):
        if carrying and not set(carrying) <= SEGMENTED_LAYER_KINDS:
            return why, ()
        return None, tuple(carrying)
    mixers = [(name, module) for name, module in model.named_modules() if SEQUENCE_MIXER.search(type(module).__name__)]
    attention = {id(module) for module in _self_attention_modules(model)}

    loose = next(
        (
            type(module).__name__
            for name, module in model.named_modules()
            if STATEFUL_MODULE.search(type(module).__name__)
            and not CONTAINER_OR_PER_TOKEN.search(type(module).__name__)
            and id(module) not in attention
            and not any(name == mixer or name.startswith(mixer + ".") for mixer, _ in mixers)
        ),
        None,
    )
    if loose:
        return _carries_state(f"{loose} modules"), ()
    if carrying and not mixers:
        return why, ()
    return None, tuple(sorted({type(module).__name__ for _, module in mixers}))


def _carries_state(what: str) -> str:
    """Why a padding-free row would mix sequences through ``what`` (e.g. "linear_attention layers")."""
    return (
        f"its {what} carry state along a row, from one sequence into the next, which the attention of a "
        "padding-free row does not stop"
    )


def _content_selected_keys(text_config: Any) -> str | None:
    """Why a sample's log-probs depend on the row it is padded to (indexed sparse attention), or None."""
    if "indexed_attention" in _layer_kinds(text_config):
        return (
            "its indexed sparse attention picks keys over the whole padded row, so a sample's log-probs depend on "
            "the width it is padded to (in stock's forward too)"
        )
    return None


def _rope_parameters(text_config: Any) -> list[dict]:
    """The rotary parameters of ``text_config``: ``rope_parameters`` (one dict, or one per layer type), else the
    older ``rope_scaling``; empty where it has none."""
    parameters = config_value(text_config, "rope_parameters")
    if not isinstance(parameters, dict):
        parameters = config_value(text_config, "rope_scaling")
    if not isinstance(parameters, dict):
        return []
    if "rope_type" in parameters or "type" in parameters:
        return [parameters]
    return [value for value in parameters.values() if isinstance(value, dict)]


def _rope_type(parameters: dict) -> str:
    return str(parameters.get("rope_type", parameters.get("type", "default")))


#: Why a model whose rotary embedding rescales by the forwards seen so far (transformers' dynamic NTK) trains stock's
#: math ({kind}: its rope type).
DYNAMIC_ROPE = (
    "its rotary embedding is dynamic NTK (rope_type={kind!r}): transformers rescales the frequencies by the longest "
    "forward the model has run so far (generation's included) and keeps that state across forwards, so a sample's "
    "log-probs depend on the widths and order of every earlier forward, which repacked passes change"
)


def _long_rope(text_config: Any, model: Any, multimodal_rope: bool) -> tuple[tuple[int, ...], str | None]:
    """``(the original_max_position_embeddings of the LongRoPE rotary embeddings, why no layout can be exact)``.

    Dynamic NTK (a rope type containing "dynamic", as transformers tests it) is a blocker (:data:`DYNAMIC_ROPE`).
    LongRoPE is one where positions come from the model's own M-RoPE index (computed from the attention mask, not the
    padded width), or where the model's LongRoPE modules are not transformers' ``dynamic_rope_update`` (the plugin
    gives each sample its factors through it: :mod:`hf_dynbsz.execution.rope`)."""
    kinds = [_rope_type(parameters) for parameters in _rope_parameters(text_config)]
    dynamic = next((kind for kind in kinds if "dynamic" in kind), None)
    if dynamic:
        return (), DYNAMIC_ROPE.format(kind=dynamic)
    originals = []
    for parameters in _rope_parameters(text_config):
        if _rope_type(parameters) == LONG_ROPE:
            original = parameters.get("original_max_position_embeddings")
            original = original or config_value(text_config, "original_max_position_embeddings")
            originals.append(original or config_value(text_config, "max_position_embeddings"))
    if not originals:
        return (), None
    if not all(isinstance(original, int) for original in originals):
        return (), f"its LongRoPE rotary embedding names no original_max_position_embeddings ({originals})"
    if multimodal_rope:
        return (), (
            "its LongRoPE factors are picked from the M-RoPE positions the model computes from the attention mask, "
            "not from the padded width the plugin gives each sample"
        )
    if model is not None and callable(getattr(model, "named_modules", None)) and not long_rope_modules(model):
        return (), (
            "its config asks for LongRoPE, but no rotary module picks its factors through transformers' "
            "dynamic_rope_update, where the plugin gives each sample the factors of stock's micro-batch"
        )
    return tuple(sorted(set(originals))), None


def long_rope_modules(model: Any) -> list:
    """The modules of ``model`` whose rotary frequencies transformers' ``dynamic_rope_update`` picks as LongRoPE:
    a ``rope_type`` of :data:`LONG_ROPE` (or one per layer type that holds it) and a ``forward`` that wraps the plain
    one (``__wrapped__``, where the plugin computes each set of factors)."""
    found = []
    for _, module in model.named_modules():
        kind = getattr(module, "rope_type", None)
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        if LONG_ROPE in kinds and callable(getattr(type(module).forward, "__wrapped__", None)):
            found.append(module)
    return found


def _self_attention_modules(model: Any) -> list:
    """The model's self-attention modules (cross-attention of encoder-decoder decoders left out: it sees no tokens
    of the row when the model runs as a causal LM)."""
    if model is None or not callable(getattr(model, "named_modules", None)):
        return []
    return [
        module
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
        and hasattr(module, "is_causal")
        and not SEQUENCE_MIXER.search(type(module).__name__)  # delta / lightning attention: recurrences
        and not re.search(r"cross|encoder_attn", name, re.IGNORECASE)
    ]


def _bidirectional(text_config: Any, model: Any) -> str | None:
    """Why attention looks both ways (right padding then reaches real tokens), or None."""
    if config_value(text_config, "is_decoder") is False and config_value(text_config, "model_type") in ("xlnet",):
        return "its attention looks in both directions"
    if any(module.is_causal is False for module in _self_attention_modules(model)):
        return "its attention looks in both directions (is_causal=False)"
    if (
        config_value(text_config, "attn_type") == "bi"
        or config_value(text_config, "use_bidirectional_attention") is True
    ):
        return "its attention looks in both directions"
    return None


def _varlen_attn_blocker(text_config: Any, model: Any) -> str | None:
    """Why torch's ``varlen_attn`` cannot compute this model's attention as its own function does, whatever the
    device (one line), or None: scores soft-capped, attention sinks, value heads of another size than query and key
    heads (multi-head latent attention), attention dropout (``varlen_attn`` has none)."""
    softcap = config_value(text_config, "attn_logit_softcapping")
    if softcap is not None:
        return f"its attention scores are soft-capped (attn_logit_softcapping={softcap})"
    if config_value(text_config, "model_type") == "gpt_oss" or any(
        getattr(module, "sinks", None) is not None for module in _self_attention_modules(model)
    ):
        return "its attention has sinks"
    value_dim = config_value(text_config, "v_head_dim")
    nope, rope = config_value(text_config, "qk_nope_head_dim"), config_value(text_config, "qk_rope_head_dim")
    query_dim = config_value(text_config, "head_dim")
    if isinstance(nope, int) and isinstance(rope, int):
        query_dim = nope + rope
    if isinstance(value_dim, int) and isinstance(query_dim, int) and value_dim != query_dim:
        return f"its value heads ({value_dim}) differ in size from its query and key heads ({query_dim})"
    dropout = config_value(text_config, "attention_dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        return f"its attention drops out (attention_dropout={dropout})"
    return None


def _sliding_windows(text_config: Any) -> bool:
    """Whether some layer attends within a sliding window (``sliding_attention`` layers, or a ``sliding_window`` the
    config does not turn off with ``use_sliding_window=False``)."""
    if "sliding_attention" in _layer_kinds(text_config):
        return True
    window = config_value(text_config, "sliding_window")
    return isinstance(window, int) and config_value(text_config, "use_sliding_window") is not False


def _segment_attention_blocker(
    config: Any, text_config: Any, model: Any, attn_implementation: str | None
) -> str | None:
    """Why segment attention cannot run this model, or None."""
    base = attn_implementation or "eager"
    if not (base in SEGMENT_ATTENTION_BASES or base.startswith(VARLEN_ATTENTION_PREFIXES)):
        return f"attn_implementation={base!r} (segment attention wraps sdpa, eager, flex_attention and flash-attention)"
    if vision_language_mode(config) == "stock":
        return "multimodal models compute position ids of their own"
    if model is not None and not _dispatches_through_interface(model):
        return f"{type(model).__name__} does not dispatch its attention through transformers' AttentionInterface"
    if "chunked_attention" in _layer_kinds(text_config):
        return "chunked attention layers (their chunks are drawn by the model's own mask)"
    return _window_in_mask_only(text_config, model)


#: transformers' mask of a sliding window: a model whose forward builds it applies its config's window.
MASK_WINDOW = "create_sliding_window_causal_mask"


def _window_in_mask_only(text_config: Any, model: Any) -> str | None:
    """Why segment attention would attend past the model's sliding window, or None: the config has one
    (:func:`_sliding_windows`), the model applies it (a forward of one of its modules builds
    ``create_sliding_window_causal_mask``) and a self-attention module of ``model`` neither holds a ``sliding_window``
    attribute nor passes ``sliding_window`` to its attention function: its window reaches attention only through the
    mask (PhiMoE, Doge), and segment attention reads it from the attention call (:mod:`hf_dynbsz.execution.attention`).
    A model that never applies its config's window (Moshi) attends fully in stock's forward too. Without a model (the
    planner) nothing is known against it."""
    if not _sliding_windows(text_config) or model is None or not callable(getattr(model, "modules", None)):
        return None
    classes = {type(module) for module in model.modules()}
    if not any(MASK_WINDOW in _source(cls.forward) for cls in classes if cls.__module__.startswith("transformers")):
        return None
    dispatching = [  # attention modules segment attention runs (Doge's have no is_causal)
        module
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
        and "ALL_ATTENTION_FUNCTIONS" in _source(type(module).forward)
        and not re.search(r"cross|encoder_attn", name, re.IGNORECASE)
    ]
    for module in _self_attention_modules(model) + dispatching:
        if not hasattr(module, "sliding_window") and "sliding_window" not in _source(type(module).forward):
            window = config_value(text_config, "sliding_window")
            return (
                f"its sliding window (sliding_window={window}) reaches attention only through the mask the model "
                f"builds (create_sliding_window_causal_mask): {type(module).__name__} neither holds nor passes it, "
                "and segment attention draws no model mask"
            )
    return None


def _source(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _dispatches_through_interface(model: Any) -> bool:
    """Whether every self-attention layer of ``model`` calls the implementation its config names through
    transformers' ``ALL_ATTENTION_FUNCTIONS`` (models that declare it, and those whose attention code does)."""
    if config_value(model, "_supports_attention_backend", False):
        return True
    modules = _self_attention_modules(model)
    return bool(modules) and all("ALL_ATTENTION_FUNCTIONS" in _source(type(module).forward) for module in modules)


def _language_model(model: Any) -> Any:
    """The text decoder of a vision-language ``model`` (``get_decoder()``): what attention, state and causality are
    read from (the vision tower attends both ways and never sees a packed row). ``model`` itself when unreadable."""
    try:
        return model.get_decoder() if model is not None else None
    except Exception:  # noqa: BLE001 - a model without one is read whole
        return model


def _takes_position_ids(model: Any) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (a padding-free row needs them restarting per sequence)."""
    forward = getattr(model, "forward", None)
    try:
        return "position_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def router_aux_loss_coef(config: Any, configured: float | None = None) -> float:
    """The MoE router aux loss coefficient TRL 1.16 trains a model of ``config`` with: ``configured``
    (``GRPOConfig.router_aux_loss_coef``), else the text config's own; 0 when the config has no
    ``output_router_logits`` (TRL then trains none)."""
    text = text_config_of(config)
    if text is None or not hasattr(text, "output_router_logits"):
        return 0.0
    return float(config_value(text, "router_aux_loss_coef", 0.0) if configured is None else configured)


def _router_aux_form(text_config: Any, model: Any) -> tuple[tuple[int, int] | None, str | None]:
    """``((experts, experts per token), None)``: the numbers TRL's fused LM head gives transformers' standard
    load-balancing loss (Mixtral's ``load_balancing_loss_func``, whatever the model's own forward computes), which
    :mod:`hf_dynbsz.execution.router_loss` repacks; ``(None, why not)`` when they cannot be read (stock fails then
    too)."""
    experts, top_k = config_value(text_config, "num_experts"), config_value(text_config, "num_experts_per_tok")
    if config_value(text_config, "model_type") == "gpt_oss" and model is not None:  # TRL reads the model's on gpt_oss
        experts = config_value(model, "num_experts", experts)
    if isinstance(experts, int) and isinstance(top_k, int):
        return (experts, top_k), None
    return None, (
        "TRL's router aux loss reads num_experts and num_experts_per_tok from the config, which gives "
        f"{experts!r} and {top_k!r}"
    )


def _position_offset(model: Any) -> int:
    """The first position id of a sequence: ``padding_idx + 1`` for models that number positions from the padding
    index when given none (RoBERTa and its kin), else 0."""
    if model is None or not callable(getattr(model, "modules", None)):
        return 0
    for module in model.modules():
        if callable(getattr(module, "create_position_ids_from_input_ids", None)):
            padding_idx = getattr(module, "padding_idx", None)
            if isinstance(padding_idx, int):
                return padding_idx + 1
    return 0
