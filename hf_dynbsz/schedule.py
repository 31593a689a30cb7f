"""How one optimizer step's samples become forward/backward passes: decided here, once.

For the training passes and the no-grad log-prob passes (old policy, reference model, the entropy pass of
``top_entropy_quantile``) alike, this module decides

* the **token budget** of a pass (:meth:`Scheduler.budget`): ``max_tokens_per_microbatch``, or stock TRL's own
  micro-batch size when it is unset; ``max_tokens_per_microbatch_logprob``, or twice the training budget, for
  no-grad passes;
* the **layout and attention kind** (:func:`resolve_layout`): padding-free rows or padded micro-batches, and
  whether attention is computed per sequence (varlen kernels) or densely over a row;
* the **oversize policy**: a sequence longer than the budget gets a pass of its own, or stops the run with the
  one message of :func:`hf_dynbsz.partition.oversize_error`;
* **lockstep**: the number of passes every process runs (the maximum any process needs, agreed through an
  injected :class:`RankGroup`), the exact-k partition of this process's samples into that many passes
  (:func:`hf_dynbsz.partition.partition_by_token_budget`) and the empty (dummy) passes that fill the gap.

The result is a :class:`StepSchedule`: the passes as lists of sample indices (an empty list is a dummy pass),
the budget, and the pass counts. The trainer executes it and the metrics read it; ``hf-dynbsz plan --lengths``
simulates training with the same :class:`Scheduler`. Pure Python + numpy: no torch, no trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .partition import (
    WorkloadModel,
    microbatch_tokens,
    min_num_microbatches,
    oversize_error,
    oversize_indices,
    partition_by_token_budget,
    round_up,
)
from .settings import setting

__all__ = [
    "RankGroup",
    "SINGLE_PROCESS",
    "Scheduler",
    "StepSchedule",
    "resolve_layout",
    "stock_microbatch_tokens",
]

#: Attention implementations whose kernels treat a padding-free row as separate sequences (varlen kernels).
VARLEN_ATTENTION_PREFIXES = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")

#: Pass kinds and the setting that gives each its budget.
BUDGET_SETTINGS = {"training": "max_tokens_per_microbatch", "logprob": "max_tokens_per_microbatch_logprob"}


def resolve_layout(packing_layout: str, attn_implementation: str | None) -> tuple[str, str]:
    """The concrete ``(layout, attention)`` for ``packing_layout`` and the model's attention implementation.

    ``layout`` is ``"padding_free"`` or ``"padded"``. ``"auto"`` is padding-free with a varlen attention kernel
    (flash_attention_2/3), whose cost grows with the sum of the squared sequence lengths, and padded otherwise:
    sdpa/eager compute the dense attention of a whole padding-free row, so micro-batches of similar lengths each
    padded to their own longest row are cheaper there. ``attention`` is ``"varlen"`` for a padding-free row on a
    varlen kernel and ``"dense"`` otherwise: it picks the cost the partitioner balances.
    """
    choices = setting("packing_layout").choices
    if packing_layout not in choices:
        raise ValueError(f"packing_layout must be one of {', '.join(map(repr, choices))}, got {packing_layout!r}.")
    varlen_kernel = bool(attn_implementation) and attn_implementation.startswith(VARLEN_ATTENTION_PREFIXES)
    layout = packing_layout if packing_layout != "auto" else ("padding_free" if varlen_kernel else "padded")
    return layout, "varlen" if layout == "padding_free" and varlen_kernel else "dense"


def stock_microbatch_tokens(rows: int, prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
                            pad_to_multiple_of: int | None = None) -> int:
    """Token positions of stock TRL's fixed micro-batch: ``rows`` x (longest prompt + longest completion).

    TRL pads prompts and completions separately (each to the longest of the generation batch, rounded up to
    ``pad_to_multiple_of``). The trainer reads the same number off TRL's padded tensors; the planner computes
    it from lengths with this function.
    """
    width = round_up(max(prompt_lengths, default=0), pad_to_multiple_of)
    width += round_up(max(completion_lengths, default=0), pad_to_multiple_of)
    return rows * width


class RankGroup(Protocol):
    """The collective the schedule needs, injected so the module runs (and is tested) without processes."""

    num_processes: int

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over all processes; every process must call it equally often."""


class _SingleProcess:
    num_processes = 1

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return list(values)


#: The :class:`RankGroup` of a run on one process (and of the planner).
SINGLE_PROCESS: RankGroup = _SingleProcess()


