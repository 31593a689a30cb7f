"""FSDP on CPU processes, for the tests: accelerate's own FSDP preparation and torch's FSDP under gloo.

accelerate 1.15 turns FSDP on only for processes on an accelerator device: ``AcceleratorState.__init__`` sets
``DistributedType.FSDP`` (``ACCELERATE_USE_FSDP=true``, which ``accelerate launch`` exports for
``distributed_type: FSDP``) in a branch taken only when the process's distributed type is ``MULTI_GPU``,
``MULTI_XPU``, ``MULTI_NPU``, ... (``accelerate/state.py``, the ``elif self.distributed_type in [...]`` after the
DeepSpeed branch), while ``PartialState._prepare_backend`` gives a CPU process ``MULTI_CPU`` (``use_cpu``) or ``NO``.
Launched on CPU, a ``distributed_type: FSDP`` config therefore trains plain data parallelism (DDP over gloo), the
parameters whole on every process. :func:`fsdp_on_cpu` takes the FSDP branch for CPU processes too, as a GPU
process takes it: from there on everything is accelerate's and torch's (``fsdp2_prepare_model``, ``fully_shard``,
DTensor parameters, gloo collectives, sharded checkpoints).
"""

from __future__ import annotations

import os

__all__ = ["fsdp_on_cpu"]


def fsdp_on_cpu() -> bool:
    """In a process that ``accelerate launch`` started for FSDP (``ACCELERATE_USE_FSDP=true``) without an
    accelerator device: make ``AcceleratorState`` choose ``DistributedType.FSDP`` where it would choose
    ``MULTI_CPU``. Call before the first ``Accelerator`` (the trainer's) is built. Returns whether it did."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or torch.cuda.is_available():
        return False
    built = AcceleratorState.__init__
    if getattr(built, "fsdp_on_cpu", False):
        return True

    def init(self, *args, fsdp_plugin=None, **kwargs):
        built(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP  # as the accelerator-device branch sets it
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # (AcceleratorState's last step)

    init.fsdp_on_cpu = True
    AcceleratorState.__init__ = init
    return True
