"""How one optimizer step's samples become forward/backward passes: decided here, once.

For the training passes and the no-grad log-prob passes (old policy, reference model, the entropy pass of
``top_entropy_quantile``) alike, this module decides

* the **token budget** of a pass (:meth:`Scheduler.budget`): ``max_tokens_per_microbatch``, or stock TRL's own
  micro-batch size when it is unset; ``max_tokens_per_microbatch_logprob``, or twice the training budget, for
  no-grad passes;
* the **layout** (the first rung of :meth:`hf_dynbsz.planning.model_support.ModelSupport.layouts`, stepped down by the
  self-check): padding-free rows or padded micro-batches, shared prompts, and whether attention is computed per
  sequence (varlen kernels, segment attention) or densely over a row;
* the **oversize policy**: a sequence longer than the budget gets a pass of its own, or stops the run with the
  one message of :func:`hf_dynbsz.planning.partition.oversize_error`;
* **lockstep**: the number of passes every process runs (the maximum any process needs, agreed through an
  injected :class:`RankGroup`), the exact-k partition of this process's samples into that many passes
  (:func:`hf_dynbsz.planning.partition.partition_by_token_budget`) and the empty (dummy) passes that fill the gap.

The result is a :class:`StepSchedule`: the passes as lists of sample indices (an empty list is a dummy pass),
the budget, and the pass counts. The trainer executes it and the metrics read it; ``hf-dynbsz plan --lengths``
simulates training with the same :class:`Scheduler`. Pure Python + numpy: no torch, no trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hf_dynbsz.planning.balance import Assignment, Divisible, assign
from hf_dynbsz.planning.cost import WorkloadModel
from hf_dynbsz.planning.model_support import Layout, ModelSupport, images_stay_on_their_process
from hf_dynbsz.planning.partition import (
    item_costs,
    min_num_microbatches,
    oversize_error,
    oversize_indices,
    partition_by_token_budget,
)
from hf_dynbsz.planning.prefix_tree import PrefixTree, Unit
from hf_dynbsz.planning.settings import SharePrefix, setting
from hf_dynbsz.planning.tokens import microbatch_tokens, round_up

__all__ = [
    "RankGroup",
    "SINGLE_PROCESS",
    "Scheduler",
    "StepRequest",
    "StepSchedule",
    "Unit",
    "arrivals",
    "build_units",
    "row_tokens",
    "sharing_tree",
    "simulate_processes",
    "stock_microbatch_tokens",
]

#: Pass kinds and the setting that gives each its budget ("teacher": the no-grad passes of a distillation's teacher).
BUDGET_SETTINGS = {
    "training": "max_tokens_per_microbatch",
    "logprob": "max_tokens_per_microbatch_logprob",
    "teacher": "max_tokens_per_microbatch_teacher",
}


def stock_microbatch_tokens(
    rows: int, prompt_lengths: Sequence[int], completion_lengths: Sequence[int], pad_to_multiple_of: int | None = None
) -> int:
    """Token positions of stock TRL's fixed micro-batch: ``rows`` x (longest prompt + longest completion).

    TRL pads prompts and completions separately (each to the longest of the generation batch, rounded up to
    ``pad_to_multiple_of``). The trainer reads the same number off TRL's padded tensors; the planner computes
    it from lengths with this function.
    """
    width = round_up(max(prompt_lengths, default=0), pad_to_multiple_of)
    width += round_up(max(completion_lengths, default=0), pad_to_multiple_of)
    return rows * width


class RankGroup(Protocol):
    """The collectives the schedule needs, injected so the module runs (and is tested) without processes."""

    num_processes: int
    rank: int

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over all processes; every process must call it equally often."""

    def all_gather(self, values: list[int]) -> list[list[int]]:
        """Every process's ``values`` (lists may differ in length), in process order; called by every process."""


class _SingleProcess:
    num_processes = 1
    rank = 0

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return list(values)

    def all_gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


#: The :class:`RankGroup` of a run on one process (and of the planner).
SINGLE_PROCESS: RankGroup = _SingleProcess()


@dataclass(frozen=True)
class Exchange:
    """Which process runs which samples of a step, when cross-rank balancing moves some (the same on every process).

    ``shapes[p]`` are the ``(prompt, completion)`` token lengths of process ``p``'s samples in its order,
    ``destination[p]`` the process each of them runs on; this process is ``rank``. After the exchange a process
    holds the samples sent to it in ``(origin process, index)`` order (:attr:`incoming`).
    """

    rank: int
    shapes: list[list[tuple[int, int]]]
    destination: list[list[int]]

    @property
    def outgoing(self) -> list[list[int]]:
        """Per destination process, the indices of this process's samples sent there (ascending)."""
        sent = [[] for _ in self.shapes]
        for index, target in enumerate(self.destination[self.rank]):
            sent[target].append(index)
        return sent

    @property
    def incoming(self) -> list[tuple[int, int]]:
        """``(origin process, index)`` of the samples this process runs, in its local order after the exchange."""
        return arrivals(self.destination)[self.rank]