@dataclass(frozen=True)
class StepSchedule:
    """The passes of one optimizer step (or one no-grad log-prob call) on this process.

    ``microbatches``: sample indices per pass, in execution order; an empty list is a dummy pass that keeps this
    process in lockstep with busier ones. ``budget``: tokens per pass (per device), as
    :func:`~hf_dynbsz.partition.microbatch_tokens` counts them. ``passes_needed``: how many passes this process
    alone would have run. ``oversize``: indices of the samples longer than the budget (each ran alone).
    """

    microbatches: list[list[int]]
    budget: int
    passes_needed: int
    oversize: list[int]

    @property
    def passes(self) -> int:
        """Passes every process runs (real and dummy)."""
        return len(self.microbatches)

    @property
    def dummy_passes(self) -> int:
        return sum(1 for group in self.microbatches if not group)

    def computed_tokens(self, lengths: Sequence[int], layout: str, pad_to_multiple_of: int | None = None) -> list[int]:
        """Token positions each real pass computes (padding included), in pass order."""
        return [microbatch_tokens([lengths[i] for i in group], layout, pad_to_multiple_of)
                for group in self.microbatches if group]


@dataclass(frozen=True)
class Scheduler:
    """The scheduling decisions of one run: layout, budgets, oversize policy, lockstep. Build with :meth:`from_args`."""

    layout: str
    attention: str
    workload: WorkloadModel
    pad_to_multiple_of: int | None = None
    oversize_policy: str = "warn"
    max_tokens_per_microbatch: int | None = None
    max_tokens_per_microbatch_logprob: int | None = None
    group: RankGroup = SINGLE_PROCESS

    @classmethod
    def from_args(cls, args: Any, attn_implementation: str | None, model_config: Any = None,
                  group: RankGroup = SINGLE_PROCESS) -> Scheduler:
        """The scheduler of a validated config (``DynamicBatchGRPOConfig``, or the planner's namespace).

        ``model_config`` (a transformers text config or anything with ``hidden_size`` and ``num_hidden_layers``)
        sets the workload model the partitioner balances; None uses a generic 7B-class decoder.
        """
        layout, attention = resolve_layout(args.packing_layout, attn_implementation)
        if model_config is None:
            workload = WorkloadModel.default(layout=layout, attention=attention)
        else:
            workload = WorkloadModel.from_model_config(model_config, layout=layout, attention=attention)
        return cls(
            layout=layout,
            attention=attention,
            workload=workload,
            pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
            oversize_policy=args.oversize_policy,
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            max_tokens_per_microbatch_logprob=args.max_tokens_per_microbatch_logprob,
            group=group,
        )

    def budget(self, stock_tokens: int, kind: str = "training") -> int:
        """Tokens per pass of ``kind`` ("training" or "logprob"), per device.

        ``stock_tokens`` is the size of stock TRL's own micro-batch for the same samples (rows x padded width,
        see :func:`stock_microbatch_tokens`): the training budget when ``max_tokens_per_microbatch`` is unset,
        so memory is never worse than stock's. No-grad passes keep no activations for backward: their default is
        twice the training budget.
        """
        training = self.max_tokens_per_microbatch or stock_tokens
        if kind == "training":
            return training
        if kind == "logprob":
            return self.max_tokens_per_microbatch_logprob or 2 * training
        raise ValueError(f"kind must be one of {', '.join(map(repr, BUDGET_SETTINGS))}, got {kind!r}")

    def plan(self, lengths: Sequence[int], budget: int, kind: str = "training") -> StepSchedule:
        """Partition this process's samples (``lengths``: prompt + completion tokens each) into passes.

        Every process calls this with its own samples at the same point of the step: one all-reduce agrees on
        the pass count (the most any process needs) and on the longest oversize sequence anywhere, so that
        ``oversize_policy="error"`` stops every process with the same message, before any pass runs.
        """
        lengths = [int(length) for length in lengths]
        layout, pad = self.layout, self.pad_to_multiple_of
        oversize = oversize_indices(lengths, budget, layout, pad)
        needed = min_num_microbatches(lengths, budget, layout=layout, pad_to_multiple_of=pad)
        longest_oversize = max((lengths[i] for i in oversize), default=0)
        passes, longest_anywhere = self.group.all_reduce_max([needed, longest_oversize])
        if longest_anywhere and self.oversize_policy == "error":
            where, length = "a sequence on another process", longest_anywhere
            if oversize:
                where, length = f"sequence {oversize[0]} of this process's step", lengths[oversize[0]]
            raise oversize_error(where, length, budget, layout=layout, pad_to_multiple_of=pad,
                                 longest=longest_anywhere, setting=BUDGET_SETTINGS[kind])
        microbatches = partition_by_token_budget(
            lengths, budget, num_microbatches=max(passes, 1), layout=layout, pad_to_multiple_of=pad,
            workload=self.workload, attention=self.attention,
        )
        return StepSchedule(microbatches=microbatches, budget=budget, passes_needed=needed, oversize=oversize)

    @staticmethod
    def oversize_warning(count: int, longest: int, budget: int, kind: str = "training") -> str:
        """The one warning of ``oversize_policy="warn"``: ``count`` sequences, the longest ``longest`` tokens."""
        return (
            f"hf_dynbsz: {count} sequence(s) longer than the token budget ({budget} tokens; longest {longest}) "
            f"each get a micro-batch of their own. Raise {BUDGET_SETTINGS[kind]} to avoid larger-than-budget passes."
        )
