"""One pass of the pass executor on this process's device (torch layer).

:class:`DevicePass` is what every pass needs, whatever its kind: the packed micro-batch
(:func:`~hf_dynbsz.execution.packing.build_microbatch`, each sample's M-RoPE positions once per table), segment
attention and recurrence around it, the forward (this process's shard of the row and the shards' outputs gathered
under sequence parallelism), the backward with gradient synchronisation on the last pass only, the lockstep dummy
pass, the step's gradients allocated before a step planned under a memory limit, and TRL's fused LM head tiled.
:class:`~hf_dynbsz.execution.executor.PassExecutor` is one: it plans the passes and runs them through these methods,
and so do the self-check's passes (:class:`~hf_dynbsz.execution.check_passes.CheckPasses`).
"""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import DistributedType

from hf_dynbsz.execution.attention import segment_attention, use_segments
from hf_dynbsz.execution.multimodal import rope_positions
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch, dummy_microbatch
from hf_dynbsz.execution.recurrence import segment_recurrence
from hf_dynbsz.execution.rope import stock_rope, use_rope_widths
from hf_dynbsz.execution.router_loss import captured_router_logits
from hf_dynbsz.execution.tiling import lm_head_tiles
from hf_dynbsz.planning.model_support import base_model
from hf_dynbsz.planning.schedule import Scheduler

__all__ = ["DevicePass", "named_pass"]


def named_pass(mb, parallel) -> tuple[dict, torch.Tensor]:
    """Name ``mb`` as the pass about to run (its segment layout, its positions' rope widths) and return its model
    inputs and labels as ``parallel`` shards them (this process's part of the row; the whole row without sequence
    parallelism)."""
    use_segments(mb.segments)
    if mb.rope_widths is None:
        use_rope_widths(None)
        return parallel.shard(mb.model_inputs, mb.shift_labels)
    inputs, labels = parallel.shard({**mb.model_inputs, ROPE_WIDTHS: mb.rope_widths}, mb.shift_labels)
    use_rope_widths(inputs.pop(ROPE_WIDTHS))
    return inputs, labels


#: The name the rope widths are sharded under with a pass's model inputs (never given to the model).
ROPE_WIDTHS = "_dynbsz_rope_widths"


