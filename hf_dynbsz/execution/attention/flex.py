"""Segment attention's flex_attention formulation: one call per layer under a block mask (torch layer).

One call of flex_attention per layer over the whole row, under a block mask drawn from the row's prefix tree (a query
sees keys at or before it in its own node or on its node's path, and within the layer's sliding window over positions
within the sequence), built once per pass and window. The block tables come from the nodes' ranges, never from a
dense mask. transformers compiles flex_attention once per process; rows pad to one of
a few widths (:func:`flex_row_width`), each compiled once. Its inputs are cast to autocast's dtype, as sdpa's are.
"""

from __future__ import annotations

import bisect
import logging

import torch

from hf_dynbsz.execution.attention.common import autocast_inputs

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "FLEX_BLOCK_SIZE",
    "FLEX_FALLBACK_OPTIONS",
    "FLEX_KERNEL",
    "build_block_mask",
    "build_position_labels",
    "flex_attention",
    "flex_blocks",
    "flex_row_width",
    "flex_tables",
]

#: Query and key positions per block of flex_attention's ``BlockMask`` (torch's default).
FLEX_BLOCK_SIZE = 128


def build_position_labels(layout, device) -> dict[str, torch.Tensor]:
    """Per row position of ``layout``: ``node`` (its node's number), ``subtree_end`` (one past the last node of that
    node's subtree: the node numbered ``n`` is on a query's path, or is its node, when ``n <= node < subtree_end[n]``)
    and ``position`` (its depth: the position within its samples), on ``device``."""
    parts = layout.parts()
    lengths = torch.tensor([len(part.own) for part in parts])
    labels = {
        "node": torch.arange(len(parts)).repeat_interleave(lengths),
        "subtree_end": torch.tensor(layout.subtree_ends()).repeat_interleave(lengths),
        "position": torch.cat([torch.arange(part.depth, part.depth + len(part.own)) for part in parts]),
    }
    return {name: values.to(device) for name, values in labels.items()}


def build_block_mask(layout, window: int | None, device):
    """The flex_attention ``BlockMask`` of ``layout``'s row (see the module's rule), from its position labels and
    block tables on ``device``. Nodes are numbered in row order with each subtree's nodes in a run after its root,
    so a key is on a query's path (or in its node) exactly when its node's subtree holds the query's node."""
    from torch.nn.attention.flex_attention import BlockMask

    labels = layout.position_labels(device)
    node, subtree_end, position = (labels[n] for n in ("node", "subtree_end", "position"))

    def mask_mod(batch, head, query, key):
        allowed = (key <= query) & (node[key] <= node[query]) & (node[query] < subtree_end[key])
        if window is not None:
            allowed = allowed & (position[query] - position[key] < window)
        return allowed

    return BlockMask.from_kv_blocks(
        *layout.flex_tables(window, device),
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(layout.width, layout.width),
    )


def flex_tables(layout, window: int | None, device) -> tuple[torch.Tensor, ...]:
    """``(partial counts, partial indices, full counts, full indices)`` of ``layout``'s block mask of ``window`` on
    ``device`` (:func:`flex_blocks` as ``BlockMask.from_kv_blocks`` takes them)."""
    partial_blocks, full_blocks = layout.flex_blocks(window)
    tables = (*_block_table(partial_blocks), *_block_table(full_blocks))
    return tuple(table.to(device) for table in tables)


