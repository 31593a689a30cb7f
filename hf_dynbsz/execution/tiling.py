"""Tile size of TRL's fused LM head and of its distillation divergence: the one knob TRL does not expose (torch layer).

TRL 1.16 computes log-probabilities and entropies without materialising full logits: `add_fused_lm_head`
hands hidden states to `trl.kernels.ChunkedLogProbFunction`, which projects them through the LM head in
tiles of ``TOKEN_CHUNK_SIZE`` tokens (4096) x ``chunk_size`` vocabulary columns (32768, from
``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``), folds each tile into online log-sum-exp statistics,
and recomputes the tiles in backward instead of keeping logits alive. Both sizes are module constants
read at call time, so a tile size is set by swapping them for the duration of a forward/backward.

``tensor_batch_size`` is the number of tokens (rows) per tile. When it is set, the vocabulary width of a
tile also drops from 32768 to :data:`VOCAB_COLUMNS_PER_TILE` columns: on this project's CPU measurement
(`benchmarks/memory.py`) the tile temporaries, not the tile count, dominate peak memory, and narrower
tiles were also faster. Results equal the untiled computation up to fp32 summation order.
"""

from __future__ import annotations

import contextlib
import warnings

VOCAB_COLUMNS_PER_TILE = 8192


def _tile_modules():
    """TRL's two modules holding the tile constants, or None if this TRL no longer has them."""
    try:
        import trl.kernels.chunked_logprob as kernel
        import trl.trainer.utils as trl_utils
    except ImportError:
        return None
    if not hasattr(kernel, "TOKEN_CHUNK_SIZE") or not hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"):
        return None
    return kernel, trl_utils


def _divergence_module():
    """TRL's distillation kernel (``ChunkedDivergenceFunction``), whose tiles are its ``TOKEN_CHUNK_SIZE`` tokens x
    ``VOCAB_CHUNK_SIZE`` vocabulary columns of both models' logits, or None if this TRL has none."""
    try:
        import trl.kernels.chunked_divergence as divergence
    except ImportError:
        return None
    return divergence if hasattr(divergence, "VOCAB_CHUNK_SIZE") else None


_warned_missing = False


@contextlib.contextmanager
def lm_head_tiles(tokens_per_tile: int | None, vocab_columns: int = VOCAB_COLUMNS_PER_TILE):
    """Run TRL's fused LM head (and its distillation divergence, which projects both models' heads the same way) in
    tiles of ``tokens_per_tile`` tokens x ``vocab_columns`` vocabulary entries.

    ``None`` leaves TRL's own tile (4096 x 32768) untouched. Wrap the forward AND the backward: the backward
    recomputes the tiles and reads the token tile size again.
    """
    global _warned_missing
    modules = _tile_modules() if tokens_per_tile is not None else None
    if modules is None:
        if tokens_per_tile is not None and not _warned_missing:
            _warned_missing = True
            warnings.warn(
                "tensor_batch_size is set but this TRL version has no TOKEN_CHUNK_SIZE/_CHUNKED_LOGPROB_CHUNK_SIZE "
                "to tile its fused LM head with; TRL's own tile size is used.",
                RuntimeWarning,
                stacklevel=3,
            )
        yield
        return
    kernel, trl_utils = modules
    divergence = _divergence_module()
    previous = kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = int(tokens_per_tile), int(vocab_columns)
    if divergence is not None:
        previous_divergence = divergence.TOKEN_CHUNK_SIZE, divergence.VOCAB_CHUNK_SIZE
        divergence.TOKEN_CHUNK_SIZE, divergence.VOCAB_CHUNK_SIZE = int(tokens_per_tile), int(vocab_columns)
    try:
        yield
    finally:
        kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = previous
        if divergence is not None:
            divergence.TOKEN_CHUNK_SIZE, divergence.VOCAB_CHUNK_SIZE = previous_divergence