class DevicePass:
    """One pass on this process's device, for the executor that subclasses it. Reads the run's ``trainer``,
    ``accelerator``, ``args``, ``capabilities``, ``scheduler`` (the run's layout), ``layout_timing`` (a timed pass's
    layout), ``parallel`` (sequence parallelism), ``memory`` (the memory model), ``pad_token_id``, ``_dummies`` (the
    dummy micro-batch of each layout) and ``_unwrapped`` (:meth:`unwrap`'s model, None at first), which the executor
    sets."""

    def unwrap(self, model):
        """``accelerator.unwrap_model(model)``, computed once per model object: accelerate reads the installed
        packages' metadata on every call (milliseconds a step on the host's critical path, twice a step); a wrapper
        never changes the module it wraps."""
        if self._unwrapped is None or self._unwrapped[0] is not model:
            self._unwrapped = (model, self.accelerator.unwrap_model(model))
        return self._unwrapped[1]

    def microbatch(self, table: SequenceTable, group: list[int], scheduler: Scheduler | None = None):
        """The packed micro-batch of ``table``'s samples ``group`` in ``scheduler``'s layout (default: the run's), its
        samples sharing positions by the layout's rule (:meth:`SequenceTable.prefix_keys`; the pass's tree read off
        the table's, :meth:`SequenceTable.prefix_tree`, built once per table)."""
        scheduler = scheduler or self.layout_timing.pass_scheduler or self.scheduler
        keys = table.prefix_keys(scheduler.sharing) if scheduler.sharing else None
        tree = table.prefix_tree(scheduler.sharing) if scheduler.sharing else None
        if (
            scheduler.layout == "padding_free" and table.positions is None and self.capabilities.support.multimodal_rope
        ):  # once per table: each sample's own M-RoPE positions
            unwrapped = self.accelerator.unwrap_model(base_model(self.trainer.model))
            table.positions = rope_positions(unwrapped, table.tokens, table.token_fields, table.media)
        return build_microbatch(
            table,
            group,
            layout=scheduler.layout,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.parallel.row_multiple(getattr(self.args, "pad_to_multiple_of", None)),  # (GRPO's)
            device=self.accelerator.device,
            attention=scheduler.segment_attention,
            attention_mask=scheduler.attention_mask,
            position_offset=scheduler.position_offset,
            keys=keys,
            tree=tree,
        )

    @contextlib.contextmanager
    def segments(self, model, scheduler: Scheduler | None = None, parallel=None):
        """Segment attention for the passes (forward and backward) when padding-free rows use it, through
        ``parallel``'s attention (default: the run's; under sequence parallelism DeepSpeed Ulysses), segment
        recurrence for the model's sequence mixers (the identity for a model without any, and for padded passes), and
        each sample's LongRoPE factors as stock's micro-batch picks them (:mod:`hf_dynbsz.execution.rope`; the
        identity for a model without LongRoPE)."""
        scheduler = scheduler or self.scheduler
        enabled = scheduler.segment_attention is not None
        name = (parallel or self.parallel).attention_name
        unwrapped = self.unwrap(model)
        mixers = self.capabilities.support.sequence_mixers if scheduler.segment_recurrence else ()
        with segment_attention(unwrapped, enabled, name), segment_recurrence(unwrapped, mixers), stock_rope(unwrapped):
            yield

    def forward(self, model, mb, compute_entropy: bool, router: bool = False, autocast: bool = True, parallel=None):
        """Completion-aligned ``(rows, width)`` log-probs, entropies (or None) and, for ``router``, the router logits
        (per layer; or None) of one micro-batch; under the accelerator's autocast unless ``autocast`` is False.
        ``parallel`` (default: the run's sequence parallelism): this process runs its shard of the row and the
        shards' outputs are gathered (the identity at size 1)."""
        parallel = parallel or self.parallel
        extra = {"output_router_logits": True} if router else {}
        capture = captured_router_logits(self.unwrap(model)) if router else contextlib.nullcontext()
        precision = self.accelerator.autocast() if autocast else contextlib.nullcontext()
        inputs, labels = named_pass(mb, parallel)
        with precision, capture as router_logits:
            outputs = model(**inputs, shift_labels=labels, fused_lm_head=True, **extra)
        log_probs = parallel.gather(outputs.log_probs)
        entropies = mb.to_completion_layout(parallel.gather(outputs.entropy)) if compute_entropy else None
        return mb.to_completion_layout(log_probs), entropies, router_logits[-1] if router else None

    def _allocate_gradients(self, model, kind: str) -> None:
        """With a memory limit, the step's gradients exist (as zeros) before a training step is planned, so that what
        the process holds includes them and every pass starts from the same memory (accumulating into zeros is
        exact). DeepSpeed holds its own gradient buffers."""
        if kind != "training" or self.memory.limit_mib is None or self._deepspeed:
            return
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def lockstep_microbatch(self):
        """The tiny micro-batch of lockstep passes in the run's layout, built and moved once per run (a dummy pass
        copies nothing to the device)."""
        scheduler = self.scheduler
        key = (scheduler.segment_attention, scheduler.attention_mask, scheduler.position_offset)
        if key not in self._dummies:
            self._dummies[key] = dummy_microbatch(
                self.pad_token_id, self.accelerator.device, *key, width=self.parallel.dummy_width
            )
        return self._dummies[key]

    def dummy_pass(self, model, last: bool | None = None) -> None:
        """A tiny pass that keeps this process in lockstep: every parameter takes part, nothing is learned.

        With ``last`` given (a training pass) it also runs a zero backward, synchronising gradients if ``last``.
        Without (a no-grad pass, or the passes left to a training attempt after this process failed) it runs inside
        ``no_sync``: DDP then prepares no gradient reduction for a backward that never comes, and leaves its next
        forward as the other processes' passes leave theirs (their training passes run inside ``no_sync`` too).
        """
        mb = self.lockstep_microbatch()
        inputs, labels = named_pass(mb, self.parallel)
        with self.no_sync(model, bool(last)), self.accelerator.autocast():
            outputs = model(**inputs, shift_labels=labels, fused_lm_head=True)
            if last is not None:
                self.backward(model, outputs.log_probs.sum() * 0.0, last)

    @property
    def _deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def no_sync(self, model, last: bool):
        """Around a training pass's forward AND backward (DDP decides in the forward whether the backward
        all-reduces): no gradient synchronisation unless ``last``. DeepSpeed decides at its boundary instead."""
        if last or self._deepspeed:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, model, loss, last: bool) -> None:
        """One backward of a multi-pass optimizer step (inside :meth:`no_sync` unless ``last``); gradients sync (and
        DeepSpeed steps) on the last only."""
        self.accelerator.gradient_state._set_sync_gradients(last)
        try:
            self.accelerator.backward(loss, **({"scale_wrt_gas": False} if self._deepspeed else {}))
        finally:
            self.accelerator.gradient_state._set_sync_gradients(True)

    def tiles(self):
        """TRL's fused LM head tiled by ``tensor_batch_size`` (stock's own tile with dynamic_batching off)."""
        return lm_head_tiles(self.args.tensor_batch_size if self.args.dynamic_batching else None)
