"""Specification of hf_dynbsz.execution.layout_timing: on CUDA the automatic layout is the fastest of those the
self-check passed, timed on the run's own passes.

The pieces are driven by fake clocks (a pass's seconds are whatever the test says): which pass each candidate runs,
the prediction per cost unit, stock's prediction from the padded rows' rate, one all-gather per measuring step (a
real 2-process gloo group) so that every process keeps the same candidate, the overhead, the metrics. The run itself
(layouts switching pass by pass, parameters equal to stock's) is in ``tests/test_trainer.py``.
"""

from __future__ import annotations

import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dynbsz.execution import layout_timing
from hf_dynbsz.execution.layout_timing import (
    Candidate,
    LayoutTiming,
    PerfCounterClock,
    assign_passes,
    family,
    predicted_seconds,
)
from hf_dynbsz.planning.cost import WorkloadModel
from hf_dynbsz.planning.model_support import VARLEN_ATTN, Layout
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.planning.settings import SharePrefix

QUADRATIC = 0.01  # cost units per attention pair: rows of tens of tokens cost visibly more padded


def candidate(name: str) -> Candidate:
    layout = {
        "varlen": Layout("padding_free", SharePrefix.GROUPS, VARLEN_ATTN, attention="varlen"),
        "flex": Layout("padding_free", SharePrefix.GROUPS, "flex_attention", attention="varlen"),
        "padded": Layout("padded"),
    }[name]
    workload = WorkloadModel(1.0, QUADRATIC / (2 if layout.attention == "varlen" else 1))
    scheduler = Scheduler(layout.name, layout.attention, workload, segment_attention=layout.segment_attention)
    return Candidate(name, scheduler)


class FakeClock:
    """A pass of a candidate takes ``rates[its name] x its cost`` seconds (the test sets the pass's cost in
    ``cost`` before it starts)."""

    def __init__(self, rates: dict[str, float]) -> None:
        self.rates, self.cost = rates, None

    def start(self, label: str):
        return [label, self.cost, False]

    def stop(self, token) -> None:
        token[2] = True

    def seconds(self, token) -> float:
        label, cost, stopped = token
        assert stopped
        return self.rates[label] * cost


def schedule(passes, budget=100):
    return types.SimpleNamespace(microbatches=passes, budget=budget)


def run_step(timing, passes, lengths, clock, budget=100):
    """One training step as the executor runs it: each pass in the layout of its candidate, timed."""
    chosen = timing.pass_candidates(schedule(passes, budget), "training", lengths)
    for position, group in enumerate(passes):
        if chosen is None or not group:
            continue
        index = chosen[position]
        picked = [lengths[i] for i in group]
        clock.cost = timing.candidates[index].cost(picked)
        token = timing.start(index)
        timing.record(index, token, picked)
    return chosen


def costs_of(timing, lengths):
    """The step's cost in each candidate's model, as the executor gives it (the whole step as one pass here)."""
    return lambda: [candidate.cost(lengths) for candidate in timing.candidates]


def test_families_name_the_kernel_work_of_a_layout():
    assert family(Layout("padding_free", SharePrefix.GROUPS, VARLEN_ATTN, attention="varlen")) == "varlen"
    assert family(Layout("padding_free", segment_attention="sdpa", attention="varlen")) == "spans"
    assert family(Layout("padding_free", SharePrefix.GROUPS, "flex_attention")) == "flex"
    assert family(Layout("padding_free", segment_attention="flash_attention_2")) == "flash"
    assert family(Layout("padding_free", attention="varlen")) == "padding_free"
    assert family(Layout("padded", attention_mask=True)) == family(Layout("padded")) == "padded"


def test_each_waiting_candidate_runs_one_of_the_cheapest_passes_that_fits_its_layout():
    candidates = [candidate("varlen"), candidate("padded"), candidate("flex")]
    passes = [[30, 30], [5, 40], [4, 4], [], [10]]  # tokens of each pass's samples; an empty one: a dummy
    # cheapest in the current model: [4, 4] (8), then [10]; [5, 40] padded is 80 tokens: over a budget of 70
    assert assign_passes(passes, candidates, 70, waiting=[1, 2]) == [0, 0, 1, 0, 2]
    assert assign_passes(passes, candidates, 70, waiting=[2]) == [0, 0, 2, 0, 0]
    assert assign_passes(passes, candidates, 7, waiting=[1]) == [0] * 5  # nothing fits: it waits for a later step
    assert assign_passes([[4], [9]], candidates, 70, waiting=[1, 2], keep_one=True) == [1, 0]  # [9]: the current


def test_prediction_is_seconds_per_cost_unit_times_the_steps_cost():
    assert predicted_seconds([2.0, 1.0, 0.0], [100.0, 10.0, 0.0], [50.0, 40.0, 9.0]) == [1.0, 4.0, None]


