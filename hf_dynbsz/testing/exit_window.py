"""Tensors of collectives freed on a worker thread, counted, and the abort at exit with its window widened (tests).

In the field, a gloo worker thread that frees a Python tensor of a finished collective (its caller dropped the tensor
first) takes the GIL; if the interpreter is finalizing by then, Python ends the thread inside a ``noexcept`` frame
and the process aborts ("terminate called without an active exception"). Which thread frees a tensor is a race
(the worker's release against the caller's drop), and the window in which that kills the process is microseconds
wide: 3 launches in 60 failed.

:func:`widen_exit_window` watches every tensor handed to a ``torch.distributed`` collective (the collectives run
unchanged) and counts those freed on a thread other than the main thread: over a few dozen collectives that count is
certain to be above zero wherever a caller leaves the last reference to a worker, and zero where it never does. Once
the interpreter has begun to exit (the ``atexit`` handlers run), such a free also makes the worker thread wait, the
GIL released as a slow free would, until the interpreter finalizes or ``seconds`` pass, and then take the GIL back:
the field's abort, every time a free is still pending at exit.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "WorkerFrees", "widen_exit_window"]

#: The ``torch.distributed`` functions whose tensors are watched (looked up on the module at each call, by the plugin,
#: accelerate, TRL and transformers alike).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
)


class WorkerFrees:
    """Watches tensors. ``count``: those freed off the main thread so far; once :attr:`exiting`, such a free holds
    its thread until finalization (at most ``seconds``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.count, self.exiting = seconds, 0, False
        self._main = threading.main_thread().ident
        self._watching: set[weakref.ref] = set()

    def watch(self, value) -> None:
        """Watch ``value``'s tensors (a tensor, or a list or tuple of them)."""
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tensor, torch.Tensor):
                self._watching.add(weakref.ref(tensor, self._freed))

    def exit_begins(self) -> None:
        self.exiting = True

    def _freed(self, reference: weakref.ref) -> None:
        self._watching.discard(reference)
        if threading.get_ident() == self._main:
            return
        self.count += 1
        deadline = time.monotonic() + self.seconds
        while self.exiting and time.monotonic() < deadline and not sys.is_finalizing():
            time.sleep(0.001)  # the GIL is free meanwhile; taking it back while finalizing ends the thread


def widen_exit_window(seconds: float = 10.0) -> WorkerFrees:
    """Wrap :data:`COLLECTIVES` so their tensors are watched (see the module); returns the watcher. Its ``atexit``
    handler marks the exit: call this after registering the handlers it should precede (they run last first)."""
    frees = WorkerFrees(seconds)
    atexit.register(frees.exit_begins)
    for name in COLLECTIVES:
        collective = getattr(dist, name)

        @functools.wraps(collective)
        def watched(*args, _collective=collective, **kwargs):
            for value in (*args, *kwargs.values()):
                frees.watch(value)
            return _collective(*args, **kwargs)

        setattr(dist, name, watched)
    return frees
