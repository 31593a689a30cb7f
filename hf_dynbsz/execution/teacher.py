"""A distillation teacher's no-grad passes: its last hidden states at every completion token of a step, by the
teacher's own token budget (torch layer).

Stock ``DistillationTrainer`` runs the teacher inside each student micro-batch: the same padded rows of
``per_device_train_batch_size`` samples, through ``_forward_redirection`` (so that DeepSpeed ZeRO-3 gathers the
teacher's partitioned parameters), under no grad, keeping its last hidden states for the divergence. Here the teacher
runs before the step's training passes, over the step's samples, in passes of its own through the executor's one
loop (:meth:`~hf_dynbsz.execution.executor.PassExecutor.run`, kind ``"teacher"``):

* its budget (tokens per device per pass) is ``max_tokens_per_microbatch_teacher``, or with a memory limit the
  largest whose predicted peak fits it (the teacher's own memory model), or else the log-prob rule at the
  teacher's size (:meth:`~hf_dynbsz.planning.schedule.Scheduler.budget`, :attr:`Scheduler.teacher_scale`);
* its passes are the pair's layout (padding-free rows where both models allow them: segment attention runs on the
  teacher's attention too), balanced across processes like a log-prob pass, with dummy passes for lockstep (ZeRO-3
  gathers the teacher's parameters in every forward) that run what a real pass runs: the teacher's backbone;
* the result, per sample, is the teacher's last hidden states at the positions that predict its completion tokens,
  ``(completion tokens, hidden size)`` in the teacher's output dtype, back on the process that owns the sample
  (:attr:`~hf_dynbsz.execution.batch.StepBatch.teacher_hidden`; only the states of samples another process ran
  travel, in that dtype); the step's training passes read them (and move them with the sample when balancing moves
  it);
* the memory model counts them (:func:`~hf_dynbsz.planning.memory.held_states_mib`): the teacher's passes are
  planned with room kept for the states they will hold by their last pass, the training passes with room for the
  states that arrive with moved samples.

A token's hidden state depends on its own sequence alone (the self-check compares each layout with the sample alone
on the teacher too), so the hidden states are stock's whatever the passes.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from accelerate.utils import is_peft_model
from torch.profiler import record_function

from hf_dynbsz.execution.attention import use_segments
from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.rope import use_rope_widths
from hf_dynbsz.planning.cost import config_value, text_config_of
from hf_dynbsz.planning.memory import held_states_mib

__all__ = ["Teacher", "backbone_hidden_states"]

#: The dtypes a teacher's hidden states can have (their index is what the processes agree on).
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass
class _TeacherPasses:
    """A teacher attempt's samples (after the exchange) and, per sample, its hidden states once its pass ran."""

    table: SequenceTable
    hidden: list[torch.Tensor | None]


