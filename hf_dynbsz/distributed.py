"""The collectives of the schedule over ``torch.distributed`` (torch layer).

:class:`ProcessGroup` implements :class:`hf_dynbsz.schedule.RankGroup` for a run under ``accelerate launch``
(NCCL on GPUs, gloo on CPU); on one process it does no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ProcessGroup"]


class ProcessGroup:
    """All processes of the accelerator's run. Every process must make the same calls in the same order."""

    def __init__(self, accelerator) -> None:
        self.num_processes = accelerator.num_processes
        self.device = accelerator.device

    @property
    def _distributed(self) -> bool:
        return self.num_processes > 1 and dist.is_initialized()

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if not self._distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()
