"""Sequence parallelism for packed rows: DeepSpeed Ulysses around segment attention (torch layer).

With ``sequence_parallel_size`` N (or accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``, see
:mod:`hf_dynbsz.configs`) the processes form groups of N consecutive ranks (DeepSpeed's ``parallel_state_sp``):

* **pool**: the processes of a group pool their samples (the step's :class:`~hf_dynbsz.execution.batch.StepBatch`, each
  sample with its stock loss weights, or a no-grad pass's table), so every process of a group holds the same samples
  and plans the same passes; a group's pass holds up to N x the per-device token budget;
* **shard**: a pass's padding-free row (its width rounded up to a multiple of N) is cut into N contiguous shards;
  process k of the group runs shard k: its input ids, position ids (a node's depths) and shift labels, all computed
  for the whole row before it is cut (a position at a shard's end keeps its next token: none is lost);
* **attention**: DeepSpeed's ``UlyssesSPAttentionHF`` wraps segment attention (:mod:`hf_dynbsz.execution.attention`)
  under :data:`ULYSSES_ATTENTION_NAME`: its all-to-all gives each process the whole row for 1/N of the heads, the whole
  row's :class:`~hf_dynbsz.execution.attention.SegmentLayout` applies (whatever the row holds: plain sequences, shared
  prompts, or a prefix tree's nodes, each attending to its root-to-node path across shard boundaries), and a second
  all-to-all returns the shard;
* **loss**: the shards' per-token log-probs (and entropies) are gathered (:func:`gather_shards`: forward an
  all-gather, backward each process keeps its shard's gradient), every process of the group computes the pass's loss
  from the whole row, identically, and each process's backward carries its shard's part: the group's gradients sum
  to the pass's gradient, once. DDP and DeepSpeed average gradients over all P processes, so a step's gradient is
  (1/P) x the sum of the groups' losses' gradients = (1/P) x the sum of every process's own stock loss gradient:
  stock's, since a group's loss is the sum of its processes' samples' stock-weighted losses;
* **data parallelism** across groups: a group's passes are planned with the processes that run the same shard in
  the other groups (:attr:`SequenceParallel.peers`): the lockstep (equal pass counts) and cross-rank balancing of
  :mod:`hf_dynbsz.planning.schedule` run between groups.

accelerate applies Ulysses to a ``DataLoader`` of token batches (``UlyssesSPDataLoaderAdapter``) and hands DeepSpeed
a sequence-parallel ``mpu``; GRPO's batches are prompts whose model inputs exist only after generation (why TRL
refuses ``sp_size > 1``), so the trainer keeps accelerate on plain data parallelism over all processes and applies
Ulysses to its own packed rows here. Which runs may use it: :func:`sequence_parallel_blocker`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_dynbsz.execution.attention import ATTENTION_NAME, segment_attention_forward
from hf_dynbsz.parallel.collectives import all_gather, all_gather_objects
from hf_dynbsz.planning.cost import config_value, text_config_of

__all__ = [
    "ULYSSES_ATTENTION_NAME",
    "NoSequenceParallel",
    "SequenceParallel",
    "gather_shards",
    "sequence_parallel_blocker",
]

#: The attention implementation of sharded passes: DeepSpeed's Ulysses wrapper around segment attention.
ULYSSES_ATTENTION_NAME = "hf_dynbsz_ulysses"


def sequence_parallel_blocker(
    size: int,
    num_processes: int,
    *,
    layouts,
    support,
    vision_language: str | None,
    router_aux: bool,
    entropy_bonus: bool,
    text_config,
) -> str | None:
    """Why ``sequence_parallel_size=size`` cannot run (a message naming the setting and the fix), or None."""
    fix = "set sequence_parallel_size=1 (parallelism_config sp_size=1)"
    if num_processes % size:
        return (
            f"sequence_parallel_size={size} does not divide the {num_processes} processes: launch a multiple of "
            f"{size} processes, or {fix}"
        )
    if vision_language is not None:
        return f"sequence_parallel_size={size} does not run vision-language models (image inputs): {fix}"
    if not layouts or layouts[0].name != "padding_free" or layouts[0].segment_attention is None:
        reason = support.padding_free_blocker or "packing_layout is not 'padding_free'"
        return (
            f"sequence_parallel_size={size} shards padding-free rows through segment attention, which this run "
            f"does not use ({reason}): {fix}, or use packing_layout='padding_free' with a model that allows it"
        )
    if support.sequence_mixers:
        return (
            f"sequence_parallel_size={size} does not shard the {', '.join(support.sequence_mixers)} layers of this "
            f"model (they carry state along a sequence, which a shard would need from the shard before it): {fix}"
        )
    if router_aux:
        return f"sequence_parallel_size={size} does not repack the MoE router aux loss: {fix}"
    if entropy_bonus:
        return f"sequence_parallel_size={size} does not repack the entropy bonus: {fix}"
    heads = config_value(text_config, "num_attention_heads")  # (a per-layer count reads as None: refused)
    kv_heads = config_value(text_config, "num_key_value_heads", heads)
    if (
        not isinstance(heads, int)
        or heads % size
        or not isinstance(kv_heads, int)
        or (kv_heads % size and size % kv_heads)
    ):
        return (
            f"sequence_parallel_size={size} must divide the attention heads (num_attention_heads={heads}, and "
            f"num_key_value_heads={kv_heads} or be a multiple of it): Ulysses gives each process of a group 1/"
            f"{size} of the heads; {fix} or a size that divides them"
        )
    return None


class _GatherShards(torch.autograd.Function):
    """``(1, shard)`` per process -> ``(1, size x shard)`` on every process; the gradient keeps this shard's part."""

    @staticmethod
    def forward(ctx, shard, group, rank, size):
        ctx.rank, ctx.width = rank, shard.size(-1)
        parts = [torch.empty_like(shard) for _ in range(size)]
        all_gather(parts, shard.detach().contiguous(), group)  # an alias of the shard: a tensor of this gather's own
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None, None