class Teacher:
    """The teacher of a distillation run, as its passes need it: ``model`` the prepared teacher (a DeepSpeed engine
    under ZeRO, the accelerator's evaluation-mode model otherwise), ``unwrapped`` the model under it, ``redirect`` the
    trainer's ``_forward_redirection`` and ``hidden_size`` its last hidden states' width."""

    def __init__(self, trainer) -> None:
        self.model = trainer.teacher_model
        self.unwrapped = trainer.accelerator.unwrap_model(self.model)
        self.redirect = trainer._forward_redirection
        self.compute_context = trainer.compute_loss_context_manager
        self.hidden_size = int(config_value(text_config_of(self.unwrapped.config), "hidden_size", kind="size"))
        #: the hidden states' dtype, once a step has shown it (every process's; the weights' until then)
        self.dtype: torch.dtype | None = None

    @torch.no_grad()
    def hidden_states(self, executor, batch: StepBatch) -> None:
        """Fill ``batch.teacher_hidden``: the teacher's last hidden states at every completion token of every sample of
        ``batch`` (this process's), from the teacher's passes (``executor``'s loop, kind ``"teacher"``)."""
        table = batch.table
        with executor.meters.clock.phase("teacher"), self.compute_context():
            start = partial(self._start, executor, table)
            schedule, state = executor.run(
                self.model, "teacher", table, batch.stock_microbatch_tokens, start, partial(self._pass, executor),
                dummy=partial(self.dummy_pass, executor), reserve=partial(self.reserved_mib, table),
            )  # fmt: skip
            hidden = state.hidden
            if schedule.exchange is not None:  # the results go back to the process that owns each sample
                size, dtype = self.hidden_size, self._agreed_dtype(executor, hidden)
                own = executor.scheduler.group.send_to_owners(
                    [rows.reshape(-1) for rows in hidden], schedule.exchange, lambda p, c: c * size, dtype=dtype
                )
                hidden = [record.view(-1, size) for record in own]
            elif hidden:  # (every process runs its own samples: each sees the dtype)
                self.dtype = hidden[0].dtype
        batch.teacher_hidden, batch.teacher_hidden_size = hidden, self.hidden_size

    def reserved_mib(self, table: SequenceTable, schedule) -> float:
        """MiB of the hidden states this process's teacher passes will hold by their last pass (none of them is held
        when the passes are planned): those of the samples it runs (``schedule``'s exchange; its own before there is
        a schedule)."""
        completions = table.completion_lengths.tolist()
        exchange = None if schedule is None else schedule.exchange
        tokens = sum(completions) if exchange is None else sum(exchange.shapes[q][i][1] for q, i in exchange.incoming)
        return held_states_mib(tokens, self.hidden_size, self.element_size)

    @property
    def element_size(self) -> int:
        """Bytes per value of the hidden states (the weights' until a step has shown the states' dtype)."""
        dtype = self.dtype or next(self.unwrapped.parameters()).dtype
        return torch.empty((), dtype=dtype).element_size()

    def _agreed_dtype(self, executor, hidden: list[torch.Tensor]) -> torch.dtype:
        """The hidden states' dtype on every process (a process that ran no sample has none: one all-reduce, when the
        first step moves samples)."""
        if self.dtype is None:
            local = _STATE_DTYPES.index(hidden[0].dtype) if hidden and hidden[0].dtype in _STATE_DTYPES else -1
            agreed = executor.scheduler.group.all_reduce_max([local])[0]
            self.dtype = _STATE_DTYPES[agreed] if agreed >= 0 else torch.float32
        return self.dtype

    def _start(self, executor, table: SequenceTable, schedule) -> _TeacherPasses:
        run = table if schedule.exchange is None else executor.move(table, schedule.exchange)
        return _TeacherPasses(run, [None] * len(run))

    def _pass(self, executor, state: _TeacherPasses, schedule, group: list[int], last: bool) -> None:
        """One teacher pass: the backbone over the pass's row, its hidden states at each completion token kept per
        sample."""
        with record_function("dynbsz/pack"):
            mb = executor.microbatch(state.table, group)
        with record_function("dynbsz/teacher_forward"):
            hidden = self._forward(mb)
        completion = mb.completion_mask.bool()
        picked = hidden.reshape(-1, hidden.size(-1))[mb.gather_index[completion]]
        for index, rows in zip(group, picked.split(completion.sum(1).tolist())):
            state.hidden[index] = rows

    def _forward(self, mb) -> torch.Tensor:
        """The teacher's last hidden states over ``mb``'s rows, through its wrapper as stock runs it."""
        use_segments(mb.segments)
        use_rope_widths(mb.rope_widths)
        return self.redirect(self.model, self.unwrapped, backbone_hidden_states, self.unwrapped, mb.model_inputs)

    def dummy_pass(self, executor, model, last=None) -> None:
        """A lockstep pass: the teacher's backbone over a tiny row, as a real pass runs it (under ZeRO-3 the same
        parameter gathers)."""
        self._forward(executor.lockstep_microbatch())


def backbone_hidden_states(unwrapped, model_inputs: dict) -> torch.Tensor:
    """The last hidden states of ``unwrapped`` (a model, or a PEFT model) over one pass's rows, as stock's
    ``_get_last_hidden_state`` runs it: the backbone under the LM head (``base_model``), no KV cache."""
    if is_peft_model(unwrapped):
        unwrapped = unwrapped.base_model.model
    return unwrapped.base_model(**model_inputs, use_cache=False).last_hidden_state
