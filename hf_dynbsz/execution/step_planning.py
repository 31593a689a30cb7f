"""Planning a call's passes (torch layer): the token budget, from memory where a limit is set, the step's prefix tree,
the scheduler's plan, and the one warning for sequences over the budget.

:class:`StepPlanning` is a part of :class:`~hf_dynbsz.execution.executor.PassExecutor` (its base), kept apart so
that the executor's module holds the pass loop alone. It reads the executor's ``scheduler`` (which the self-check
may replace), ``memory`` (:class:`~hf_dynbsz.planning.memory.MemoryModel`), ``meters``, ``parallel`` and
``warned``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.planning.memory import FIT_REPLANS
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.planning.settings import SharePrefix

__all__ = ["StepPlanning"]


class StepPlanning:
    """The schedule of a call's passes (:meth:`_planned`) and what it warns about (:meth:`_warn_oversize`)."""

    def _planned(self, table: SequenceTable, stock_tokens: int, kind: str, reserve: Callable[[object], float]):
        """The schedule of ``table``'s ``kind`` passes: under the token budget of :meth:`Scheduler.budget`; with a
        memory limit the largest whose predicted peak fits (:meth:`MemoryModel.budget`, by the step's path keys per
        token and what ``reserve`` says the passes will hold), planned again smaller while a planned pass does not fit
        (:meth:`MemoryModel.fitting_budget`), every process agreeing on each budget."""
        memory, scheduler = self.memory, self.scheduler
        if memory.limit_mib is None:
            return self._plan(table, scheduler.budget(stock_tokens, kind, cap=memory.caps.get(kind)), kind)
        held = self.meters.memory.held()
        tree = self._step_tree(table)
        keys_per_token = tree.path_keys() / max(tree.tokens(), 1) if tree is not None else 0.0
        longest = max(table.lengths.tolist(), default=1)
        fits = memory.budget(kind, held, longest, keys_per_token, reserve(None))
        budget = scheduler.budget(stock_tokens, kind, fits=fits, cap=memory.caps.get(kind), agree=True)
        schedule = self._plan(table, budget, kind)
        for _ in range(FIT_REPLANS):
            passes = [
                (*self.parallel.per_process(shape), len(group))
                for shape, group in zip(schedule.pass_shapes(), filter(None, schedule.microbatches))
            ]
            fits = memory.fitting_budget(kind, held, budget // self.parallel.size, passes, reserve(schedule))
            smaller = scheduler.budget(stock_tokens, kind, fits=fits, cap=memory.caps.get(kind), agree=True)
            if smaller >= budget:
                break
            budget, schedule = smaller, self._plan(table, smaller, kind)
        return schedule

    def _step_tree(self, table: SequenceTable):
        """The prefix tree the step's samples share positions by (None when they share nothing)."""
        sharing = self.scheduler.sharing
        if sharing is SharePrefix.TREE:
            return table.prefix_tree(sharing)
        if sharing is SharePrefix.GROUPS:
            return table.group_tree()
        return None

    def _plan(self, table: SequenceTable, budget: int, kind: str):
        """The schedule of ``table``'s samples: with shared prompts, its prompt groups (found by prompt ids), with a
        prefix tree its samples' tree; training passes keep the table's ``together`` groups in one pass (no-grad
        passes compute each sample's own values)."""
        sharing = self.scheduler.sharing
        return self.scheduler.plan(
            table.lengths.tolist(),
            budget,
            kind,
            prompt_lengths=table.prompt_lengths.tolist(),
            groups=table.prompt_groups() if sharing is SharePrefix.GROUPS else None,
            tree=table.prefix_tree(sharing) if sharing is SharePrefix.TREE else None,
            together=table.together if kind == "training" else None,
        )

    def _warn_oversize(self, schedule, kind: str) -> None:
        if not schedule.oversize or kind in self.warned:
            return
        self.warned.add(kind)
        longest = max(schedule.lengths[i] for i in schedule.oversize)
        if longest <= schedule.budget:  # samples that always run together (a preference pair) are over it together
            over = set(schedule.oversize)
            longest = max(t for group, t in zip(schedule.microbatches, schedule.pass_tokens) if over & set(group))
        message = Scheduler.oversize_warning(len(schedule.oversize), longest, schedule.budget, kind)
        memory = self.memory
        if memory.limit_mib is not None:  # the budget came from memory: say what the sequence needs
            message += (
                f" The budget follows max_memory_per_device_mib={memory.limit_mib:.0f}: a sequence of "
                f"{longest} tokens alone is predicted to add about "
                f"{memory.increment(kind, longest, longest * longest):.0f} MiB to what the process holds, "
                "which may not fit; lower max_completion_length, turn on gradient checkpointing or raise "
                "the limit."
            )
        warnings.warn(message + " This warning is shown once.", stacklevel=4)
