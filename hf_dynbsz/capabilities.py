"""What the plugin does for one run, decided at start from the config and the model (torch layer).

Every feature either runs exactly or does not run, with a reason the trainer logs once: dynamic batching itself
(stock's math for what cannot be repacked), the layout and segment attention (:mod:`hf_dynbsz.attention`), shared
prompts, and the generation chunk size. The scheduling decisions proper live in :mod:`hf_dynbsz.schedule`; this module
only gathers what the model and the config allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .attention import segment_attention_unsupported
from .schedule import RankGroup, Scheduler

__all__ = ["Capabilities"]


@dataclass
class Capabilities:
    """The run's features: ``enabled`` (dynamic batching; False: stock math), the :class:`Scheduler`, ``attention``
    (the base attention implementation when padding-free rows run through segment attention, else None) and
    ``notes`` (one line per feature asked for but not applied, or not applicable)."""

    enabled: bool
    scheduler: Scheduler
    attention: str | None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, args, model, group: RankGroup, *, aux_loss: bool, external_generation: bool) -> Capabilities:
        """``model``: the unwrapped model (PEFT's base model); ``aux_loss``: an MoE router aux loss is trained;
        ``external_generation``: vLLM or continuous batching generate (they schedule their own batches)."""
        notes = []
        enabled = bool(args.dynamic_batching)
        if enabled and aux_loss:
            enabled = False
            notes.append("dynamic batching is off, stock GRPOTrainer math runs because the MoE router aux loss is "
                         "computed per micro-batch")
        attn = getattr(model.config, "_attn_implementation", None)
        unsupported = segment_attention_unsupported(model)
        scheduler = Scheduler.from_args(args, attn, model.config.get_text_config(), group,
                                        segment_attention=not unsupported)
        attention = attn if scheduler.layout == "padding_free" and not unsupported else None
        if enabled and args.share_prompt_prefix and not scheduler.share_prompts:
            why = unsupported or f"packing_layout resolves to {scheduler.layout!r}"
            notes.append(f"share_prompt_prefix is not applied: {why}")
        if args.per_device_generation_batch_size is not None and external_generation:
            notes.append(f"per_device_generation_batch_size={args.per_device_generation_batch_size} does not apply: "
                         "vLLM / continuous batching schedule their own generation batches")
        return cls(enabled, scheduler, attention, notes)