def arrivals(destination: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """Per process, the ``(origin process, index)`` of the samples it runs after an exchange, in its local order:
    by origin, then by index (``destination[p][i]``: the process sample ``i`` of process ``p`` runs on)."""
    arrived: list[list[tuple[int, int]]] = [[] for _ in destination]
    for origin, targets in enumerate(destination):
        for index, target in enumerate(targets):
            arrived[target].append((origin, index))
    return arrived


def row_tokens(
    samples: Sequence[int],
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    groups: Sequence[int] | None,
) -> int:
    """Tokens of a padding-free pass holding ``samples``: every prompt group present computes its prompt once."""
    return sharing_tree(prompt_lengths, completion_lengths, groups).tokens(samples)


def sharing_tree(
    prompt_lengths: Sequence[int], completion_lengths: Sequence[int], groups: Sequence[int] | None
) -> PrefixTree:
    """The prefix tree of the prompt-group rule (:meth:`PrefixTree.of_groups`; ``groups`` None: nothing shared)."""
    if groups is None:
        return PrefixTree.alone([p + c for p, c in zip(prompt_lengths, completion_lengths)])
    return PrefixTree.of_groups(prompt_lengths, completion_lengths, groups)


def build_units(
    prompt_lengths: Sequence[int], completion_lengths: Sequence[int], groups: Sequence[int] | None, budget: int
) -> list[Unit]:
    """The units of one process's samples under the prompt-group rule, ordered by their first sample
    (:meth:`PrefixTree.units`): a group's segment when it fits ``budget``, else pieces each carrying the prompt once,
    its blocks (prompt's last token + completion) packed first-fit-decreasing; a block that fits with no other runs
    alone (as a plain sequence, longer than the budget if it must)."""
    return sharing_tree(prompt_lengths, completion_lengths, groups).units(budget)


@dataclass(frozen=True)
class StepSchedule:
    """The passes of one optimizer step (or one no-grad log-prob call) on this process.

    ``microbatches``: sample indices per pass, in execution order; an empty list is a dummy pass that keeps this
    process in lockstep with busier ones. Indices refer to the samples this process runs: its own, or after a
    cross-rank ``exchange`` (None when nothing moves) those of :attr:`Exchange.incoming`, whose token counts are
    ``lengths``. ``budget``: tokens per pass (per device), as :func:`~hf_dynbsz.planning.partition.microbatch_tokens`
    counts them. ``passes_needed``: how many passes this process alone would have run. ``oversize``: indices of the
    samples longer than the budget (each ran alone). ``tree``: the prefix tree the passes were counted by (samples
    of other processes share nothing in it), None without sharing. ``pass_tokens``: the tokens each real pass
    computes (shared positions once, padding included); ``shared_tokens_saved``: the tokens not computed thanks to
    sharing (prompts, and with a prefix tree any shared prefix). ``balance``: the cross-rank assignment when balancing
    ran. ``pass_pairs``: each real pass's attention term (:meth:`PrefixTree.pairs`: squared sequence lengths for
    samples sharing nothing; rows x width^2 for padded passes) and ``pass_path_keys`` the keys it gathers in front
    of its row's nodes (:meth:`PrefixTree.path_keys`; 0 for padded passes), which the memory model reads.
    """

    microbatches: list[list[int]]
    budget: int
    passes_needed: int
    oversize: list[int]
    lengths: list[int]
    pass_tokens: list[int]
    shared_tokens_saved: int = 0
    pass_pairs: list[int] | None = None
    pass_path_keys: list[int] | None = None
    tree: PrefixTree | None = None
    exchange: Exchange | None = None
    balance: Assignment | None = None

    @property
    def passes(self) -> int:
        """Passes every process runs (real and dummy)."""
        return len(self.microbatches)

    @property
    def dummy_passes(self) -> int:
        return sum(1 for group in self.microbatches if not group)

    def pass_shapes(self) -> list[tuple[int, int, int]]:
        """Per real pass, ``(tokens, pairs, path keys)``: what the memory model predicts it by."""
        keys = self.pass_path_keys or [0] * len(self.pass_tokens)
        return list(zip(self.pass_tokens, self.pass_pairs or [0] * len(self.pass_tokens), keys))

    @property
    def samples_moved(self) -> int:
        """Samples of all processes that run on another process than their own (0 without an exchange)."""
        if self.exchange is None:
            return 0
        return sum(target != origin for origin, targets in enumerate(self.exchange.destination) for target in targets)


@dataclass(frozen=True)
class StepRequest:
    """What one process brings to the scheduling of a step: its samples' ``prompts`` and ``completions`` (tokens),
    the prefix ``tree`` the samples share positions by (:meth:`Scheduler._tree`; every sample alone without sharing),
    its ``budget`` (tokens per pass) and ``together`` (one id per sample, equal ids always in one pass: a preference
    pair's chosen and rejected; None: no such groups)."""

    prompts: list[int]
    completions: list[int]
    tree: PrefixTree
    budget: int
    together: list[int] | None = None

    @property
    def lengths(self) -> list[int]:
        """Prompt + completion tokens per sample."""
        return [p + c for p, c in zip(self.prompts, self.completions)]

    def values(self) -> list[int]:
        """What the process contributes to the all-gather of cross-rank balancing: the budget, the sample count, each
        sample's prompt and completion, its prefix tree (:meth:`PrefixTree.encode`), then its ``together`` ids (if
        any)."""
        shapes = [v for sample in zip(self.prompts, self.completions) for v in sample]
        return [self.budget, len(self.prompts), *shapes, *self.tree.encode(), *(self.together or [])]

    @classmethod
    def from_values(cls, values: Sequence[int]) -> StepRequest:
        """The request of a process from its :meth:`values`."""
        count = values[1]
        shapes = values[2 : 2 + 2 * count]
        tree, taken = PrefixTree.decode(values[2 + 2 * count :])
        together = [int(v) for v in values[2 + 2 * count + taken :]] or None
        return cls(list(shapes[0::2]), list(shapes[1::2]), tree, values[0], together)


@dataclass(frozen=True)
class _Lockstep:
    """A process's step without balancing, before the processes agree: its request and units, the passes it needs
    alone and its longest sequence over the budget (tokens; 0: none)."""

    request: StepRequest
    units: list[Unit]
    needed: int
    longest_oversize: int

    def values(self) -> list[int]:
        """What the process contributes to the all-reduce MAX of lockstep."""
        return [self.needed, self.longest_oversize]


@dataclass(frozen=True)
class _Balancing:
    """Cross-rank balancing of a step as every process computes it from the all-gathered requests (process order).

    ``budget``: the largest of the processes' budgets; ``shapes[p]``: process ``p``'s ``(prompt, completion)`` per
    sample; ``units[p]``: its units; ``over[p]``: its longest sequence over the budget (0: none; empty unless
    ``oversize_policy="error"``); ``destination[p][i]``: where its sample ``i`` runs (``moved`` units move);
    ``arrived[p]``: the ``(origin, index)`` of the samples process ``p`` runs (:func:`arrivals`); ``runs[p]``: the
    ``(origin, unit)`` it runs; ``needed[p]``: the passes those take.
    """

    budget: int
    requests: list[StepRequest]
    shapes: list[list[tuple[int, int]]]
    units: list[list[Unit]]
    over: list[int]
    assignment: Assignment
    moved: int
    destination: list[list[int]]
    arrived: list[list[tuple[int, int]]]
    runs: list[list[tuple[int, Unit]]]
    needed: list[int]


@dataclass(frozen=True)
class Scheduler:
    """The scheduling decisions of one run: layout, budgets, oversize policy, shared prompts, balancing, lockstep.

    Build it with :meth:`from_args`; every process of a run holds an equal one (``group`` aside). ``layout`` is
    ``"padding_free"`` or ``"padded"``, ``attention`` the cost kind the partitioner balances (``"varlen"`` or
    ``"dense"``), ``segment_attention`` the base implementation segment attention runs (None: the model's own
    attention), ``segment_recurrence`` whether the model's sequence mixers run per sequence of a padding-free row,
    ``attention_mask`` whether padded rows carry a mask, ``position_offset`` the first position id.
    ``sharing`` (:class:`~hf_dynbsz.planning.settings.SharePrefix`, the layout's) is on only where it is exact:
    padding-free rows through segment attention; ``TREE`` shares every prefix the samples of a pass have in common,
    ``GROUPS`` each prompt in its group.
    """

    layout: str
    attention: str
    workload: WorkloadModel
    pad_to_multiple_of: int | None = None
    oversize_policy: str = "warn"
    max_tokens_per_microbatch: int | None = None
    max_tokens_per_microbatch_logprob: int | None = None
    max_tokens_per_microbatch_teacher: int | None = None
    #: the teacher's automatic budget is the log-prob one times this (the student's no-grad memory per token over
    #: the teacher's, :func:`hf_dynbsz.planning.memory.teacher_budget_scale`)
    teacher_scale: float = 1.0
    balance_across_ranks: bool = True
    sharing: SharePrefix = SharePrefix.NONE
    segment_attention: str | None = None
    segment_recurrence: bool = False
    attention_mask: bool = False
    position_offset: int = 0
    group: RankGroup = SINGLE_PROCESS
    #: processes sharing each pass's row (:mod:`hf_dynbsz.execution.sequence_parallel`): a pass holds this many budgets
    sequence_parallel_size: int = 1

    @classmethod
    def from_args(
        cls,
        args: Any,
        support: ModelSupport | None = None,
        group: RankGroup = SINGLE_PROCESS,
        layout: Layout | None = None,
    ) -> Scheduler:
        """The scheduler of a validated config (``DynamicBatchGRPOConfig``, or the planner's namespace).

        ``support`` (:meth:`ModelSupport.of`; None: a standard decoder on sdpa) decides the layouts and the cost
        model; ``layout`` picks one of its layouts (default: the first, where training starts).
        """
        support = support or ModelSupport.of(attn_implementation="sdpa")
        if layout is None:
            share = getattr(args, "share_prompt_prefix", setting("share_prompt_prefix").default)
            layout = support.layouts(args.packing_layout, share)[0][0]
        balance = getattr(args, "balance_across_ranks", setting("balance_across_ranks").default)
        return cls(
            layout=layout.name,
            attention=layout.attention,
            workload=WorkloadModel.from_flops(support.flops, layout=layout.name, attention=layout.attention),
            pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
            oversize_policy=args.oversize_policy,
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            max_tokens_per_microbatch_logprob=args.max_tokens_per_microbatch_logprob,
            max_tokens_per_microbatch_teacher=getattr(args, "max_tokens_per_microbatch_teacher", None),
            balance_across_ranks=bool(balance) and not images_stay_on_their_process(support.vision_language),
            sharing=layout.sharing,
            segment_attention=layout.segment_attention,
            segment_recurrence=layout.segment_recurrence,
            attention_mask=layout.attention_mask,
            position_offset=support.position_offset,
            group=group,
            sequence_parallel_size=int(getattr(args, "sequence_parallel_size", 1) or 1),
        )

    def describe(self) -> str:
        """The layout this scheduler runs, as :meth:`Layout.describe` phrases it (logs, reports)."""
        return Layout(
            self.layout,
            self.sharing,
            self.segment_attention,
            self.attention_mask,
            self.attention,
            segment_recurrence=self.segment_recurrence,
        ).describe()

    def budget(
        self,
        stock_tokens: int,
        kind: str = "training",
        fits: int | None = None,
        cap: int | None = None,
        agree: bool = False,
    ) -> int:
        """Tokens per pass of ``kind`` ("training", "logprob" or "teacher"): per device, times
        ``sequence_parallel_size`` (a sharded pass's row spans its group's devices).

        ``stock_tokens`` is the size of stock TRL's own micro-batch for the same samples (rows x padded width,
        see :func:`stock_microbatch_tokens`): the training budget when ``max_tokens_per_microbatch`` is unset,
        so memory is never worse than stock's. No-grad passes keep no activations for backward: their default is
        twice the training budget; a distillation teacher's is that times :attr:`teacher_scale` (a larger teacher
        holds more per token). With cross-rank balancing, :meth:`plan` raises an automatic budget to the
        largest of all processes' (stock's peak memory is that of its largest micro-batch on any device).

        ``fits``: with a memory limit, the largest budget of ``kind`` whose passes fit it
        (:meth:`hf_dynbsz.planning.memory.MemoryModel.budget`): it replaces the automatic budget (a setting given by the
        user still wins). ``cap``: a budget a pass that ran out of memory left (:meth:`MemoryModel.record_failure`): no
        budget exceeds it. ``agree``: every process takes the smallest of all processes' budgets (one all-reduce;
        every process must pass the same ``agree``).
        """
        if kind not in BUDGET_SETTINGS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, BUDGET_SETTINGS))}, got {kind!r}")
        training = self.max_tokens_per_microbatch or stock_tokens
        if kind == "training":
            budget = self.max_tokens_per_microbatch or fits or stock_tokens
        else:
            scale = self.teacher_scale if kind == "teacher" else 1.0
            budget = getattr(self, BUDGET_SETTINGS[kind]) or (
                fits if fits is not None and not self.max_tokens_per_microbatch else max(1, round(2 * training * scale))
            )
        budget *= self.sequence_parallel_size  # the budgets are per device; a sharded pass spans its group
        budget = min(budget, cap) if cap is not None else budget
        if agree and self.group.num_processes > 1:
            budget = -self.group.all_reduce_max([-budget])[0]
        return budget

    def plan(
        self,
        lengths: Sequence[int],
        budget: int,
        kind: str = "training",
        prompt_lengths: Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
        tree: PrefixTree | None = None,
        together: Sequence[int] | None = None,
    ) -> StepSchedule:
        """Partition this process's samples (``lengths``: prompt + completion tokens each) into passes.

        ``prompt_lengths`` split the lengths (the exchange and shared prompts need them). When ``sharing`` is
        on, ``tree`` (the samples' :class:`~hf_dynbsz.planning.prefix_tree.PrefixTree`) or else ``groups`` (one id
        per sample, equal ids = identical prompt tokens: the prompt-group rule) says which positions samples share
        within a pass. ``together`` (one id per sample): samples of equal ids always share a pass (a preference pair's
        chosen and rejected; :meth:`PrefixTree.units`). Every process calls this with its own samples at the same point
        of the step.
        Without balancing one all-reduce agrees on the pass count (the most any process needs) and on the longest
        oversize sequence anywhere; with ``balance_across_ranks`` on several processes, one all-gather of every
        sample's lengths and prefix tree lets every process compute the same assignment of units to processes
        (:mod:`hf_dynbsz.planning.balance`) and the pass count. ``oversize_policy="error"`` stops every process with the
        same message, before any pass runs. Each phase is a method of its own, the collectives between them:
        :func:`simulate_processes` runs the same phases for every simulated process, each collective computed
        directly over the processes' values.
        """
        request = self._request(lengths, budget, prompt_lengths, groups, tree, together)
        if self._balances(self.group.num_processes):
            agreed = self._balancing(self.group.all_gather(request.values()))
            return self._balanced_schedule(agreed, self.group.rank, kind)
        own = self._lockstep(request)
        return self._in_lockstep(own, self.group.all_reduce_max(own.values()), kind)

    def _request(
        self,
        lengths: Sequence[int],
        budget: int,
        prompt_lengths: Sequence[int] | None,
        groups: Sequence[int] | None,
        tree: PrefixTree | None = None,
        together: Sequence[int] | None = None,
    ) -> StepRequest:
        """What this process brings to the step's scheduling (:meth:`plan`'s arguments, as integers and a tree)."""
        lengths = [int(length) for length in lengths]
        prompts = [int(p) for p in prompt_lengths] if prompt_lengths is not None else [0] * len(lengths)
        completions = [n - p for n, p in zip(lengths, prompts)]
        if together is not None:
            together = [int(group) for group in together]
            if len(together) != len(lengths):
                raise ValueError(f"together has {len(together)} ids for {len(lengths)} samples")
        tree = self._tree(prompts, completions, groups, tree)
        return StepRequest(prompts, completions, tree, budget, together if together else None)

    def _tree(
        self, prompts: list[int], completions: list[int], groups: Sequence[int] | None, tree: PrefixTree | None
    ) -> PrefixTree:
        """The prefix tree the samples are planned by: ``tree``, else the prompt-group rule's of ``groups``; every
        sample alone when nothing is shared (``sharing`` none, or neither given)."""
        if not self.sharing or (tree is None and groups is None):
            return PrefixTree.alone([p + c for p, c in zip(prompts, completions)])
        if tree is not None:
            if tree.samples != len(prompts):
                raise ValueError(f"the prefix tree holds {tree.samples} samples, the step {len(prompts)}")
            return tree
        return PrefixTree.of_groups(prompts, completions, [int(g) for g in groups])

    def _balances(self, num_processes: int) -> bool:
        """Whether a step over ``num_processes`` processes is balanced across them (one process: nothing to balance)."""
        return self.balance_across_ranks and num_processes > 1

    def _lockstep(self, request: StepRequest) -> _Lockstep:
        """This process's part of a step without balancing, up to the all-reduce of :meth:`_Lockstep.values`."""
        units = request.tree.units(request.budget, request.together)
        longest_oversize = self._longest_oversize(request.lengths, units, request.budget)
        return _Lockstep(request, units, self._passes_needed(units, request.budget), longest_oversize)

    def _in_lockstep(self, own: _Lockstep, agreed: Sequence[int], kind: str) -> StepSchedule:
        """This process's passes once the processes agreed (all-reduce MAX of :meth:`_Lockstep.values`: the pass count
        and the longest oversize sequence anywhere)."""
        passes, longest_anywhere = agreed
        request = own.request
        if longest_anywhere and self.oversize_policy == "error":
            raise self._oversize_error(
                own.units, request.lengths, longest_anywhere, request.budget, kind, "a sequence on another process"
            )
        return self._partition(
            request.prompts, request.completions, request.tree, own.units, request.budget, passes, own.needed
        )

    def _balancing(self, gathered: list[list[int]]) -> _Balancing:
        """What every process computes alike from every process's :meth:`StepRequest.values` (the all-gather), in
        process order."""
        requests = [StepRequest.from_values(values) for values in gathered]
        budget = max(request.budget for request in requests)  # automatic budgets differ: the largest is stock's bound
        units = [r.tree.units(budget, r.together) for r in requests]
        over = []
        if self.oversize_policy == "error":
            over = [self._longest_oversize(r.lengths, u, budget) for r, u in zip(requests, units)]
        every_unit = [(origin, unit) for origin, process_units in enumerate(units) for unit in process_units]
        assignment = assign(
            [self._unit_costs(process_units) for process_units in units],
            divisible=self._divisible(requests, every_unit),
        )
        destination = [[0] * len(request.prompts) for request in requests]
        runs: list[list[tuple[int, Unit]]] = [[] for _ in requests]
        for number, (origin, unit) in enumerate(every_unit):
            for target, samples in assignment.placed(number, unit.samples).items():
                for i in samples:
                    destination[origin][i] = target
                part = unit if samples == unit.samples else _piece(requests[origin].tree, samples)
                runs[target].append((origin, part))
        return _Balancing(
            budget=budget,
            requests=requests,
            shapes=[list(zip(request.prompts, request.completions)) for request in requests],
            units=units,
            over=over,
            assignment=assignment,
            moved=assignment.moved,
            destination=destination,
            arrived=arrivals(destination),
            runs=runs,
            needed=[self._passes_needed([unit for _, unit in run], budget) for run in runs],
        )

    def _divisible(self, requests: list[StepRequest], every_unit: list[tuple[int, Unit]]) -> Divisible | None:
        """The units of every process (``(origin, unit)``, numbered as :func:`assign` numbers them), cut along their
        origin's prefix tree where balancing needs it: a piece is the samples below one of a unit's nodes
        (:meth:`PrefixTree.subtrees`), and a part of a unit costs what it computes, its path included
        (:func:`_piece`), on every process holding one. None when every unit is one sample."""
        if all(len(unit.samples) == 1 for _, unit in every_unit):
            return None
        trees = [requests[origin].tree for origin, _ in every_unit]
        known: dict[tuple[int, tuple[int, ...]], float] = {(number, ()): 0.0 for number in range(len(every_unit))}

        def costs(number: int, sets: list[tuple[int, ...]]) -> list[float]:
            new = list(dict.fromkeys(samples for samples in sets if (number, samples) not in known))
            for samples, cost in zip(new, self._unit_costs([_piece(trees[number], samples) for samples in new])):
                known[number, samples] = cost
            return [known[number, samples] for samples in sets]

        def pieces(number: int, samples: tuple[int, ...]) -> list[tuple[int, ...]]:
            cuts = dict.fromkeys([samples, *trees[number].subtrees(samples)])
            together = requests[every_unit[number][0]].together
            return [piece for piece in cuts if together is None or _keeps_together(piece, samples, together)]

        return Divisible([unit.samples for _, unit in every_unit], costs, pieces)

    def _balanced_schedule(self, agreed: _Balancing, rank: int, kind: str) -> StepSchedule:
        """Process ``rank``'s passes under the balancing every process computed alike (:meth:`_balancing`)."""
        budget, requests = agreed.budget, agreed.requests
        if agreed.over and max(agreed.over):
            elsewhere = f"a sequence on process {next(q for q, longest in enumerate(agreed.over) if longest)}"
            raise self._oversize_error(
                agreed.units[rank], requests[rank].lengths, max(agreed.over), budget, kind, elsewhere
            )
        local = agreed.arrived[rank]
        local_index = {origin: j for j, origin in enumerate(local)}
        units = [  # the units this process runs, in its own sample numbering
            Unit(tuple(sorted(local_index[q, i] for i in unit.samples)), unit.tokens, unit.pairs)
            for q, unit in agreed.runs[rank]
        ]
        schedule = self._partition(
            [requests[q].prompts[i] for q, i in local],
            [requests[q].completions[i] for q, i in local],
            PrefixTree.joined([(requests[q].tree, i) for q, i in local]),
            sorted(units, key=lambda unit: unit.samples[0]),
            budget,
            max(agreed.needed),
            agreed.needed[rank],
        )
        exchange = Exchange(rank, agreed.shapes, agreed.destination) if agreed.moved else None
        return dataclasses.replace(schedule, exchange=exchange, balance=agreed.assignment)

    def _longest_oversize(self, lengths: list[int], units: list[Unit], budget: int) -> int:
        """The longest of the samples over ``budget`` (tokens; 0: none)."""
        return max((lengths[i] for i in self._oversize(units, budget)), default=0)

    def step_cost(
        self,
        lengths: Sequence[int],
        budget: int,
        prompt_lengths: Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
        tree: PrefixTree | None = None,
    ) -> float:
        """The cost, in this scheduler's workload model, of these samples (``lengths`` tokens each) laid out as this
        scheduler alone would lay them out under ``budget`` (``groups`` and ``tree`` as :meth:`plan` reads them): the
        sum over its passes, each as the partitioner costs it (a padded pass: rows x its longest). No collective:
        :mod:`hf_dynbsz.execution.layout_timing` predicts each candidate layout's step from it."""
        lengths = [int(length) for length in lengths]
        if not lengths:
            return 0.0
        prompts = [int(p) for p in prompt_lengths] if prompt_lengths is not None else [0] * len(lengths)
        completions = [n - p for n, p in zip(lengths, prompts)]
        units = self._tree(prompts, completions, groups, tree).units(budget)
        bins = partition_by_token_budget(
            [unit.tokens for unit in units],
            budget,
            num_microbatches=max(self._passes_needed(units, budget), 1),
            layout=self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            workload=self.workload,
            attention=self.attention,
            pairs=[unit.pairs for unit in units],
        )
        if self.layout == "padded":
            return sum(
                self.workload.cost([units[u].tokens for u in b], "padded", self.pad_to_multiple_of) for b in bins if b
            )
        return sum(sum(self._unit_costs([units[u] for u in b])) for b in bins)

    def _unit_costs(self, units: list[Unit]) -> list[float]:
        """Costs of units as the balancing sees them (the partitioner's workload model)."""
        return item_costs(
            [unit.tokens for unit in units],
            self.layout,
            self.workload,
            self.attention,
            self.pad_to_multiple_of,
            pairs=[unit.pairs for unit in units],
        ).tolist()

    def _passes_needed(self, units: list[Unit], budget: int) -> int:
        return min_num_microbatches(
            [unit.tokens for unit in units], budget, layout=self.layout, pad_to_multiple_of=self.pad_to_multiple_of
        )

    def _oversize(self, units: list[Unit], budget: int) -> list[int]:
        """Samples of the units longer than the budget (such a unit is one sample, alone in its pass)."""
        over = oversize_indices([unit.tokens for unit in units], budget, self.layout, self.pad_to_multiple_of)
        return [i for u in over for i in units[u].samples]

    def _partition(
        self,
        prompts: list[int],
        completions: list[int],
        tree: PrefixTree,
        units: list[Unit],
        budget: int,
        passes: int,
        needed: int,
    ) -> StepSchedule:
        """This process's units cut into exactly ``passes`` passes, the costliest first (empty ones last).

        Every pass is a synchronisation point of the processes (DDP broadcasts module buffers before each forward,
        ZeRO-3 gathers parameters in it), so a step takes the sum over passes of the slowest process's pass. Running
        every process's passes from the costliest down lines the heavy passes up with each other.
        """
        layout, pad = self.layout, self.pad_to_multiple_of
        bins = partition_by_token_budget(
            [unit.tokens for unit in units],
            budget,
            num_microbatches=max(passes, 1),
            layout=layout,
            pad_to_multiple_of=pad,
            workload=self.workload,
            attention=self.attention,
            pairs=[unit.pairs for unit in units],
        )
        costs = [sum(self._unit_costs([units[u] for u in b])) for b in bins]
        order = sorted(range(len(bins)), key=lambda b: (not bins[b], -costs[b], b))
        microbatches = [sorted(i for u in bins[b] for i in units[u].samples) for b in order]
        lengths = [p + c for p, c in zip(prompts, completions)]
        real = [b for b in order if bins[b]]
        counts = [tree.counts(microbatches[position]) for position in range(len(real))]  # (tokens, pairs, keys)
        shared = [tokens for tokens, _, _ in counts]
        if layout == "padding_free":
            pass_tokens = [round_up(tokens, pad) for tokens in shared]
            pass_pairs = [pairs for _, pairs, _ in counts]
            pass_path_keys = [path_keys for _, _, path_keys in counts]
        else:
            pass_tokens = [
                microbatch_tokens([lengths[i] for i in microbatches[position]], layout, pad)
                for position in range(len(real))
            ]
            pass_pairs = [tokens * tokens // len(microbatches[position]) for position, tokens in enumerate(pass_tokens)]
            pass_path_keys = [0] * len(real)
        return StepSchedule(
            microbatches=microbatches,
            budget=budget,
            passes_needed=needed,
            oversize=sorted(self._oversize(units, budget)),
            lengths=lengths,
            pass_tokens=pass_tokens,
            shared_tokens_saved=sum(lengths) - sum(shared),
            tree=tree if self.sharing else None,
            pass_pairs=pass_pairs,
            pass_path_keys=pass_path_keys,
        )

    def _oversize_error(
        self, units: list[Unit], lengths: list[int], longest_anywhere: int, budget: int, kind: str, elsewhere: str
    ):
        """The error every process raises when some sample is over the budget (``oversize_policy="error"``)."""
        oversize = sorted(self._oversize(units, budget))
        where, length, index, others = elsewhere, longest_anywhere, None, ""
        if oversize:
            index = oversize[0]
            where, length = f"sequence {index} of this process's step", lengths[index]
        if len(oversize) > 1:
            longest = max(oversize, key=lambda i: (lengths[i], -i))
            others = (
                f"; {len(oversize) - 1} more sequence(s) of this process are over the budget too, the longest "
                f"is sequence {longest} with {lengths[longest]} tokens"
            )
        size = self.sequence_parallel_size
        if size > 1:  # the setting is per device: a pass spans the group
            others += (
                f"; sequence_parallel_size={size} shares each pass over {size} processes: {budget} tokens per pass"
            )
            budget, longest_anywhere = budget // size, -(-longest_anywhere // size)
        return oversize_error(
            where,
            length,
            budget,
            layout=self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            longest=longest_anywhere,
            others=others,
            setting=BUDGET_SETTINGS[kind],
            index=index,
        )

    @staticmethod
    def oversize_warning(count: int, longest: int, budget: int, kind: str = "training") -> str:
        """The one warning of ``oversize_policy="warn"``: ``count`` sequences, the longest ``longest`` tokens."""
        return (
            f"hf_dynbsz: {count} sequence(s) longer than the token budget ({budget} tokens; longest {longest}) "
            f"each get a micro-batch of their own. Raise {BUDGET_SETTINGS[kind]} to avoid larger-than-budget passes."
        )


def simulate_processes(
    scheduler: Scheduler,
    lengths: Sequence[Sequence[int]],
    budgets: Sequence[int],
    prompt_lengths: Sequence[Sequence[int]] | None = None,
    kind: str = "training",
    groups: Sequence[Sequence[int]] | None = None,
    trees: Sequence[PrefixTree] | None = None,
    together: Sequence[Sequence[int]] | None = None,
) -> list:
    """The schedules ``len(lengths)`` processes would compute, each from its own ``lengths`` and budget
    (``groups`` / ``trees`` / ``together``: per process, what :meth:`Scheduler.plan` reads as ``groups`` / ``tree`` /
    ``together``).

    Runs the phases of :meth:`Scheduler.plan` for every simulated process in turn, in this thread: each process's
    part up to the collective, the collective computed directly over every process's values (what it returns on
    each), then each process's passes; with balancing, the decisions every process computes alike from the
    all-gather are computed once. The planner and the tests so run the code training runs. Returns each process's
    :class:`StepSchedule`, or the exception it raised (a process that fails before the collective leaves the others
    a ``RuntimeError``, as a real collective would).
    """
    count = len(lengths)
    balanced = scheduler._balances(count)

    def before_collective(rank: int):
        prompts = None if prompt_lengths is None else prompt_lengths[rank]
        request = scheduler._request(
            lengths[rank],
            budgets[rank],
            prompts,
            None if groups is None else groups[rank],
            None if trees is None else trees[rank],
            None if together is None else together[rank],
        )
        return request if balanced else scheduler._lockstep(request)

    own = [_attempt(before_collective, rank) for rank in range(count)]
    failed = [rank for rank, value in enumerate(own) if isinstance(value, Exception)]
    if failed:
        stopped = RuntimeError(f"simulated process {failed[0]} failed before the collective")
        return [value if isinstance(value, Exception) else stopped for value in own]
    if balanced:  # the all-gather: every process's values, in process order
        agreed = _attempt(scheduler._balancing, [request.values() for request in own])
        if isinstance(agreed, Exception):
            return [agreed] * count
        return [_attempt(scheduler._balanced_schedule, agreed, rank, kind) for rank in range(count)]
    agreed = [max(column) for column in zip(*(part.values() for part in own))]  # the all-reduce MAX
    return [_attempt(scheduler._in_lockstep, part, agreed, kind) for part in own]


def _keeps_together(piece: tuple[int, ...], unit: tuple[int, ...], together: Sequence[int]) -> bool:
    """Whether cutting ``piece`` off ``unit`` keeps every ``together`` id's samples on one side (a preference pair's
    chosen and rejected sequences always share a pass)."""
    inside = {together[i] for i in piece}
    return all(i in piece for i in unit if together[i] in inside)


def _piece(tree: PrefixTree, samples: tuple[int, ...]) -> Unit:
    """The unit of ``samples`` of ``tree`` (part of a unit cut by balancing): what they compute together, their
    shared path included."""
    return Unit(samples, *tree.counts(samples)[:2])


def _attempt(function, *args):
    """``function(*args)``, or the exception it raised (a simulated process's result)."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - returned to the caller, as the simulated process would raise it
        return error
