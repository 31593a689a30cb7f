"""Every collective the plugin issues, each tensor held until no worker thread holds it, and the exit handler.

gloo and NCCL run a collective on a thread of their own (gloo's worker loop, NCCL's watchdog), and that thread drops
the finished work object, with every tensor the collective touched, a moment after ``wait()`` returned. torch keeps a
tensor's Python object alive while C++ holds the tensor too: a C++ release that leaves the tensor with the single
reference of its Python object decrefs that object, which takes the GIL, and where Python has dropped the tensor by
then, the worker thread frees it. While the interpreter finalizes, a thread that takes the GIL is ended
(``pthread_exit``, Python 3.13 and earlier), whose unwinding meets a ``noexcept`` frame: the process aborts with
"terminate called without an active exception" (SIGABRT) after training succeeded. torch 2.13 to 2.15 guard that
decref with ``Py_IsInitialized()`` alone, which is still true while the worker waits for the GIL.

So the plugin's collectives go through this module:

* :class:`HeldTensors` holds each tensor a collective touches, from before the collective until the tensor has no
  C++ holder but its Python object and the holds (the work object gone): a ``torch.ScriptList`` of the tensors adds
  one C++ reference, so a worker's release never leaves a tensor with one and never reaches Python. The holds are
  dropped on the thread that issues the collectives (the main thread): at each later collective and at exit. The
  tensors are this module's own: callers get results, ``detach()``ed aliases or views of them, never a view of a held
  tensor (a view holds its base; an alias is a tensor of its own on the same storage).
* :func:`destroy_process_group_at_exit` registers, once per process, an ``atexit`` handler, which runs before the
  interpreter finalizes (:func:`close_at_exit`): a final barrier of the default group, so every process has reached its
  exit and every earlier work of the group has finished, while worker threads may take the GIL; the held tensors
  released on the main thread; the default group destroyed.

Collectives of TRL, accelerate and transformers (reward gathers, ``store_flos``'s gather at the end of ``train()``)
and DDP's gradient all-reduces are theirs, as in stock; the final barrier is what closes their window.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "EXIT_BARRIER_TIMEOUT_S",
    "HELD",
    "HeldTensors",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_to_all_single",
    "close_at_exit",
    "destroy_process_group_at_exit",
    "gather_rows",
    "gather_values",
    "reduce_sum",
]

#: Seconds the exit handler waits at the final barrier for the other processes (one still saving, say) before it
#: leaves without them.
EXIT_BARRIER_TIMEOUT_S = 60.0

#: Seconds the exit handler waits, after the barrier, for a worker thread still holding a work object of the plugin.
RELEASE_TIMEOUT_S = 5.0

_EXIT_HANDLER: list[bool] = [False]  # registered in this process


class HeldTensors:
    """The tensors of this process's collectives, each held from before its collective until no worker holds it."""

    def __init__(self) -> None:
        self._entries: list[tuple[object, list[torch.Tensor]]] = []  # (C++ hold, the tensors), one per collective

    def __len__(self) -> int:
        """Collectives whose tensors are still held."""
        return len(self._entries)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Hold ``tensors`` (before the collective that touches them); drop the holds no worker shares any more."""
        self.release()
        unique = list({id(tensor): tensor for tensor in tensors}.values())
        if unique:
            self._entries.append((torch.ScriptList(unique), unique))

    def release(self) -> int:
        """Drop, on this thread, the holds of every collective whose tensors have no other C++ holder (the work
        object is gone); returns how many collectives stay held."""
        holds = Counter(id(tensor) for _, tensors in self._entries for tensor in tensors)
        self._entries = [
            entry
            for entry in self._entries
            if any(tensor._use_count() > 1 + holds[id(tensor)] for tensor in entry[1])  # 1: its Python object
        ]
        return len(self._entries)

    def release_waiting(self, timeout_s: float) -> int:
        """:meth:`release`, waiting up to ``timeout_s`` (asleep, so a worker thread may run) while a worker still
        holds a work object; returns how many collectives stay held (they are then left to the interpreter)."""
        deadline = time.monotonic() + timeout_s
        while self.release() and time.monotonic() < deadline:
            time.sleep(0.001)
        return len(self._entries)


#: The process's held tensors: every collective below holds its tensors here.
HELD = HeldTensors()


def several_processes(group=None) -> bool:
    """Whether ``group`` (None: the default group) spans more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """``torch.distributed.all_reduce`` of a tensor of the caller's own making, in place, ``tensor`` held."""
    HELD.hold(tensor)
    dist.all_reduce(tensor, op=op, group=group)