def gather_shards(shard: torch.Tensor, parallel: SequenceParallel) -> torch.Tensor:
    """The whole row's per-position values from each process's shard (see the module's **loss**)."""
    return _GatherShards.apply(shard, parallel.group, parallel.rank, parallel.size)


@dataclass
class SequenceParallel:
    """This process's place: ``size`` processes per group, ``rank`` within its group, ``group`` (its
    ``torch.distributed`` group) and ``peers`` (the group of the processes running the same shard in every group)."""

    size: int
    rank: int
    group: object
    peers: object

    @classmethod
    def setup(cls, model, size: int) -> SequenceParallel:
        """Form the groups (DeepSpeed's ``parallel_state_sp``) and register Ulysses around segment attention for
        ``model`` (its head counts), as :data:`ULYSSES_ATTENTION_NAME`. Every process calls it, in the same order."""
        import deepspeed.comm
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if not deepspeed.comm.is_initialized():  # DeepSpeed's groups need its comm layer (on the same process group)
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        parallel_state_sp._release_sequence_parallel_groups()  # a second trainer in one process forms them anew
        config = text_config_of(model.config)
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME  # DeepSpeed checks that the model runs the core it wraps
        try:
            UlyssesSPAttentionHF.register_with_transformers(model, ATTENTION_NAME, size, 1, seq_length_is_variable=True)
        finally:
            config._attn_implementation = previous
        # DeepSpeed put its wrapper in place of the core: move it to a name of its own, so that unsharded passes
        # (the self-check) keep plain segment attention.
        ALL_ATTENTION_FUNCTIONS[ULYSSES_ATTENTION_NAME] = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = segment_attention_forward
        world, rank, peers = dist.get_world_size(), dist.get_rank(), None
        for shard in range(size):  # every process creates every group, in the same order
            ranks = list(range(shard, world, size))
            created = dist.new_group(ranks)
            if rank in ranks:
                peers = created
        return cls(
            size, parallel_state_sp.get_sequence_parallel_rank(), parallel_state_sp.get_sequence_parallel_group(), peers
        )

    #: the attention implementation a pass runs under (the self-check's unsharded passes keep plain segment attention)
    attention_name = ULYSSES_ATTENTION_NAME

    def row_multiple(self, pad_to_multiple_of: int | None) -> int:
        """What a row's width is rounded up to: a sharded row splits evenly over the group."""
        return math.lcm(pad_to_multiple_of or 1, self.size)

    def per_process(self, shape: tuple[float, ...]) -> tuple[float, ...]:
        """A pass's (tokens, attention pairs) as the memory model sees it: each process holds 1/size of the row."""
        return tuple(value / self.size for value in shape)

    @property
    def dummy_width(self) -> int:
        """The width of a lockstep dummy row: one token per process of the group."""
        return self.size

    def gather(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """The whole row's per-position values from this process's shard (None stays None)."""
        return None if shard is None else gather_shards(shard, self)

    def refuse_inexact(self, summary: str) -> None:
        """The self-check stepped down from padding-free rows, which sharding needs: stop with the fix."""
        raise RuntimeError(
            f"hf_dynbsz: sequence_parallel_size={self.size} shards padding-free rows, and the self-check found them "
            f"not exact for this model ({summary}): set sequence_parallel_size=1."
        )

    # ---- pooling the group's samples ---------------------------------------------------------------------------
    def _gather_objects(self, value):
        return all_gather_objects(value, self.group)

    def pool_batch(self, batch):
        """The group's training samples, every process's in group order, each with its stock loss weights."""
        shapes = list(zip(batch.table.prompt_lengths.tolist(), batch.table.completion_lengths.tolist()))
        members = self._gather_objects(
            (
                [record.cpu() for record in batch.records()],
                shapes,
                batch.slice_rows.cpu(),
                batch.stock_microbatch_tokens,
                batch.stock_computed_tokens,
            )
        )
        device = batch.loss_mask.device
        pooled = batch.from_records(
            [record.to(device) for member in members for record in member[0]],
            [shape for member in members for shape in member[1]],
        )
        pooled.slice_rows = torch.stack([member[2] for member in members]).sum(dim=0)
        pooled.stock_microbatch_tokens = max(member[3] for member in members)
        pooled.stock_computed_tokens = sum(member[4] for member in members)
        return pooled

    def pool_table(self, table):
        """``(pooled, own)``: the group's samples (token ids) for a no-grad pass, and the positions of this
        process's own samples in it."""
        from hf_dynbsz.execution.packing import SequenceTable

        members = self._gather_objects(
            (
                [tokens.cpu() for tokens in table.tokens],
                table.prompt_lengths.cpu(),
                table.completion_lengths.cpu(),
                table.rope_widths,
            )
        )
        start = sum(len(member[0]) for member in members[: self.rank])
        device = table.tokens[0].device if len(table) else torch.device("cpu")
        pooled = SequenceTable(
            tokens=[tokens.to(device) for member in members for tokens in member[0]],
            prompt_lengths=torch.cat([member[1] for member in members]),
            completion_lengths=torch.cat([member[2] for member in members]),
            rope_widths=None if table.rope_widths is None else torch.cat([member[3] for member in members]),
        )
        return pooled, slice(start, start + len(table))

    # ---- sharding a pass ---------------------------------------------------------------------------------------
    def shard(self, model_inputs: dict, shift_labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """This process's shard of a row (every tensor cut along its last, sequence, dimension)."""
        width = shift_labels.size(-1)
        if width % self.size:
            raise ValueError(
                f"a sharded row must be a multiple of sequence_parallel_size={self.size} wide, got {width}"
            )
        part = slice(self.rank * (width // self.size), (self.rank + 1) * (width // self.size))
        return {name: value[..., part] for name, value in model_inputs.items()}, shift_labels[..., part]


class NoSequenceParallel:
    """Sequence parallelism of size 1, the identity: every process runs whole rows of its own samples.

    The executor always holds a sequence-parallel object, so that pooling, sharding and gathering need no branch:
    here each of them returns what it is given.
    """

    size = 1
    rank = 0
    group = None
    peers = None
    attention_name = ATTENTION_NAME
    dummy_width = 2  # a prompt token and a completion token

    def row_multiple(self, pad_to_multiple_of: int | None) -> int | None:
        return pad_to_multiple_of

    def per_process(self, shape: tuple[float, ...]) -> tuple[float, ...]:
        return shape

    def gather(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        return shard

    def refuse_inexact(self, summary: str) -> None:
        """Whole rows run any layout the self-check keeps."""

    def pool_batch(self, batch):
        return batch

    def pool_table(self, table):
        """``(table, own)``: this process's samples, all of them its own."""
        return table, slice(0, len(table))

    def shard(self, model_inputs: dict, shift_labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        return model_inputs, shift_labels
