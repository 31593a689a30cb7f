"""Device memory, measured around each pass; out-of-memory errors recognised; and injected ones, for tests.

The torch side of :mod:`hf_dynbsz.planning.memory` (which models and decides, without torch):

* :func:`release_cached_memory` gives freed memory back before a pass is measured (the measuring itself is
  :class:`hf_dynbsz.execution.metrics.PeakMemory`), :func:`pending_gradient_mib` the gradients a backward will allocate.
* :func:`map_large_blocks` makes a CPU process's resident set follow what its tensors hold, for a memory limit to
  bound: glibc then maps every block of :data:`MAPPED_BLOCK_BYTES` or more on its own and unmaps it when freed.
  By default glibc raises that threshold (up to 32 MiB) each time it frees a larger mapped block, after which a
  pass's tensors come from the heap, whose free pieces stay resident and are reused in an order that depends on the
  heap's history: the same pass then peaked 1.7-2.3x what it peaks at with the blocks mapped, differently in each
  process and each time (issue 58's 280 MiB between identical capped runs; ``benchmarks/memory_budget.py``, section
  4). Mapping costs CPU time: about 20% of a forward and backward's there.
* :func:`is_out_of_memory` recognises an allocator's out-of-memory error: ``torch.OutOfMemoryError`` (CUDA, and
  the injected ones), the CPU allocator's ``RuntimeError`` ("can't allocate memory"), ``MemoryError``.
* :func:`inject_out_of_memory` arms one ``torch.OutOfMemoryError`` in a later pass (training forward or backward, a
  no-grad log-prob or teacher pass, or a forward of the self-check at start), raised from inside the model (the
  middle decoder layer) so that the pass fails with a partial graph and, in backward, with some gradients already
  accumulated. ``HF_DYNBSZ_INJECT_OOM`` arms one in a launched process: ``kind:phase:pass[:rank]`` (e.g.
  ``training:backward:2:1``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass

import torch

__all__ = [
    "MAPPED_BLOCK_BYTES",
    "inject_out_of_memory",
    "injected_fault",
    "is_out_of_memory",
    "map_large_blocks",
    "pending_gradient_mib",
    "release_cached_memory",
    "reset_peak_rss",
    "status_mib",
]

_OUT_OF_MEMORY_TEXT = ("out of memory", "can't allocate memory", "not enough memory", "cannot allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (CUDA or CPU), not a bug."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error).lower() for text in _OUT_OF_MEMORY_TEXT)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def status_mib(key: str) -> float | None:
    """A ``/proc/self/status`` memory figure in MiB (``VmRSS``, ``VmHWM``, ...); None where there is none."""
    try:
        with open("/proc/self/status") as handle:
            match = re.search(rf"{key}:\s+(\d+) kB", handle.read())
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def reset_peak_rss() -> bool:
    """Restart the process's peak resident set (``VmHWM``) at its current resident set, by writing 5 to
    ``/proc/self/clear_refs`` (Linux >= 4.0). Returns False where that is not possible (not Linux, or not allowed):
    the peak then counts from the process's start."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def release_cached_memory(device: torch.device) -> None:
    """Give memory freed by the last pass back (CUDA's cache; glibc's free heap pages), so what is measured next is
    what the process holds, and a pass retried after running out of memory starts from it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


#: Blocks of at least this many bytes are mapped on their own under a memory limit on CPU (glibc's initial
#: ``M_MMAP_THRESHOLD``, kept there: :func:`map_large_blocks`).
MAPPED_BLOCK_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(device: torch.device) -> bool:
    """On a CPU with glibc, map every allocation of :data:`MAPPED_BLOCK_BYTES` or more on its own from now on (and
    give it back to the system when freed): ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc from raising the
    threshold as mapped blocks are freed. A process's resident set is then what its tensors hold, the same for the
    same pass, and a memory limit bounds it; otherwise freed heap pieces stay resident in an order no model can
    predict (see the module). Process-wide and for the rest of the process. Returns whether it was set (False on
    CUDA, whose allocator counters the limit reads instead, and without glibc)."""
    if device.type == "cuda" or _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES))


def pending_gradient_mib(model: torch.nn.Module) -> float:
    """MiB of the gradients a backward would allocate now: trainable parameters whose ``.grad`` is None (DeepSpeed
    keeps its own gradient buffers, allocated at start and so part of what the process holds)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None) / 2**20


# ---------------------------------------------------------------------- injected faults (tests)
@dataclass
class _Fault:
    kind: str  # "training", "logprob", "teacher" or "check" (the self-check's passes)
    phase: str  # "forward" or "backward" ("forward" only for "logprob")
    remaining: int  # passes of this kind to let through first
    rank: int | None = None


_FAULTS: list[_Fault] = []


def inject_out_of_memory(
    kind: str = "training", phase: str = "forward", after: int = 0, rank: int | None = None
) -> None:
    """Arm one ``torch.OutOfMemoryError`` in the pass of ``kind`` after ``after`` passes of that kind, in its
    ``phase``, on process ``rank`` (None: any). For tests of the recovery; fires once."""
    if (
        kind not in ("training", "logprob", "teacher", "check")
        or phase not in ("forward", "backward")
        or (kind != "training" and phase == "backward")
    ):
        raise ValueError(
            "an injected fault is training:forward, training:backward, logprob:forward, teacher:forward or "
            f"check:forward, got {kind}:{phase}"
        )
    _FAULTS.append(_Fault(kind, phase, int(after), rank))


def _arm_from_environment() -> None:
    value = os.environ.pop("HF_DYNBSZ_INJECT_OOM", None)
    if value:
        kind, phase, after, *rank = value.split(":")
        inject_out_of_memory(kind, phase, int(after), int(rank[0]) if rank else None)


_arm_from_environment()  # a launched process's HF_DYNBSZ_INJECT_OOM, once


class _InjectedOutOfMemory(torch.OutOfMemoryError):
    pass


def _decoder_layer(model: torch.nn.Module) -> torch.nn.Module:
    layers = [
        m
        for m in model.modules()
        if type(m).__name__.endswith(("DecoderLayer", "Block", "Layer")) and any(True for _ in m.parameters())
    ]
    return layers[len(layers) // 2] if layers else model


@contextlib.contextmanager
def injected_fault(model: torch.nn.Module, kind: str, rank: int):
    """Around one pass of ``kind``: raise an armed fault from inside ``model`` (its middle decoder layer)."""
    fault = next((f for f in _FAULTS if f.kind == kind and f.rank in (None, rank)), None)
    if fault is not None and fault.remaining > 0:
        fault.remaining -= 1
        fault = None
    if fault is None:
        yield
        return
    _FAULTS.remove(fault)
    message = f"injected out-of-memory error ({kind} {fault.phase}, process {rank})"

    def raise_in_backward(grad):
        raise _InjectedOutOfMemory(message)

    def hook(module, args, output):
        if fault.phase == "forward":
            raise _InjectedOutOfMemory(message)
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(raise_in_backward)

    handle = _decoder_layer(model).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
