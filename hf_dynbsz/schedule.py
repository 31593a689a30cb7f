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
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from .balance import Assignment, assign
from .partition import (
    WorkloadModel,
    item_costs,
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
        return [(origin, index) for origin, targets in enumerate(self.destination)
                for index, target in enumerate(targets) if target == self.rank]


@dataclass(frozen=True)
class StepSchedule:
    """The passes of one optimizer step (or one no-grad log-prob call) on this process.

    ``microbatches``: sample indices per pass, in execution order; an empty list is a dummy pass that keeps this
    process in lockstep with busier ones. Indices refer to the samples this process runs: its own, or after a
    cross-rank ``exchange`` (None when nothing moves) those of :attr:`Exchange.incoming`, whose token counts are
    ``lengths``. ``budget``: tokens per pass (per device), as :func:`~hf_dynbsz.partition.microbatch_tokens`
    counts them. ``passes_needed``: how many passes this process alone would have run. ``oversize``: indices of the
    samples longer than the budget (each ran alone). ``balance``: the cross-rank assignment when balancing ran.
    """

    microbatches: list[list[int]]
    budget: int
    passes_needed: int
    oversize: list[int]
    lengths: list[int]
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

    def computed_tokens(self, layout: str, pad_to_multiple_of: int | None = None) -> list[int]:
        """Token positions each real pass computes (padding included), in pass order."""
        return [microbatch_tokens([self.lengths[i] for i in group], layout, pad_to_multiple_of)
                for group in self.microbatches if group]


@dataclass(frozen=True)
class Scheduler:
    """The scheduling decisions of one run: layout, budgets, oversize policy, balancing, lockstep.

    Build it with :meth:`from_args`; every process of a run holds an equal one (``group`` aside).
    """

    layout: str
    attention: str
    workload: WorkloadModel
    pad_to_multiple_of: int | None = None
    oversize_policy: str = "warn"
    max_tokens_per_microbatch: int | None = None
    max_tokens_per_microbatch_logprob: int | None = None
    balance_across_ranks: bool = True
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
            balance_across_ranks=getattr(args, "balance_across_ranks", setting("balance_across_ranks").default),
            group=group,
        )

    def budget(self, stock_tokens: int, kind: str = "training") -> int:
        """Tokens per pass of ``kind`` ("training" or "logprob"), per device.

        ``stock_tokens`` is the size of stock TRL's own micro-batch for the same samples (rows x padded width,
        see :func:`stock_microbatch_tokens`): the training budget when ``max_tokens_per_microbatch`` is unset,
        so memory is never worse than stock's. No-grad passes keep no activations for backward: their default is
        twice the training budget. With cross-rank balancing, :meth:`plan` raises an automatic budget to the
        largest of all processes' (stock's peak memory is that of its largest micro-batch on any device).
        """
        training = self.max_tokens_per_microbatch or stock_tokens
        if kind == "training":
            return training
        if kind == "logprob":
            return self.max_tokens_per_microbatch_logprob or 2 * training
        raise ValueError(f"kind must be one of {', '.join(map(repr, BUDGET_SETTINGS))}, got {kind!r}")

    def plan(self, lengths: Sequence[int], budget: int, kind: str = "training",
             prompt_lengths: Sequence[int] | None = None) -> StepSchedule:
        """Partition this process's samples (``lengths``: prompt + completion tokens each) into passes.

        Every process calls this with its own samples at the same point of the step. Without balancing one
        all-reduce agrees on the pass count (the most any process needs) and on the longest oversize sequence
        anywhere; with ``balance_across_ranks`` on several processes, one all-gather of every sample's lengths
        (``prompt_lengths`` gives the split the exchange needs) lets every process compute the same assignment of
        samples to processes (:mod:`hf_dynbsz.balance`) and the pass count. ``oversize_policy="error"`` stops
        every process with the same message, before any pass runs.
        """
        lengths = [int(length) for length in lengths]
        if self.balance_across_ranks and self.group.num_processes > 1:
            return self._plan_balanced(lengths, budget, kind, prompt_lengths)
        layout, pad = self.layout, self.pad_to_multiple_of
        oversize = oversize_indices(lengths, budget, layout, pad)
        needed = min_num_microbatches(lengths, budget, layout=layout, pad_to_multiple_of=pad)
        longest_oversize = max((lengths[i] for i in oversize), default=0)
        passes, longest_anywhere = self.group.all_reduce_max([needed, longest_oversize])
        if longest_anywhere and self.oversize_policy == "error":
            raise self._oversize_error(lengths, longest_anywhere, budget, kind, "a sequence on another process")
        return self._partition(lengths, budget, passes, needed)

    def _plan_balanced(self, lengths: list[int], budget: int, kind: str,
                       prompt_lengths: Sequence[int] | None) -> StepSchedule:
        """:meth:`plan` with cross-rank balancing: one all-gather, then the same decisions on every process."""
        layout, pad, rank = self.layout, self.pad_to_multiple_of, self.group.rank
        prompts = [int(p) for p in prompt_lengths] if prompt_lengths is not None else [0] * len(lengths)
        gathered = self.group.all_gather([budget, *[v for p, n in zip(prompts, lengths) for v in (p, n - p)]])
        budget = max(values[0] for values in gathered)  # automatic budgets differ: the largest is stock's bound
        shapes = [list(zip(values[1::2], values[2::2])) for values in gathered]
        everyone = [[p + c for p, c in process_shapes] for process_shapes in shapes]
        if self.oversize_policy == "error":
            over = [max((process[i] for i in oversize_indices(process, budget, layout, pad)), default=0)
                    for process in everyone]
            if max(over):
                elsewhere = f"a sequence on process {next(p for p, longest in enumerate(over) if longest)}"
                raise self._oversize_error(lengths, max(over), budget, kind, elsewhere)
        assignment = assign([item_costs(process, layout, self.workload, self.attention, pad).tolist()
                             for process in everyone])
        destinations, runs, units = [], [[] for _ in shapes], iter(assignment.destination)
        for process in everyone:
            destinations.append([next(units) for _ in process])
            for length, target in zip(process, destinations[-1]):
                runs[target].append(length)  # in (origin process, index) order, as Exchange.incoming
        passes = max(min_num_microbatches(run, budget, layout=layout, pad_to_multiple_of=pad) for run in runs)
        needed = min_num_microbatches(runs[rank], budget, layout=layout, pad_to_multiple_of=pad)
        exchange = Exchange(rank, shapes, destinations) if assignment.moved else None
        return dataclasses.replace(self._partition(runs[rank], budget, passes, needed), exchange=exchange,
                                   balance=assignment)

    def _partition(self, lengths: list[int], budget: int, passes: int, needed: int) -> StepSchedule:
        """This process's samples cut into exactly ``passes`` passes, the costliest first (empty ones last).

        Every pass is a synchronisation point of the processes (DDP broadcasts module buffers before each forward,
        ZeRO-3 gathers parameters in it), so a step takes the sum over passes of the slowest process's pass. Running
        every process's passes from the costliest down lines the heavy passes up with each other.
        """
        layout, pad = self.layout, self.pad_to_multiple_of
        microbatches = partition_by_token_budget(lengths, budget, num_microbatches=max(passes, 1), layout=layout,
                                                 pad_to_multiple_of=pad, workload=self.workload,
                                                 attention=self.attention)
        costs = [self.workload.cost([lengths[i] for i in group], layout, pad, self.attention) for group in microbatches]
        order = sorted(range(len(microbatches)), key=lambda b: (not microbatches[b], -costs[b], b))
        return StepSchedule(microbatches=[microbatches[b] for b in order], budget=budget, passes_needed=needed,
                            oversize=oversize_indices(lengths, budget, layout, pad), lengths=lengths)

    def _oversize_error(self, lengths: list[int], longest_anywhere: int, budget: int, kind: str, elsewhere: str):
        """The error every process raises when some sample is over the budget (``oversize_policy="error"``)."""
        oversize = oversize_indices(lengths, budget, self.layout, self.pad_to_multiple_of)
        where, length = elsewhere, longest_anywhere
        if oversize:
            where, length = f"sequence {oversize[0]} of this process's step", lengths[oversize[0]]
        return oversize_error(where, length, budget, layout=self.layout, pad_to_multiple_of=self.pad_to_multiple_of,
                              longest=longest_anywhere, setting=BUDGET_SETTINGS[kind])

    @staticmethod
    def oversize_warning(count: int, longest: int, budget: int, kind: str = "training") -> str:
        """The one warning of ``oversize_policy="warn"``: ``count`` sequences, the longest ``longest`` tokens."""
        return (
            f"hf_dynbsz: {count} sequence(s) longer than the token budget ({budget} tokens; longest {longest}) "
            f"each get a micro-batch of their own. Raise {BUDGET_SETTINGS[kind]} to avoid larger-than-budget passes."
        )


