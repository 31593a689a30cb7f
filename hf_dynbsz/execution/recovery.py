"""Out-of-memory recovery for a step's passes (torch layer).

The shape users know is accelerate's ``find_executable_batch_size``: run, and on an out-of-memory error halve the
batch and run again. Here the step's passes are re-planned instead: the failed pass teaches the memory model
(:mod:`hf_dynbsz.planning.memory`) the point where it ran out, the next budget is the largest the model predicts to
fit, and the step runs again from no gradients, so its update is stock's.

Where recovery runs: one process, or several processes with a memory limit (every process must agree that none
failed before gradients synchronise, which a memory limit arranges: training passes then synchronise in a dummy
pass after the agreement), and not under DeepSpeed, whose engine keeps a step's accumulated gradients (and, under
ZeRO-3, the other processes' parameter gathers) where they cannot be discarded, nor under FSDP on several processes
(each layer's forward and backward gather its parameters with the others: a pass that fails part way leaves them
waiting), nor under sequence parallelism.
Elsewhere the error is raised with why and what to set. The self-check's passes at start recover more widely
(:meth:`OutOfMemoryRecovery.recovers_in_check`; :func:`~hf_dynbsz.execution.self_check.check_layouts`).
"""

from __future__ import annotations

import logging

from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

from hf_dynbsz.execution.device_memory import is_out_of_memory, release_cached_memory
from hf_dynbsz.parallel.distributed import parameter_gathering
from hf_dynbsz.planning.memory import FailedPass, MemoryModel, OutOfMemoryBudgetError

logger = logging.getLogger("hf_dynbsz")

__all__ = ["OutOfMemoryRecovery"]


class OutOfMemoryRecovery:
    """What happens when a pass runs out of memory: recorded and retried with a smaller budget, or raised."""

    def __init__(self, accelerator, memory: MemoryModel, meters, *, sequence_parallel_size: int) -> None:
        self.accelerator, self.memory, self.meters = accelerator, memory, meters
        self.processes = accelerator.num_processes
        self.enabled = (
            accelerator.distributed_type != DistributedType.DEEPSPEED
            and parameter_gathering(accelerator) is None
            and (self.processes == 1 or memory.limit_mib is not None)
            and sequence_parallel_size == 1
        )
        self.failures_alone = 0  # consecutive failures of a pass of one sequence

    def syncs_apart(self, kind: str) -> bool:
        """Whether ``kind``'s passes synchronise gradients in a dummy pass after every process agreed none failed."""
        return kind == "training" and self.enabled and self.processes > 1

    def check(self, error: BaseException) -> None:
        """Return when ``error`` is an allocator's out-of-memory error that is recovered here; raise it otherwise
        (an unrecovered out-of-memory error with a note saying why and what to set)."""
        if not is_out_of_memory(error):
            raise error
        if not self.enabled:
            error.add_note(self.unrecovered_reason())
            raise error

    @staticmethod
    def settle(model) -> None:
        """After a pass that raised a recovered error: DDP decides at the end of each forward whether the next one
        broadcasts the module buffers (``require_forward_param_sync``: after a forward with gradient sync), and a
        forward that raised never reached its end. Every pass of the other processes here completed inside
        ``no_sync`` (a training pass synchronises in a dummy pass after the agreement) or without gradients, which
        leaves it False: so does this process, or its next forward alone would broadcast and wait for the others."""
        if isinstance(model, DistributedDataParallel):
            model.require_forward_param_sync = False

    def agree(self, failure: FailedPass | None, group, kind: str) -> FailedPass | None:
        """Every process learns whether one failed, or gave up (one all-reduce where recovery spans processes)."""
        if self.enabled and self.processes > 1:
            hopeless = failure is not None and failure.samples == 1 and self.failures_alone >= 1
            agreed = group.all_reduce_max([2 if hopeless else int(failure is not None)])[0]
            if agreed and failure is None:
                failure = FailedPass(kind, 0, 0, None, 0, 0, "a pass of another process ran out of memory")
            if agreed == 2:
                failure.hopeless = True
        if failure is None:
            self.failures_alone = 0
        return failure

    def recover(self, model, failure: FailedPass) -> None:
        """After a pass ran out of memory (here or on another process): discard the step's gradients, teach the
        memory model the failed point; the caller re-plans. Raises when one sequence alone failed again."""
        self.meters.oom_retries += 1
        if failure.kind == "training":
            model.zero_grad(set_to_none=True)  # the step's gradients so far: the step runs again from none
        release_cached_memory(self.accelerator.device)
        if failure.samples:
            self.memory.record_failure(failure.kind, failure.tokens, failure.pairs, failure.held, failure.path_keys)
        if failure.samples == 1:
            self.failures_alone += 1
        if failure.hopeless or (self.processes == 1 and self.failures_alone >= 2):
            raise OutOfMemoryBudgetError(failure.explain(self.memory))
        logger.warning(
            "hf_dynbsz: %s; the step's passes are re-planned with a smaller budget (%s retry this step).",
            failure.explain(self.memory),
            self.meters.oom_retries,
        )

    def recovers_in_check(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a pass of the self-check at start, is an out-of-memory error recovered there
        (:func:`~hf_dynbsz.execution.self_check.run_self_check`'s ``recovers``); raises it where it cannot be, with
        why. The check's passes run the unwrapped model and take their gradients with ``torch.autograd.grad``:
        nothing accumulates and no gradient synchronises, and the processes agree in the check's own all-reduce, so
        it is recovered wherever no forward gathers parameters with the other processes."""
        if not is_out_of_memory(error):
            return False
        gathering = parameter_gathering(self.accelerator)
        if gathering is not None:
            error.add_note(
                f"hf_dynbsz: this out-of-memory error in the self-check at start is not recovered under {gathering} "
                "on several processes, where every forward gathers each layer's parameters with the other processes: "
                "a pass that fails part way leaves the others waiting in a gather. Set self_check=False, or free "
                "memory for the check's few short passes."
            )
            raise error
        return True

    def unrecovered_reason(self) -> str:
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            why = (
                "under DeepSpeed, whose engine keeps the step's accumulated gradients (and, under ZeRO-3, the other "
                "processes' parameter gathers) where they cannot be discarded: this process stops and the launcher "
                "stops the others"
            )
        elif parameter_gathering(self.accelerator) is not None:
            why = (
                "under FSDP on several processes, where every pass gathers each layer's parameters with the other "
                "processes, in its forward and its backward: a pass that fails part way leaves the others waiting in "
                "a gather. This process stops and the launcher stops the others"
            )
        else:
            why = (
                "on several processes without max_memory_per_device_mib (recovery needs every process to agree "
                "before gradients synchronise, which a memory limit turns on)"
            )
        return (
            f"hf_dynbsz: this out-of-memory error is not recovered {why}. Set max_memory_per_device_mib so that "
            "budgets are chosen to fit, or lower max_tokens_per_microbatch."
        )