def test_the_fastest_candidate_is_kept_after_the_warm_up_step_and_published(caplog):
    candidates = [candidate("varlen"), candidate("padded")]
    clock = FakeClock({"varlen": 1e-3, "padded": 2e-3})  # padded rows: twice the seconds per cost unit
    gathered = []
    timing = LayoutTiming(candidates, clock, lambda values: gathered.append(values) or [values])
    lengths = [30, 31, 12, 8, 50, 7]
    passes = [[0, 1], [2, 3], [4, 5]]
    assert run_step(timing, passes, lengths, clock) is None  # the warm-up step runs the current layout only
    assert timing.finish_step(costs_of(timing, lengths), None) is None and not gathered
    assert run_step(timing, passes, lengths, clock) == [0, 1, 0]  # the cheapest pass ([12, 8]) timed padded
    kept = timing.finish_step(costs_of(timing, lengths), stock=None)
    assert kept is candidates[0] and len(gathered) == 1  # one all-gather in the measuring step
    predicted = timing.decision["predicted"]
    assert predicted["varlen"] == pytest.approx(1e-3 * candidates[0].cost(lengths))
    assert predicted["padded"] == pytest.approx(2e-3 * candidates[1].cost(lengths))
    overhead = timing.decision["overhead"]  # the padded pass's seconds less varlen's for it
    assert overhead == pytest.approx(2e-3 * candidates[1].cost([12, 8]) - 1e-3 * candidates[0].cost([12, 8]))
    assert run_step(timing, passes, lengths, clock) is None  # chosen: nothing more is measured
    store = {}
    timing.publish(_Store(store))
    timing.publish(_Store(store))  # once
    assert store == {
        "dynbsz/layout_predicted_seconds/varlen": [predicted["varlen"]],
        "dynbsz/layout_predicted_seconds/padded": [predicted["padded"]],
        "dynbsz/layout_timing_overhead_seconds": [overhead],
    }
    assert "keeps varlen" in caplog.text


class _Store(dict):
    def __init__(self, target):
        super().__init__()
        self.target = target

    def __getitem__(self, key):
        return self.target.setdefault(key, [])


def test_stock_is_predicted_from_the_padded_rows_rate_and_can_win():
    candidates = [candidate("varlen"), candidate("padded")]
    clock = FakeClock({"varlen": 5e-3, "padded": 1e-3})
    timing = LayoutTiming(candidates, clock, lambda values: [values])
    lengths = [20, 20, 20, 20]
    for _ in range(2):
        run_step(timing, [[0, 1], [2, 3]], lengths, clock)
        kept = timing.finish_step(costs_of(timing, lengths), stock=(80, 80 * 20))  # 4 rows of 20: nothing to unpad
    predicted = timing.decision["predicted"]
    assert predicted["stock"] == pytest.approx(1e-3 * candidates[1].scheduler.workload.of(80, 80 * 20))
    assert timing.decision["chosen"] == "padded" and kept is candidates[1]  # padded equals stock here: the layout
    timing = LayoutTiming(candidates, clock, lambda values: [values])
    for _ in range(2):
        run_step(timing, [[0, 1], [2, 3]], lengths, clock)
        kept = timing.finish_step(costs_of(timing, lengths), stock=(40, 40 * 20))  # a stock cheaper in the cost model
    assert timing.decision["chosen"] == "stock" and kept is None  # None: dynamic batching off


def test_a_candidate_never_timed_is_left_out_after_the_measuring_steps():
    candidates = [candidate("varlen"), candidate("padded")]
    clock = FakeClock({"varlen": 1e-3, "padded": 1e-4})
    timing = LayoutTiming(candidates, clock, lambda values: [values])
    lengths = [40, 40]
    kept = []
    for _ in range(1 + layout_timing.MEASURING_STEPS):
        run_step(timing, [[0, 1]], lengths, clock, budget=50)  # padded (80 tokens) never fits: never timed
        kept.append(timing.finish_step(costs_of(timing, lengths), None))
    assert kept == [None] * layout_timing.MEASURING_STEPS + [candidates[0]]  # decided after the measuring steps
    assert timing.decision["predicted"]["padded"] is None
    timing = LayoutTiming(candidates, clock, lambda values: [values])
    assignments = []
    for _ in range(3):  # one pass a step: the current layout is timed first, then padded (it fits now)
        assignments.append(run_step(timing, [[0, 1]], lengths, clock, budget=80))
        kept = timing.finish_step(costs_of(timing, lengths), None)
    assert assignments == [None, [0], [1]] and kept is candidates[1]  # padded: 10x faster per unit


def test_perf_counter_clock_measures_wall_time():
    clock = PerfCounterClock()
    token = clock.start("varlen")
    sum(range(10000))
    clock.stop(token)
    assert 0 < clock.seconds(token) < 1


def _agree_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:

        def all_gather(values):
            out = [None, None]
            dist.all_gather_object(out, values)
            return out

        candidates = [candidate("varlen"), candidate("padded")]
        # each process alone would choose differently: process 0 sees padded slow, process 1 sees it fast
        clock = FakeClock({"varlen": 1e-3, "padded": 3e-3 if rank == 0 else 0.2e-3})
        timing = LayoutTiming(candidates, clock, all_gather)
        lengths = [30, 31, 12, 8] if rank == 0 else [9, 9, 40, 41]
        for _ in range(2):
            run_step(timing, [[0, 1], [2, 3]], lengths, clock)
            kept = timing.finish_step(costs_of(timing, lengths), None)
        results[rank] = (kept.name, timing.decision["predicted"])
    finally:
        dist.destroy_process_group()


def test_every_process_keeps_the_same_candidate_from_one_all_gather():
    """Two gloo processes whose own timings disagree: the all-gather of their sums gives both the same totals."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_agree_worker, args=(port, results), nprocs=2, join=True, start_method="spawn")
    assert results[0] == results[1]
    assert torch.isfinite(torch.tensor(list(results[0][1].values()))).all()