def simulate_processes(scheduler: Scheduler, lengths: Sequence[Sequence[int]], budgets: Sequence[int],
                       prompt_lengths: Sequence[Sequence[int]] | None = None, kind: str = "training") -> list:
    """The schedules ``num_processes`` processes would compute, each from its own ``lengths`` and budget.

    Runs :meth:`Scheduler.plan` once per simulated process, in threads that meet at real (barrier-synchronised)
    collectives, so the planner and the tests exercise exactly the code training runs. Returns each process's
    :class:`StepSchedule`, or the exception it raised.
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    count = len(lengths)
    posted: dict[tuple[int, int], list[int]] = {}  # (collective number, process) -> values
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
                condition.notify_all()
                if not condition.wait_for(lambda: failed or all((call, p) in posted for p in range(count)), 60):
                    raise TimeoutError("a simulated process did not reach the collective")
                if failed and not all((call, p) in posted for p in range(count)):
                    raise RuntimeError(f"simulated process {failed[0]} failed before the collective")
                return [list(posted[call, p]) for p in range(count)]

        def all_reduce_max(self, values: list[int]) -> list[int]:
            return [max(column) for column in zip(*self.all_gather(values))]

    def run(rank: int):
        try:
            planner = dataclasses.replace(scheduler, group=_Simulated(rank))
            prompts = None if prompt_lengths is None else prompt_lengths[rank]
            return planner.plan(lengths[rank], budgets[rank], kind, prompt_lengths=prompts)
        except Exception as error:  # noqa: BLE001 - returned to the caller, as every process would raise it
            with condition:
                failed.append(rank)
                condition.notify_all()
            return error

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))
