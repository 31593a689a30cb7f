"""What the plugin does for one run, decided at start from the config and the model (torch layer).

Every feature either runs exactly or does not run, with a reason the trainer logs once: dynamic batching itself
(stock's math for what cannot be repacked), the layouts the model allows (decided in
:mod:`hf_dynbsz.planning.model_support`, verified on the first step by :mod:`hf_dynbsz.execution.self_check`), and the
generation chunk size. The scheduling decisions proper live in :mod:`hf_dynbsz.planning.schedule`; this module only
gathers what the model and the config allow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hf_dynbsz.planning.env import env_sources
from hf_dynbsz.planning.model_support import (
    REPACKED_VISION_MODEL_TYPES,
    DeviceFacts,
    Layout,
    ModelSupport,
    images_stay_on_their_process,
)
from hf_dynbsz.planning.schedule import RankGroup, Scheduler
from hf_dynbsz.planning.settings import ENV_SETTINGS, SharePrefix

__all__ = ["Capabilities", "check_same_on_every_process", "support_under"]

#: Settings every process must hold equal: each one's DIFFU_* variable is read by every process from its own
#: environment, so a variable exported on one machine only would split them (and the processes' collectives).
SHARED_SETTINGS = tuple(spec.name for spec in ENV_SETTINGS)


def check_same_on_every_process(args, group: RankGroup) -> None:
    """Raise on every process (each naming its own ``DIFFU_*`` source) when the processes disagree on one of
    :data:`SHARED_SETTINGS`: before any collective that the disagreement would hang or corrupt."""
    if group.num_processes == 1:
        return
    gathered = group.all_gather([_code(getattr(args, name, None)) for name in SHARED_SETTINGS])
    for position, name in enumerate(SHARED_SETTINGS):
        values = [_decoded(row[position]) or None for row in gathered]
        if len(set(values)) > 1:
            per_process = ", ".join(f"process {rank}: {value}" for rank, value in enumerate(values))
            source = env_sources(args).get(name, "")
            raise ValueError(
                f"{name} differs between processes ({per_process}){f'; here it came from {source}' if source else ''}. "
                "DIFFU_* variables are read by every process from its own environment: export the same values on "
                "every machine (or unset them everywhere) before launching."
            )


#: The sharing rules as :func:`_code` numbers them, below 0.
_RULES = tuple(SharePrefix)


def _code(value) -> int:
    """A setting's value as one integer the processes compare: a number as itself (None and False as 0), a sharing
    rule (:class:`~hf_dynbsz.planning.settings.SharePrefix`) by its place among the rules, below 0."""
    if isinstance(value, str):  # (a SharePrefix is one)
        return -1 - _RULES.index(SharePrefix.of(value))
    return int(value or 0)


def _decoded(code: int):
    """What :func:`_code` made ``code`` of (a rule's name, else the number)."""
    return _RULES[-1 - code].value if code < 0 else code


#: Why a model with sequence mixers trains padded rows where their calls gather parameters ({why}: the engine's
#: reason, :func:`hf_dynbsz.parallel.distributed.gathered_calls`).
SEGMENT_RECURRENCE_GATHERED = (
    "its sequence mixers run once per run length in a padding-free row (segment recurrence), a number that differs "
    "between processes, and {why}, with the other processes, which must make the same calls"
)


def support_under(support: ModelSupport, gathered: Callable[[tuple[str, ...]], str | None]) -> ModelSupport:
    """``support`` as a run may use it where ``gathered`` (why each call of a module of these class names is a
    collective of every process, or None: :func:`hf_dynbsz.parallel.distributed.gathered_calls`) names the sequence
    mixers' calls: then without segment recurrence (:data:`SEGMENT_RECURRENCE_GATHERED`)."""
    why = gathered(support.sequence_mixers) if support.sequence_mixers else None
    if why:
        blocker = SEGMENT_RECURRENCE_GATHERED.format(why=why)
        return replace(support, padding_free_blocker=blocker, sequence_mixers=())
    return support


@dataclass
class Capabilities:
    """The run's features: ``enabled`` (dynamic batching; False: stock math), ``support`` (what the model allows,
    :class:`~hf_dynbsz.planning.model_support.ModelSupport`), ``layouts`` (the layouts training may use, fastest first:
    it starts with the first and the self-check steps down), the :class:`Scheduler` of the first layout, and ``notes``
    (one line per feature asked for but not applied, or not applicable)."""

    enabled: bool
    support: ModelSupport
    layouts: list[Layout]
    scheduler: Scheduler
    notes: list[str] = field(default_factory=list)
    #: the MoE router aux loss TRL trains is repacked per sample (:mod:`hf_dynbsz.execution.router_loss`)
    router_aux: bool = False

    @property
    def vision_language(self) -> str | None:
        """How image steps train (:func:`~hf_dynbsz.planning.model_support.vision_language_mode`)."""
        return self.support.vision_language

    @classmethod
    def of(
        cls,
        args,
        model,
        group: RankGroup,
        *,
        aux_loss: bool,
        external_generation: bool,
        device_type: str | DeviceFacts = "cpu",
        gathered: Callable[[tuple[str, ...]], str | None] = lambda names: None,
    ) -> Capabilities:
        """``model``: the unwrapped model (PEFT's base model); ``aux_loss``: an MoE router aux loss is trained;
        ``external_generation``: vLLM or continuous batching generate (they schedule their own batches);
        ``device_type``: where it trains, a type or its :class:`DeviceFacts` (:meth:`ModelSupport.layouts`);
        ``gathered``: why a call of modules of these class names is a collective of every process, or None
        (:func:`hf_dynbsz.parallel.distributed.gathered_calls`); where the sequence mixers' are, segment recurrence is
        off (:data:`SEGMENT_RECURRENCE_GATHERED`)."""
        check_same_on_every_process(args, group)
        notes = []
        enabled = bool(args.dynamic_batching)
        support = support_under(ModelSupport.of(model=model), gathered)
        router_aux = enabled and aux_loss and support.router_aux is not None
        if enabled and aux_loss and not router_aux:
            enabled = False
            notes.append(
                f"dynamic batching is off, stock TRL math runs: the MoE router aux loss cannot be "
                f"repacked ({support.router_aux_blocker})"
            )
        layouts, layout_notes = support.layouts(args.packing_layout, args.share_prompt_prefix, device_type)
        if enabled:
            notes += layout_notes + list(support.notes)
            enabled = bool(layouts)
        scheduler = Scheduler.from_args(args, support, group, layout=layouts[0] if layouts else Layout("padded"))
        vision_language = support.vision_language
        if enabled and vision_language == "stock":
            notes.append(
                f"image steps of this {model.config.model_type} model run stock TRL micro-batches "
                f"(image inputs are repacked for {', '.join(REPACKED_VISION_MODEL_TYPES)}); text-only steps "
                "are repacked"
            )
        if (
            enabled
            and images_stay_on_their_process(vision_language)
            and args.balance_across_ranks
            and group.num_processes > 1
        ):
            notes.append("balance_across_ranks is not applied: the image inputs of this family stay on their process")
        if args.per_device_generation_batch_size is not None and external_generation:
            notes.append(
                f"per_device_generation_batch_size={args.per_device_generation_batch_size} does not apply: "
                "vLLM / continuous batching schedule their own generation batches"
            )
        return cls(enabled, support, layouts, scheduler, notes, router_aux)

    def with_teacher(self, args, teacher: ModelSupport, device_type: str | DeviceFacts = "cpu") -> Capabilities:
        """The capabilities of a distillation pair: the student's (these) and ``teacher``'s (what the teacher model
        allows) together. The teacher's no-grad passes run the samples of the student's passes in the same layout, so
        the pair keeps the layouts both models allow, fastest first (the student's order; segment recurrence where
        either model has sequence mixers, each model's own found by class name). Image steps run stock's
        micro-batches (a teacher's image inputs are not repacked). A sample's rope width is read against both models'
        LongRoPE lengths (:func:`~hf_dynbsz.planning.model_support.rope_width`). Each feature not applied has one
        note."""
        teacher_layouts, _ = teacher.layouts(args.packing_layout, args.share_prompt_prefix, device_type)
        pair = [_pair_layout(layout, teacher_layouts) for layout in self.layouts]
        pair = [layout for layout in pair if layout is not None]
        notes = list(self.notes)
        if teacher.position_offset != self.support.position_offset:
            pair = []
        if self.enabled and not pair:
            why = teacher.repacking_blocker or "no layout of the student's is one the teacher allows"
            notes.append(f"dynamic batching is off, stock DistillationTrainer math runs: the teacher model: {why}")
        elif self.enabled and len(pair) < len(self.layouts):
            dropped = [layout.describe() for layout in self.layouts if _pair_layout(layout, pair) is None]
            notes.append(f"the teacher model does not run {'; '.join(dropped)}: the pair trains the others")
        support = replace(
            self.support,
            sequence_mixers=tuple(dict.fromkeys(self.support.sequence_mixers + teacher.sequence_mixers)),
            long_rope=tuple(sorted(set(self.support.long_rope + teacher.long_rope))),
            vision_language="stock" if self.support.vision_language or teacher.vision_language else None,
        )
        if self.enabled and support.vision_language:
            notes.append(
                "image steps run stock DistillationTrainer micro-batches (the teacher's image inputs are not "
                "repacked); text-only steps are repacked"
            )
        enabled = self.enabled and bool(pair)
        scheduler = self.scheduler if not pair else Scheduler.from_args(args, support, self.scheduler.group, pair[0])
        return replace(self, enabled=enabled, support=support, layouts=pair, scheduler=scheduler, notes=notes)


def _pair_layout(layout: Layout, teacher_layouts: list[Layout]) -> Layout | None:
    """``layout`` (the student's) as the pair runs it when the teacher allows it too (the same rows, prompts, attention
    and mask), with segment recurrence where either model needs it; None when the teacher does not."""
    fields = ("name", "sharing", "segment_attention", "attention_mask", "attention")
    for other in teacher_layouts:
        if all(getattr(layout, field) == getattr(other, field) for field in fields):
            return replace(layout, segment_recurrence=layout.segment_recurrence or other.segment_recurrence)
    return None