def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """``torch.distributed.all_gather`` into ``parts``, every tensor held."""
    HELD.hold(tensor, *parts)
    dist.all_gather(parts, tensor, group=group)


def all_to_all_single(
    received: torch.Tensor, sent: torch.Tensor, receive_splits: list[int], send_splits: list[int], group=None
) -> None:
    """``torch.distributed.all_to_all_single`` with uneven splits (elements), both tensors held."""
    HELD.hold(received, sent)
    dist.all_to_all_single(received, sent, receive_splits, send_splits, group=group)


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over every process of the default group, as a new tensor (accelerate's ``reduce(tensor,
    "sum")``)."""
    total = tensor.detach().clone()
    if several_processes():
        all_reduce(total)
    return total.detach()


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's 1-D ``tensor`` (the same size on every process) of the default group, stacked in process order:
    ``(processes, size)``, a new tensor (one all-gather)."""
    own = tensor.detach().clone()
    if not several_processes():
        return own.unsqueeze(0)
    parts = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    all_gather(parts, own)
    return torch.stack(parts)


def gather_values(values: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every process's 1-D ``values`` (their lengths may differ), in process order: one gather of the lengths, one
    of the values padded to the longest."""
    if not several_processes(group):
        return [values.detach().clone()]
    size = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    all_gather(sizes, size, group)
    lengths = [int(length) for length in sizes]
    padded = values.new_zeros(max(max(lengths), 1))
    padded[: values.numel()] = values.detach()
    parts = [torch.empty_like(padded) for _ in lengths]
    all_gather(parts, padded, group)
    return [part.detach()[:length] for part, length in zip(parts, lengths)]


def all_gather_objects(value, group=None) -> list:
    """Every process's picklable ``value``, in process order (``torch.distributed.all_gather_object``, its tensors
    held)."""
    if not several_processes(group):
        return [value]
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device, copy=True)
    return [pickle.loads(part.cpu().numpy().tobytes()) for part in gather_values(data, group)]


def destroy_process_group_at_exit() -> None:
    """Register :func:`close_at_exit` to run when the interpreter exits, before it finalizes (once per process).

    A script that trains and returns, as TRL's own scripts do, never calls ``trainer.end()``. The handler is a
    no-op where the script destroyed the group itself. It does not stop gloo's threads under DDP: a
    ``DistributedDataParallel`` model keeps the group's backend alive past ``destroy_process_group`` (checked on
    torch 2.13: after it, and after deleting the DDP model, each process still runs gloo's loop thread and two worker
    threads), for stock ``GRPOTrainer`` too; they end with the process.
    """
    if _EXIT_HANDLER[0] or not (dist.is_available() and dist.is_initialized()):
        return
    _EXIT_HANDLER[0] = True
    atexit.register(close_at_exit)


def close_at_exit(barrier_timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> None:
    """Before the interpreter finalizes: a final barrier of the default group (not after an unhandled exception,
    whose process may be the only one to get here), the held tensors released on this (the main) thread, the
    default group destroyed."""
    initialized = dist.is_available() and dist.is_initialized()
    if initialized and not _leaving_on_an_error():
        _final_barrier(barrier_timeout_s)
    left = HELD.release_waiting(RELEASE_TIMEOUT_S)
    if left:
        logger.warning("hf_dynbsz: at exit, a worker thread still held %d collectives' tensors; left held", left)
    if initialized and dist.is_initialized():
        dist.destroy_process_group()


def _leaving_on_an_error() -> bool:
    """Whether the interpreter exits after an unhandled exception (the other processes may be inside a collective
    that this one will never join: a barrier now would be paired with it)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _final_barrier(timeout_s: float) -> None:
    """Wait, up to ``timeout_s``, until every process of the default group has reached its exit. gloo's barrier also
    waits for the group's earlier works; the GIL is free meanwhile for worker threads that release them."""
    started = time.monotonic()
    try:
        work = dist.barrier(async_op=True)
    except Exception as error:  # noqa: BLE001 - a broken group has nothing left to wait for
        logger.warning("hf_dynbsz: the final barrier at exit could not start (%s)", error)
        return
    while not work.is_completed():
        if time.monotonic() - started > timeout_s:
            logger.warning(
                "hf_dynbsz: at exit, the other processes did not reach theirs within %.0f s; leaving without them",
                timeout_s,
            )
            return
        time.sleep(0.005)
