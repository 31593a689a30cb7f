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

from hf_dynbsz.planning.balance import Assignment, assign
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
from hf_dynbsz.planning.settings import setting
from hf_dynbsz.planning.tokens import microbatch_tokens, round_up

__all__ = [
    "RankGroup",
    "SINGLE_PROCESS",
    "Scheduler",
    "StepSchedule",
    "Unit",
    "build_units",
    "row_tokens",
    "sharing_tree",
    "simulate_processes",
    "stock_microbatch_tokens",
]

#: Pass kinds and the setting that gives each its budget.
BUDGET_SETTINGS = {"training": "max_tokens_per_microbatch", "logprob": "max_tokens_per_microbatch_logprob"}


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
        return [
            (origin, index)
            for origin, targets in enumerate(self.destination)
            for index, target in enumerate(targets)
            if target == self.rank
        ]


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
    computes (shared positions once, padding included); ``prompt_tokens_saved``: the tokens not computed thanks to
    sharing (prompts, and with a prefix tree any shared prefix). ``balance``: the cross-rank assignment when balancing
    ran. ``pass_pairs``: each real pass's attention term (:meth:`PrefixTree.pairs`: squared sequence lengths for
    samples sharing nothing; rows x width^2 for padded passes), which the memory model reads.
    """

    microbatches: list[list[int]]
    budget: int
    passes_needed: int
    oversize: list[int]
    lengths: list[int]
    pass_tokens: list[int]
    prompt_tokens_saved: int = 0
    pass_pairs: list[int] | None = None
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

    @property
    def samples_moved(self) -> int:
        """Samples of all processes that run on another process than their own (0 without an exchange)."""
        if self.exchange is None:
            return 0
        return sum(target != origin for origin, targets in enumerate(self.exchange.destination) for target in targets)


@dataclass(frozen=True)
class Scheduler:
    """The scheduling decisions of one run: layout, budgets, oversize policy, shared prompts, balancing, lockstep.

    Build it with :meth:`from_args`; every process of a run holds an equal one (``group`` aside). ``layout`` is
    ``"padding_free"`` or ``"padded"``, ``attention`` the cost kind the partitioner balances (``"varlen"`` or
    ``"dense"``), ``segment_attention`` the base implementation segment attention runs (None: the model's own
    attention), ``segment_recurrence`` whether the model's sequence mixers run per sequence of a padding-free row,
    ``attention_mask`` whether padded rows carry a mask, ``position_offset`` the first position id.
    ``share_prompts`` is on only where it is exact: padding-free rows through segment attention; ``prefix_tree``
    shares every prefix the samples of a pass have in common, not only each prompt in its group.
    """

    layout: str
    attention: str
    workload: WorkloadModel
    pad_to_multiple_of: int | None = None
    oversize_policy: str = "warn"
    max_tokens_per_microbatch: int | None = None
    max_tokens_per_microbatch_logprob: int | None = None
    balance_across_ranks: bool = True
    share_prompts: bool = False
    segment_attention: str | None = None
    segment_recurrence: bool = False
    attention_mask: bool = False
    position_offset: int = 0
    group: RankGroup = SINGLE_PROCESS
    #: processes sharing each pass's row (:mod:`hf_dynbsz.execution.sequence_parallel`): a pass holds this many budgets
    sequence_parallel_size: int = 1
    prefix_tree: bool = False

    @property
    def sharing(self) -> str | None:
        """The sharing rule of this scheduler's rows (:attr:`Layout.sharing`): "tree", "groups" or None."""
        return ("tree" if self.prefix_tree else "groups") if self.share_prompts else None

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
            balance_across_ranks=bool(balance) and not images_stay_on_their_process(support.vision_language),
            share_prompts=layout.share_prompts,
            segment_attention=layout.segment_attention,
            segment_recurrence=layout.segment_recurrence,
            attention_mask=layout.attention_mask,
            position_offset=support.position_offset,
            group=group,
            sequence_parallel_size=int(getattr(args, "sequence_parallel_size", 1) or 1),
            prefix_tree=layout.prefix_tree,
        )

    def describe(self) -> str:
        """The layout this scheduler runs, as :meth:`Layout.describe` phrases it (logs, reports)."""
        return Layout(
            self.layout,
            self.share_prompts,
            self.segment_attention,
            self.attention_mask,
            self.attention,
            segment_recurrence=self.segment_recurrence,
            prefix_tree=self.prefix_tree,
        ).describe()

    def budget(
        self,
        stock_tokens: int,
        kind: str = "training",
        fits: int | None = None,
        cap: int | None = None,
        agree: bool = False,
    ) -> int:
        """Tokens per pass of ``kind`` ("training" or "logprob"): per device, times ``sequence_parallel_size`` (a
        sharded pass's row spans its group's devices).

        ``stock_tokens`` is the size of stock TRL's own micro-batch for the same samples (rows x padded width,
        see :func:`stock_microbatch_tokens`): the training budget when ``max_tokens_per_microbatch`` is unset,
        so memory is never worse than stock's. No-grad passes keep no activations for backward: their default is
        twice the training budget. With cross-rank balancing, :meth:`plan` raises an automatic budget to the
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
            budget = self.max_tokens_per_microbatch_logprob or (
                fits if fits is not None and not self.max_tokens_per_microbatch else 2 * training
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
    ) -> StepSchedule:
        """Partition this process's samples (``lengths``: prompt + completion tokens each) into passes.

        ``prompt_lengths`` split the lengths (the exchange and shared prompts need them). When ``share_prompts`` is
        on, ``tree`` (the samples' :class:`~hf_dynbsz.planning.prefix_tree.PrefixTree`) or else ``groups`` (one id
        per sample, equal ids = identical prompt tokens: the prompt-group rule) says which positions samples share
        within a pass. Every process calls this with its own samples at the same point of the step.
        Without balancing one all-reduce agrees on the pass count (the most any process needs) and on the longest
        oversize sequence anywhere; with ``balance_across_ranks`` on several processes, one all-gather of every
        sample's lengths and prefix tree lets every process compute the same assignment of units to processes
        (:mod:`hf_dynbsz.planning.balance`) and the pass count. ``oversize_policy="error"`` stops every process with the
        same message, before any pass runs.
        """
        lengths = [int(length) for length in lengths]
        prompts = [int(p) for p in prompt_lengths] if prompt_lengths is not None else [0] * len(lengths)
        completions = [n - p for n, p in zip(lengths, prompts)]
        tree = self._tree(prompts, completions, groups, tree)
        if self.balance_across_ranks and self.group.num_processes > 1:
            return self._plan_balanced(prompts, completions, tree, budget, kind)
        units = tree.units(budget)
        needed = self._passes_needed(units, budget)
        longest_oversize = max((lengths[i] for i in self._oversize(units, budget)), default=0)
        passes, longest_anywhere = self.group.all_reduce_max([needed, longest_oversize])
        if longest_anywhere and self.oversize_policy == "error":
            raise self._oversize_error(units, lengths, longest_anywhere, budget, kind, "a sequence on another process")
        return self._partition(prompts, completions, tree, units, budget, passes, needed)

    def _tree(
        self, prompts: list[int], completions: list[int], groups: Sequence[int] | None, tree: PrefixTree | None
    ) -> PrefixTree:
        """The prefix tree the samples are planned by: ``tree``, else the prompt-group rule's of ``groups``; every
        sample alone when nothing is shared (``share_prompts`` off, or neither given)."""
        if not self.share_prompts or (tree is None and groups is None):
            return PrefixTree.alone([p + c for p, c in zip(prompts, completions)])
        if tree is not None:
            if tree.samples != len(prompts):
                raise ValueError(f"the prefix tree holds {tree.samples} samples, the step {len(prompts)}")
            return tree
        return PrefixTree.of_groups(prompts, completions, [int(g) for g in groups])

    def _plan_balanced(
        self, prompts: list[int], completions: list[int], tree: PrefixTree, budget: int, kind: str
    ) -> StepSchedule:
        """:meth:`plan` with cross-rank balancing: one all-gather, then the same decisions on every process."""
        rank, count = self.group.rank, self.group.num_processes
        gathered = self.group.all_gather(
            [budget, len(prompts), *[v for sample in zip(prompts, completions) for v in sample], *tree.encode()]
        )
        budget = max(values[0] for values in gathered)  # automatic budgets differ: the largest is stock's bound
        shapes = [
            list(zip(values[2 : 2 + 2 * values[1] : 2], values[3 : 2 + 2 * values[1] : 2])) for values in gathered
        ]
        trees = [PrefixTree.decode(values[2 + 2 * values[1] :])[0] for values in gathered]
        units = [trees[q].units(budget) for q in range(count)]
        if self.oversize_policy == "error":
            over = [
                max((shapes[q][i][0] + shapes[q][i][1] for i in self._oversize(units[q], budget)), default=0)
                for q in range(count)
            ]
            if max(over):
                elsewhere = f"a sequence on process {next(q for q, longest in enumerate(over) if longest)}"
                raise self._oversize_error(
                    units[rank], [p + c for p, c in shapes[rank]], max(over), budget, kind, elsewhere
                )
        assignment = assign([self._unit_costs(process_units) for process_units in units])
        exchange, runs = _exchanged(rank, shapes, units, assignment)
        passes = max(self._passes_needed(run, budget) for run in runs)
        local = exchange.incoming
        schedule = self._partition(
            [shapes[q][i][0] for q, i in local],
            [shapes[q][i][1] for q, i in local],
            PrefixTree.joined([(trees[q], i) for q, i in local]),
            sorted(runs[rank], key=lambda unit: unit.samples[0]),
            budget,
            passes,
            self._passes_needed(runs[rank], budget),
        )
        return dataclasses.replace(schedule, exchange=exchange if assignment.moved else None, balance=assignment)

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
        shared = [tree.tokens(microbatches[position]) for position in range(len(real))]
        if layout == "padding_free":
            pass_tokens = [round_up(tokens, pad) for tokens in shared]
            pass_pairs = [tree.pairs(microbatches[position]) for position in range(len(real))]
        else:
            pass_tokens = [
                microbatch_tokens([lengths[i] for i in microbatches[position]], layout, pad)
                for position in range(len(real))
            ]
            pass_pairs = [tokens * tokens // len(microbatches[position]) for position, tokens in enumerate(pass_tokens)]
        return StepSchedule(
            microbatches=microbatches,
            budget=budget,
            passes_needed=needed,
            oversize=sorted(self._oversize(units, budget)),
            lengths=lengths,
            pass_tokens=pass_tokens,
            prompt_tokens_saved=sum(lengths) - sum(shared),
            tree=tree if self.share_prompts else None,
            pass_pairs=pass_pairs,
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


def _exchanged(rank: int, shapes, units: list[list[Unit]], assignment: Assignment) -> tuple[Exchange, list[list[Unit]]]:
    """The exchange of a balanced step (every process's units sent where ``assignment`` puts them) and the units each
    process runs, in its own numbering of its samples after the exchange (this process's) or the sender's."""
    count = len(units)
    targets = iter(assignment.destination)
    destinations = [[0] * len(process) for process in shapes]
    for q in range(count):
        for unit in units[q]:
            target = next(targets)
            for i in unit.samples:
                destinations[q][i] = target
    exchange = Exchange(rank, shapes, destinations)
    local_index = {origin: j for j, origin in enumerate(exchange.incoming)}
    runs = [[] for _ in range(count)]  # units each process runs, in its own sample numbering
    for q in range(count):
        for unit in units[q]:
            target = destinations[q][unit.samples[0]]
            samples = tuple(sorted(local_index[q, i] for i in unit.samples)) if target == rank else unit.samples
            runs[target].append(Unit(samples, unit.tokens, unit.pairs))
    return exchange, runs


def simulate_processes(
    scheduler: Scheduler,
    lengths: Sequence[Sequence[int]],
    budgets: Sequence[int],
    prompt_lengths: Sequence[Sequence[int]] | None = None,
    kind: str = "training",
    groups: Sequence[Sequence[int]] | None = None,
    trees: Sequence[PrefixTree] | None = None,
) -> list:
    """The schedules ``num_processes`` processes would compute, each from its own ``lengths`` and budget.

    ``groups`` / ``trees``: per process, what :meth:`Scheduler.plan` reads as ``groups`` / ``tree``. Runs
    :meth:`Scheduler.plan` once per simulated process, in threads that meet at real (barrier-synchronised)
    collectives, so the planner and the tests exercise exactly the code training runs. Returns each process's
    :class:`StepSchedule`, or the exception it raised.
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    count = len(lengths)
    posted: dict[tuple[int, int], list[int]] = {}  # (collective number, process) -> values
    arrived: dict[int, int] = {}  # collective number -> processes that posted
    failed: list[int] = []
    condition = threading.Condition()

    class _Simulated:
        num_processes = count

        def __init__(self, rank: int) -> None:
            self.rank, self.calls = rank, 0

        def all_gather(self, values: list[int]) -> list[list[int]]:
            call, self.calls = self.calls, self.calls + 1
            with condition:
                posted[call, self.rank] = list(values)
                arrived[call] = arrived.get(call, 0) + 1
                if arrived[call] == count:  # the last one wakes the others (not every arrival: P^2 wake-ups)
                    condition.notify_all()
                if not condition.wait_for(lambda: failed or arrived[call] == count, 60):
                    raise TimeoutError("a simulated process did not reach the collective")
                if arrived[call] < count:
                    raise RuntimeError(f"simulated process {failed[0]} failed before the collective")
                return [list(posted[call, p]) for p in range(count)]

        def all_reduce_max(self, values: list[int]) -> list[int]:
            return [max(column) for column in zip(*self.all_gather(values))]

    def run(rank: int):
        try:
            planner = dataclasses.replace(scheduler, group=_Simulated(rank))
            prompts = None if prompt_lengths is None else prompt_lengths[rank]
            return planner.plan(
                lengths[rank],
                budgets[rank],
                kind,
                prompt_lengths=prompts,
                groups=None if groups is None else groups[rank],
                tree=None if trees is None else trees[rank],
            )
        except Exception as error:  # noqa: BLE001 - returned to the caller, as every process would raise it
            with condition:
                failed.append(rank)
                condition.notify_all()
            return error

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))
