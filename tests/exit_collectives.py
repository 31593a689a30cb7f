"""Worker of tests/test_collectives.py: `accelerate launch --config_file cpu_ddp.yaml tests/exit_collectives.py OUT`.

Each process runs every kind of collective the plugin issues, ``--rounds`` times, and drops every result at once, as
the end of a training step does: the schedule's all-reduce and all-gather, the exchange's all-to-all (samples to the
processes that run them and results back), the step metrics' sums and gathers, the router aux loss's sums, the
sequence-parallel pooling's object gather, and the trainer's FLOP count gather (``store_flos``, the last collective
of ``train()``). Then it returns, as a user's script returns after ``train()``, process 0
``--linger`` seconds later than the others (it still saves, say). The exit window is widened
(:mod:`hf_dynbsz.testing.exit_window`): a tensor of one of these collectives freed on a gloo worker thread aborts the
process at finalization, every time.

An ``atexit`` handler registered before the plugin's, so it runs after it, writes ``OUT.rank<N>.json``: this
process's frees off the main thread, when its exit handlers ended, (process 0) when it stopped lingering, and the
FLOP count ``store_flos`` summed (process ``p`` counts ``p + 1`` per round).
"""

from __future__ import annotations

import argparse
import atexit
import json
import time
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from transformers.training_args import ParallelMode

from hf_dynbsz import DynamicBatchGRPOTrainer
from hf_dynbsz.execution.router_loss import RouterAuxLoss
from hf_dynbsz.execution.sequence_parallel import SequenceParallel
from hf_dynbsz.parallel.collectives import destroy_process_group_at_exit, gather_rows
from hf_dynbsz.parallel.distributed import ProcessGroup
from hf_dynbsz.planning.schedule import Exchange
from hf_dynbsz.testing.exit_window import widen_exit_window


def one_round(group: ProcessGroup, accelerator, sequence_parallel: SequenceParallel, step: int, flops) -> None:
    """Every kind of the plugin's collectives once; nothing they return is kept."""
    rank, count = group.rank, group.num_processes
    group.all_reduce_max([rank, step])
    group.all_gather(list(range(rank + step % 3)))
    shapes = [[(2, 3), (1, 4)] for _ in range(count)]  # two samples per process; each sends its second on
    exchange = Exchange(rank, shapes, [[process, (process + 1) % count] for process in range(count)])
    records = [torch.full((p + c,), float(rank), dtype=torch.float64) for p, c in shapes[rank]]
    moved = group.send_to_runners(records, exchange, lambda p, c: p + c)
    group.return_rows(
        [torch.ones(1, c) for _, c in (shapes[origin][i] for origin, i in exchange.incoming)], exchange, 4, 1
    )
    del moved
    gather_rows(torch.rand(6, dtype=torch.float64))  # the step metrics' gather (StepMetrics.publish)
    aux = RouterAuxLoss(1.0, 4, 2, 2 * count, 1, accelerator.device)
    aux.agree(accelerator)
    aux.publish({"aux_loss": []}, accelerator)
    sequence_parallel._gather_objects(([torch.arange(rank + 2)], rank, "text"))
    flops.current_flos = float(rank + 1)
    DynamicBatchGRPOTrainer.store_flos(flops)  # the trainer's own method, on the parts of a trainer it reads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=10.0, help="seconds a worker's free at exit waits at most")
    parser.add_argument("--linger", type=float, default=1.0)
    cli = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    record = {"rank": rank}

    def write_record() -> None:  # registered first: runs after the plugin's exit handler
        record.update(freed_off_main=frees.count, exit_handlers_done=time.time())
        with open(f"{cli.out}.rank{rank}.json", "w") as handle:
            json.dump(record, handle)

    atexit.register(write_record)
    destroy_process_group_at_exit()  # as DynamicBatchGRPOTrainer's constructor does
    frees = widen_exit_window(cli.window)
    group = ProcessGroup(accelerator)
    sequence_parallel = SequenceParallel(size=group.num_processes, rank=rank, group=None, peers=None)
    flops = SimpleNamespace(
        args=SimpleNamespace(parallel_mode=ParallelMode.DISTRIBUTED, device=accelerator.device),
        state=SimpleNamespace(total_flos=0.0),
        current_flos=0.0,
    )
    for step in range(cli.rounds):
        one_round(group, accelerator, sequence_parallel, step, flops)
    record["total_flos"] = flops.state.total_flos
    if rank == 0:
        time.sleep(cli.linger)
        record["lingered_until"] = time.time()


if __name__ == "__main__":
    main()
