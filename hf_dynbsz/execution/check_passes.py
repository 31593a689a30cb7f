"""The self-check's passes: what it measures, and nothing it decides (torch layer).

:mod:`hf_dynbsz.execution.self_check` decides: which layouts to check and on which samples, what their differences
from each sample computed alone conclude, what the run keeps and logs, stock math where no layout passes. It calls
into this module, which only measures: :class:`CheckPasses` runs one pass over a few samples in a layout, or one
sample alone, through the executor's own collator, segments and forward (the methods of its base
:class:`~hf_dynbsz.execution.device_pass.DevicePass`), and returns the completion log-probs, and the gradients of
:func:`check_loss` with respect to :func:`checked_parameters`, as a :class:`Probe`: tensors, no verdict. Calls go one
way: nothing here calls the self-check, nor the executor's loop, recovery or collectives; an error a pass raises goes
up to the self-check as it is, which decides what it means.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from hf_dynbsz.execution.device_memory import injected_fault
from hf_dynbsz.execution.packing import MicroBatch, SequenceTable, build_microbatch
from hf_dynbsz.execution.rope import stock_rope
from hf_dynbsz.planning.model_support import Layout

__all__ = [
    "GRADIENT_COMPLETION",
    "CheckPasses",
    "Probe",
    "alone_microbatch",
    "check_loss",
    "checked_parameters",
    "gradient_table",
    "gradients_of",
]


@dataclass(frozen=True)
class Probe:
    """One pass of the check: completion log-probs ``(rows, width)``, and the gradients of :func:`check_loss` with
    respect to the checked parameters (name to tensor; None where the pass computed none)."""

    logps: torch.Tensor
    gradients: dict[str, torch.Tensor] | None = None


class CheckPasses:
    """The check's passes for one run, through the executor's own collator, segments and forward (torch layer): what
    they measure, as a :class:`Probe` each; the self-check decides what it means.

    ``executor``: the run's :class:`~hf_dynbsz.execution.executor.PassExecutor`, whose accelerator and pad token the
    passes read and whose :class:`~hf_dynbsz.execution.device_pass.DevicePass` methods they call (``microbatch``,
    ``segments``, ``forward``: nothing that plans, recovers or agrees); ``model``: the prepared model;
    ``schedulers``: one per layout (the layout's collator and segment settings); ``unsharded``: sequence parallelism
    of size 1 (the check's passes are unsharded, whatever the run's); ``gradients``: whether the passes compute
    gradients (see :meth:`gradients_skipped`). A pass runs the unwrapped model: the check's gradients go through
    ``torch.autograd.grad`` and reach neither the parameters' ``.grad`` nor DDP's or DeepSpeed's hooks.
    """

    def __init__(self, executor, model, table: SequenceTable, schedulers: dict, unsharded, gradients: bool) -> None:
        self.executor, self.schedulers, self.unsharded = executor, schedulers, unsharded
        self.tables = {False: table, True: gradient_table(table)}  # by whether a pass computes gradients
        self.model = executor.accelerator.unwrap_model(model)
        self.parameters = checked_parameters(self.model) if gradients else []

    @staticmethod
    def gradients_skipped(executor, model) -> str | None:
        """Why these passes measure log-probs only (the check then compares those alone), or None: under ZeRO-3
        and FSDP a process holds a shard of each parameter (``torch.autograd.grad`` cannot give a parameter's whole
        gradient; under FSDP it would answer zeros, as the forward computes with gathered copies), and reentrant
        gradient checkpointing does not support ``torch.autograd.grad``."""
        plugin = getattr(executor.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and plugin.zero_stage == 3:
            return "DeepSpeed ZeRO-3 partitions the parameters"
        if executor.accelerator.distributed_type == DistributedType.FSDP:
            return "FSDP shards the parameters (a forward computes with gathered copies of them)"
        kwargs = getattr(executor.args, "gradient_checkpointing_kwargs", None) or {}
        if executor.args.gradient_checkpointing and kwargs.get("use_reentrant"):
            return "reentrant gradient checkpointing (use_reentrant=True) does not support torch.autograd.grad"
        if not any(p.requires_grad for p in model.parameters()):
            return "no trainable parameters"
        return None

    def alone(self, index: int, gradients: bool) -> Probe:
        """Sample ``index`` alone (:func:`alone_microbatch`), with its gradients when ``gradients``; a LongRoPE model
        gives it the factors of stock's micro-batch that holds it (:mod:`hf_dynbsz.execution.rope`), as passes do."""
        executor, table = self.executor, self.tables[gradients]
        mb = alone_microbatch(table, index, executor.pad_token_id, executor.accelerator.device)
        with stock_rope(self.model):
            return self._probe(mb, table, [index], gradients)

    def layout(self, layout: Layout, indices: list[int], gradients: bool) -> Probe:
        """One pass over ``indices`` in ``layout``, with gradients when ``gradients``. The check's first pass of a
        layout has none: sequence mixers decide there whether their blocks start from their prefix's states
        (:func:`~hf_dynbsz.execution.recurrence.prefix_states`), so that a pass with gradients, and gradient
        checkpointing's recomputation of it, take the path training will take."""
        executor, scheduler, table = self.executor, self.schedulers[layout], self.tables[gradients]
        mb = executor.microbatch(table, indices, scheduler)
        with executor.segments(self.model, scheduler, self.unsharded):
            return self._probe(mb, table, indices, gradients)

    def _forward(self, mb) -> torch.Tensor:
        with injected_fault(self.model, "check", self.executor.accelerator.process_index):  # (tests)
            return self.executor.forward(self.model, mb, False, autocast=False, parallel=self.unsharded)[0]

    def _probe(self, mb, table: SequenceTable, indices: list[int], gradients: bool) -> Probe:
        if not (gradients and self.parameters):
            with torch.no_grad():
                return Probe(self._forward(mb))
        with torch.enable_grad():
            logps = self._forward(mb)
            loss = check_loss(logps, indices, table.completion_lengths.tolist())
            return Probe(logps.detach(), gradients_of(loss, self.parameters))


def checked_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters whose gradients the check compares: every kind of parameter (its name with layer
    numbers taken out: ``model.layers.*.mamba.A_log``) in the first and the last layer that has it, so attention,
    sequence mixers, MLPs, experts, routers, norms, embeddings and head are all covered at a cost that does not grow
    with depth."""
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for name, _ in parameters:
        kind = re.sub(r"\.\d+\.", ".*.", name)
        first.setdefault(kind, name)
        last[kind] = name
    kept = set(first.values()) | set(last.values())
    return [(name, p) for name, p in parameters if name in kept]


def gradients_of(loss: torch.Tensor, parameters: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The gradients of ``loss`` with respect to ``parameters`` (name to tensor; zeros where ``loss`` does not depend
    on one), through ``torch.autograd.grad``: nothing accumulates into ``.grad`` and no gradient hook of DDP or
    DeepSpeed runs."""
    found = [None] * len(parameters)
    if loss.requires_grad:
        found = torch.autograd.grad(loss, [p for _, p in parameters], allow_unused=True)
    return {name: (g if g is not None else torch.zeros_like(p)).detach() for (name, p), g in zip(parameters, found)}


def check_loss(logps: torch.Tensor, indices: Sequence[int], completions: Sequence[int]) -> torch.Tensor:
    """The scalar whose gradients the check compares: each completion token's log-prob times a fixed weight in
    [-1, 1) drawn for its sample and position (the same for a sample alone and in a pass), summed. ``logps``
    ``(rows, width)`` holds the samples ``indices`` row by row."""
    total = logps.new_zeros(())
    for row, index in enumerate(indices):
        length = completions[index]
        if length:
            weights = torch.rand(length, generator=torch.Generator().manual_seed(index)) * 2 - 1
            total = total + (logps[row, :length] * weights.to(logps.device, logps.dtype)).sum()
    return total


#: Completion tokens per sample that the gradient comparison keeps (:func:`gradient_table`).
GRADIENT_COMPLETION = 16


def gradient_table(table: SequenceTable, completion_tokens: int = GRADIENT_COMPLETION) -> SequenceTable:
    """``table`` with every completion cut to its first ``completion_tokens`` tokens (prompts, their images, token
    fields and positions kept alike): the samples of the check's passes with gradients. A block of a few tokens
    already takes its prefix's state or keys, and hands gradients back through them; a backward's cost grows with
    the tokens (a step of 512-token completions checked whole took 3.4 times the check of log-probs alone)."""
    completions = table.completion_lengths.clamp(max=completion_tokens)
    lengths = (table.prompt_lengths + completions).tolist()
    fields = table.token_fields
    return SequenceTable(
        tokens=[tokens[:length] for tokens, length in zip(table.tokens, lengths)],
        prompt_lengths=table.prompt_lengths,
        completion_lengths=completions,
        media=table.media,
        token_fields={name: [v[:n] for v, n in zip(values, lengths)] for name, values in fields.items()}
        if fields
        else fields,
        positions=None if table.positions is None else [p[:, :n] for p, n in zip(table.positions, lengths)],
        rope_widths=table.rope_widths,
    )


def alone_microbatch(table: SequenceTable, index: int, pad_token_id: int, device) -> MicroBatch:
    """The per-sample reference's input: sample ``index`` as one unpadded row with an all-ones attention mask and no
    position ids (the model positions it as it does any single sequence, as generation did)."""
    mb = build_microbatch(
        table, [index], layout="padded", pad_token_id=pad_token_id, device=device, attention_mask=True
    )
    mb.model_inputs.pop("position_ids", None)
    return mb
