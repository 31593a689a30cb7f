"""Counting the plugin's own host reads: the calls that, on a GPU, make the host wait for the device.

On CUDA a pass's host waits for the device when code reads a tensor's value (``.item()``, ``.tolist()``, ``bool()``,
``int()``, ``float()``, an index), makes a shape that depends on values (``nonzero``, a boolean-mask index,
``masked_select``, ``unique``, ``bincount``), copies device data to the host (``.cpu()``, ``.numpy()``) or copies host
data to the device without ``non_blocking`` (``.to(device)``, ``torch.tensor(..., device=...)``). A CPU has no device
to wait for, so :class:`HostReads` counts those calls instead, made from the plugin's own code (a frame of
``hf_dynbsz`` outside ``hf_dynbsz.testing``), while it is active and not paused: a test runs a pass's forward, loss,
backward and metrics under it (the pass's building, on the host by design, paused). The GPU check counts the real
synchronisations with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads"]

#: Reads of a value, shapes that depend on values, copies to the host.
_READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select", "unique",
    "unique_consecutive", "bincount", "cpu", "numpy", "argwhere",
}  # fmt: skip
#: Calls that copy host data to a device when given one.
_MOVES = {"to", "cuda", "tensor", "as_tensor", "copy_"}


def _device_argument(args, kwargs) -> bool:
    """Whether a call names a device (a ``.to(device)`` rather than a ``.to(dtype)``)."""
    values = [*args[1:], *kwargs.values()]
    return "device" in kwargs or any(isinstance(v, (torch.device, str)) for v in values)


def _boolean_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(part) and part.dtype == torch.bool for part in parts)


def _own_caller(owners: tuple[str, ...]) -> str | None:
    """``file:line`` of the first frame outside torch and this module, when it is in one of ``owners`` (path parts)
    and not in ``hf_dynbsz/testing``."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("/testing/host_reads.py"):
            if any(owner in name for owner in owners) and "/hf_dynbsz/testing/" not in name:
                return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


class HostReads(TorchFunctionMode):
    """While active (``with HostReads() as reads:``), counts the plugin's calls that would make a GPU pass wait:
    ``reads.found`` counts ``(kind, "folder/module.py:line")``; :meth:`paused` stops counting inside it. ``owners``:
    the path parts of the files whose calls count (default: the plugin's)."""

    def __init__(self, owners: tuple[str, ...] = ("/hf_dynbsz/",)) -> None:
        super().__init__()
        self.owners = owners  # whose calls count: path parts of their files
        self.found: Counter = Counter()
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.found.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            name = getattr(func, "__name__", "")
            kind = None
            if name in _READS:
                kind = name
            elif name == "__getitem__" and _boolean_index(args):
                kind = "boolean index"
            elif name in _MOVES and _device_argument(args, kwargs):
                kind = f"{name}(device)"
            where = _own_caller(self.owners) if kind else None
            if where:
                self.found[(kind, where)] += 1
        return func(*args, **kwargs)