def flex_blocks(layout, window: int | None) -> tuple[list[list[int]], list[list[int]]]:
    """``(partial, full)``: per query block of :data:`FLEX_BLOCK_SIZE` positions, the key blocks some of whose
    pairs it may attend to (the ``mask_mod`` decides each pair), and those all of whose pairs it may.

    Drawn from the nodes' ranges, never from a dense ``width x width`` mask (``create_block_mask`` evaluates the mask
    at every pair: 7 s and 4 GB for a 19,702-token row on a CPU). A query block sees, for each node it holds, the
    node's own keys up to the block's end and its path's keys. A key block is full when the query block lies in one
    node and every key of the block precedes the query block in that node or lies on its path (no window: with one,
    none is full).
    """
    size = FLEX_BLOCK_SIZE
    parts = layout.parts()
    starts = [part.own.start for part in parts]
    partial_blocks, full_blocks = [], []
    for query_start in range(0, layout.width, size):
        query_end = min(query_start + size, layout.width)
        first = bisect.bisect_right(starts, query_start) - 1
        last = bisect.bisect_left(starts, query_end)
        seen, whole = set(), set()
        for part in parts[first:last]:
            own = part.own
            seen.update(range(own.start // size, (min(own.stop, query_end) - 1) // size + 1))
            for above in part.path:
                seen.update(range(above.start // size, (above.stop - 1) // size + 1))
            if window is None and last - first == 1:
                whole.update(range(-(-own.start // size), query_start // size))  # own keys before every query
                for above in part.path:  # the path's keys
                    whole.update(range(-(-above.start // size), above.stop // size))
        full_blocks.append(sorted(whole))
        partial_blocks.append(sorted(seen - whole))
    return partial_blocks, full_blocks


def _block_table(blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, indices)`` of a ``BlockMask`` over a square of ``len(blocks)`` blocks, on the host: per query block,
    how many key blocks it lists, and which (first, the rest of its row 0)."""
    counts = torch.tensor([len(row) for row in blocks], dtype=torch.int32)
    indices = torch.zeros(len(blocks), len(blocks), dtype=torch.int32)
    for row, listed in enumerate(blocks):
        indices[row, : len(listed)] = torch.tensor(listed, dtype=torch.int32)
    return counts.view(1, 1, -1), indices.view(1, 1, *indices.shape)


def flex_row_width(tokens: int) -> int:
    """The width of a flex_attention row of ``tokens`` tokens: the least of ``FLEX_BLOCK_SIZE x {1, 2, 3, 4, 6, 8,
    12, ...}`` (two widths per octave, multiples of 128) at least ``tokens``. A row pads to it (the padding a segment
    of its own), so rows of any length take one of a few widths, each compiled once: at most 1.5x the tokens rounded
    up to whole blocks."""
    blocks = max(-(-int(tokens) // FLEX_BLOCK_SIZE), 1)
    power = 1 << (blocks - 1).bit_length()  # the least power of two >= blocks
    return FLEX_BLOCK_SIZE * (power * 3 // 4 if blocks <= power * 3 // 4 else power)


#: Explicit block sizes for flex_attention's Triton kernels when Inductor's autotuning finds no valid choice
#: (``NoValidChoicesError``, pytorch#146260; torchtune#2113 falls back to block sizes of 32 the same way).
FLEX_FALLBACK_OPTIONS = {
    "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32, "num_stages": 1,
}  # fmt: skip


class _FlexKernel:
    """flex_attention compiled once per process with static shapes (one kernel per row width: :func:`flex_row_width`
    keeps them few), its kernel options (None, or :data:`FLEX_FALLBACK_OPTIONS` once Inductor found no valid choice),
    and the input shapes it has compiled for (``compiles``: one per row width, dtype and head layout)."""

    def __init__(self) -> None:
        self.function = None
        self.options: dict | None = None
        self.compiled: set = set()

    @property
    def compiles(self) -> int:
        return len(self.compiled)

    def __call__(self, query, key, value, block_mask, scale, enable_gqa):
        if self.function is None:
            from torch.nn.attention.flex_attention import flex_attention

            self.function = torch.compile(flex_attention, dynamic=False)
        shape = (tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, enable_gqa)
        if shape not in self.compiled and query.device.type == "cuda":
            self._compile(query, key, value, block_mask, scale, enable_gqa)
            self.compiled.add(shape)
        return self.function(
            query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=self.options
        )

    def _compile(self, query, key, value, block_mask, scale, enable_gqa) -> None:
        """Compile forward AND backward for these shapes now, on copies of the inputs (a backward that finds no valid
        kernel would otherwise fail in the pass's backward, past the reach of a fallback), with the fallback options
        when Inductor finds no valid choice."""
        for options in (self.options, FLEX_FALLBACK_OPTIONS):
            try:
                with torch.enable_grad():
                    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
                    out = self.function(
                        *inputs, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=options
                    )
                    out.float().sum().backward()
            except Exception as error:
                if "NoValidChoices" not in f"{type(error).__name__}: {error}" or options is FLEX_FALLBACK_OPTIONS:
                    raise
                first_line = str(error).splitlines()[0][:200]
                logger.warning(
                    "hf_dynbsz: flex_attention found no valid kernel choice; explicit kernel options %s from now on "
                    "(%s).", FLEX_FALLBACK_OPTIONS, first_line,
                )  # fmt: skip
                continue
            self.options = options
            return


#: The process's flex_attention kernel (segment attention's flex formulation).
FLEX_KERNEL = _FlexKernel()


def flex_attention(module, layout, query, key, value, scaling, dropout, window, kernel=FLEX_KERNEL, **kwargs):
    """One flex_attention call over the whole row under the segments' block mask (built once per pass and window,
    shared by the layers), compiled once per row width (``kernel``: :data:`FLEX_KERNEL`), one dtype for query, key and
    value (autocast's). Soft-capping and sinks go through transformers' integration, which applies them."""
    features = {name: kwargs[name] for name in ("softcap", "s_aux") if kwargs.get(name) is not None}
    query, key, value = autocast_inputs(query, key, value)
    key, value = key.to(query.dtype), value.to(query.dtype)
    block_mask = layout.block_mask(window, query.device)
    if dropout:
        raise RuntimeError(f"flex_attention has no dropout; {type(module).__name__} passes dropout={dropout}")
    if features or query.size(1) % key.size(1):
        from transformers.integrations.flex_attention import flex_attention_forward

        out, _ = flex_attention_forward(module, query, key, value, block_mask, scaling=scaling, **features)
        return out, None
    out = kernel(query, key, value, block_mask, scaling, query.size(1) != key.size(1))
    return out.transpose(1, 2).contiguous(), None
