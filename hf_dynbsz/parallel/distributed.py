"""The collectives of the schedule over ``torch.distributed`` (torch layer).

:class:`ProcessGroup` implements :class:`hf_dynbsz.planning.schedule.RankGroup` for a run under
``accelerate launch`` (NCCL on GPUs, gloo on CPU; on one process it does no communication) and moves samples as a
balanced :class:`~hf_dynbsz.planning.schedule.Exchange` says: each sample travels as one flat record (float64 by
default: ids, masks, fp32 and fp64 values are exact in it; states of one dtype, a distillation teacher's, in their
own) in a single ``all_to_all_single`` with uneven splits, which gloo and NCCL both support. Only records that change
process travel: a sample that stays keeps its record as it is, uncopied. Both sides compute every record's size from
the all-gathered lengths, so no sizes are exchanged.
The records are the torch layer's (``StepBatch.moved`` and ``SequenceTable.moved`` in :mod:`hf_dynbsz.execution`
build and read them): this module moves tensors and imports nothing of that layer.
Its collectives go through :mod:`hf_dynbsz.parallel.collectives`, which holds their tensors until no worker thread
of gloo or NCCL holds them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from hf_dynbsz.parallel.collectives import all_reduce, all_to_all_single, gather_values
from hf_dynbsz.planning.schedule import Exchange

__all__ = [
    "ProcessGroup",
    "fsdp_units",
    "gathered_calls",
    "gathering_reason",
    "parameter_gathering",
]


def parameter_gathering(accelerator) -> str | None:
    """The engine that shards the parameters over several processes and gathers a module's parameters when the
    module runs, a collective every process must join as often as the others: "DeepSpeed ZeRO-3" or "FSDP" (any
    version); None on one process, and under DDP and ZeRO-1/2 (every process holds whole parameters)."""
    if accelerator.num_processes <= 1:
        return None
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        return "DeepSpeed ZeRO-3"
    if accelerator.distributed_type == "FSDP":  # accelerate's DistributedType, a str enum
        return "FSDP"
    return None


def fsdp_units(plugin, model) -> frozenset[str] | None:
    """The class names of the modules of ``model`` that accelerate's FSDP wrap (``plugin``: its
    ``FullyShardedDataParallelPlugin``) shards on their own, below the whole model: each gathers its parameters when
    it runs, and the modules within one share its gather. Under ``TRANSFORMER_BASED_WRAP`` the plugin's
    ``transformer_cls_names_to_wrap``, by default the model's ``_no_split_modules``; none under ``NO_WRAP``. None
    under any other policy (size-based: any module large enough), where no class is known to be left whole."""
    policy = plugin.auto_wrap_policy  # accelerate's function (or a partial of it) once the plugin is built
    if policy is None:
        return frozenset()
    if getattr(getattr(policy, "func", policy), "__name__", None) != "transformer_auto_wrap_policy":
        return None
    return frozenset(plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or ())


def gathered_calls(accelerator, model) -> Callable[[tuple[str, ...]], str | None]:
    """:func:`gathering_reason` of ``model`` (unwrapped) in ``accelerator``'s launch, as a function of class
    names."""
    engine = parameter_gathering(accelerator)
    units = fsdp_units(accelerator.state.fsdp_plugin, model) if engine == "FSDP" else None
    return functools.partial(gathering_reason, engine, units, model)


def gathering_reason(engine: str | None, units: frozenset[str] | None, model, names: tuple[str, ...]) -> str | None:
    """Why each call of a module of ``model`` whose class is one of ``names`` is a collective of every process (each
    must then make the same calls), or None. ``engine``: :func:`parameter_gathering`'s answer; under DeepSpeed ZeRO-3
    every module's call gathers its parameters; under FSDP (``units``: :func:`fsdp_units`) a module's call does when
    the module, or one within it, is sharded on its own."""
    if engine != "FSDP":
        return engine and f"under {engine} on several processes each call of a module gathers its parameters"
    within = {type(inner).__name__ for module in model.modules() if type(module).__name__ in names
              for inner in module.modules()}  # fmt: skip
    if units is not None and not units & within:
        return None
    sharded = ", ".join(sorted(units & within)) if units is not None else "the wrap policy may shard any"
    return (
        f"under FSDP on several processes each call of a module sharded on its own ({sharded}) gathers its parameters"
    )


class ProcessGroup:
    """All processes of the accelerator's run, or with ``group`` (a ``torch.distributed`` group this process belongs
    to) the processes of that group: ``rank`` and ``num_processes`` are then within it (under sequence parallelism,
    the processes that hold the same shard of their groups' rows: :mod:`hf_dynbsz.execution.sequence_parallel`).
    Every process of the group must make the same calls in the same order."""

    def __init__(self, accelerator, group=None) -> None:
        self.group = group
        self.num_processes = accelerator.num_processes if group is None else dist.get_world_size(group)
        self.rank = accelerator.process_index if group is None else dist.get_rank(group)
        self.device = accelerator.device

    @property
    def _distributed(self) -> bool:
        return self.num_processes > 1 and dist.is_initialized()

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if not self._distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def all_gather(self, values: list[int]) -> list[list[int]]:
        if not self._distributed:
            return [list(values)]
        own = torch.tensor(values, dtype=torch.long, device=self.device)
        return [part.tolist() for part in gather_values(own, self.group)]

    def send_to_runners(
        self,
        records: list[torch.Tensor],
        exchange: Exchange,
        size: Callable[[int, int], int] | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> list[torch.Tensor]:
        """This process's records (one per sample, local order) to the processes that run them.

        Returns the records of the samples this process runs, in :attr:`Exchange.incoming` order. ``size(prompt,
        completion)`` is the length of a record; None: records of any length, whose lengths travel first. ``dtype``:
        the records' (the same on every process); a record that stays on this process is returned as it was given.
        """
        if size is None:
            lengths = iter(
                int(length)
                for length in self.send_to_runners(
                    [torch.tensor([float(record.numel())], dtype=torch.float64) for record in records],
                    exchange,
                    lambda prompt, completion: 1,
                )
            )
            size = lambda prompt, completion: next(lengths)  # noqa: E731 - in incoming order, as sent
        outgoing = [[records[i] for i in indices] for indices in exchange.outgoing]
        incoming = [
            [size(*exchange.shapes[origin][i]) for i, target in enumerate(targets) if target == self.rank]
            for origin, targets in enumerate(exchange.destination)
        ]
        return [record for from_one in self._all_to_all(outgoing, incoming, dtype) for record in from_one]

    def send_to_owners(
        self,
        records: list[torch.Tensor],
        exchange: Exchange,
        size: Callable[[int, int], int],
        dtype: torch.dtype = torch.float64,
    ) -> list[torch.Tensor]:
        """The reverse of :meth:`send_to_runners`: results of the samples this process ran, back to their owners.

        ``records`` are in :attr:`Exchange.incoming` order; returns one record per own sample, in local order (one
        that stayed here as it was given). ``dtype``: the records' (the same on every process).
        """
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(self.num_processes)]
        for record, (origin, _) in zip(records, exchange.incoming):
            by_owner[origin].append(record)
        own_shapes = exchange.shapes[self.rank]
        expected = [[size(*own_shapes[i]) for i in indices] for indices in exchange.outgoing]
        received = self._all_to_all(by_owner, expected, dtype)
        result: list[torch.Tensor | None] = [None] * len(own_shapes)
        for indices, from_one in zip(exchange.outgoing, received):
            for i, record in zip(indices, from_one):
                result[i] = record
        return result

    def return_rows(self, rows: list[torch.Tensor], exchange: Exchange, width: int, k: int) -> torch.Tensor:
        """Per-token results of the samples this process ran (``rows``: one ``(k, completion)`` tensor each, in
        :attr:`Exchange.incoming` order) back to their owners: ``(own samples, k, width)``, zero past each
        completion."""
        own = self.send_to_owners([row.double().reshape(-1) for row in rows], exchange, lambda p, c: k * c)
        result = torch.zeros(len(own), k, width, dtype=torch.float32, device=self.device)
        for i, record in enumerate(own):
            values = record.view(k, -1)
            result[i, :, : values.size(1)] = values.float()
        return result

    def _all_to_all(
        self, outgoing: list[list[torch.Tensor]], incoming_sizes: list[list[int]], dtype: torch.dtype = torch.float64
    ) -> list[list[torch.Tensor]]:
        """Send ``outgoing[p]`` (1-D records of ``dtype``) to process ``p``; receive records of ``incoming_sizes[p]``.
        This process's own records (``outgoing[rank]``) do not travel: they come back as they were given."""
        empty = torch.zeros(0, dtype=dtype, device=self.device)
        send = [
            torch.cat(records) if records and target != self.rank else empty for target, records in enumerate(outgoing)
        ]
        send_splits = [int(part.numel()) for part in send]
        receive_splits = [0 if origin == self.rank else sum(sizes) for origin, sizes in enumerate(incoming_sizes)]
        received = torch.empty(sum(receive_splits), dtype=dtype, device=self.device)
        sent = torch.cat(send).to(self.device, dtype)
        all_to_all_single(received, sent, receive_splits, send_splits, group=self.group)
        parts = received.detach().split(receive_splits)  # views of an alias: the received tensor stays this module's
        return [
            list(outgoing[origin]) if origin == self.rank else list(part.split(sizes)) if sizes else []
            for origin, (part, sizes) in enumerate(zip(parts, incoming_sizes))
        ]
