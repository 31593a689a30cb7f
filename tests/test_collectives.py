"""The plugin's collectives (hf_dynbsz/parallel/collectives.py): no tensor of theirs is freed by a worker thread.

In one process, over a real gloo group of one: a held tensor stays held while a work object of gloo still holds it
and is freed on the calling thread once that is gone; the exit handler releases every hold and destroys the group.
On two processes (``accelerate launch``, gloo): every kind of the plugin's collectives, results dropped at once, then
a plain return while process 0 still works: no tensor of theirs is freed off the main thread (before the holds, 2 to
41 per process and launch were), the process that returns first leaves only after the other reached its exit (the
final barrier), and both exit 0 with the exit window widened (:mod:`hf_dynbsz.testing.exit_window`).
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_dynbsz.parallel.collectives import (
    HeldTensors,
    all_gather_objects,
    close_at_exit,
    gather_values,
    reduce_sum,
)
from hf_dynbsz.testing import REPO_ROOT as ROOT
from hf_dynbsz.testing import accelerate_command, run_with_timeout

LAUNCH_TIMEOUT_S = 240


@pytest.fixture
def gloo_group_of_one():
    """The default group: one process over gloo, whose works run on gloo's worker threads as on several."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- one process ---------------------------------------------------------------------------------------------------
def test_a_held_tensor_outlives_the_work_object_of_gloo_and_is_freed_on_this_thread(gloo_group_of_one):
    held = HeldTensors()
    tensor = torch.ones(4)
    held.hold(tensor)
    work = dist.all_reduce(tensor, async_op=True)  # the work object holds the tensor, as gloo's worker thread does
    work.wait()
    watched = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert held.release() == 1 and watched() is not None  # the work still holds it: so does the hold
    del work
    assert held.release_waiting(5.0) == 0  # (gloo's worker thread drops its reference a moment after the wait)
    assert watched() is None  # freed here, by the release, not by a worker


def test_a_view_of_a_held_tensor_keeps_it_held_and_an_alias_does_not():
    """Why the module hands out ``detach()``ed aliases: a view holds its base, an alias is a tensor of its own."""
    held = HeldTensors()
    tensor = torch.zeros(6)
    held.hold(tensor)
    alias_parts = tensor.detach().split([2, 4])
    assert held.release() == 0
    held.hold(tensor)
    view_parts = tensor.split([2, 4])
    assert held.release() == 1
    del view_parts
    assert held.release() == 0
    assert [part.numel() for part in alias_parts] == [2, 4]


def test_one_tensor_in_two_collectives_is_held_until_both_holds_are_free():
    held = HeldTensors()
    tensor = torch.zeros(2)
    held.hold(tensor)
    held.hold(tensor, torch.ones(1))
    assert held.release() == 0  # two holds, no other holder: both released


def test_on_one_process_the_reductions_and_gathers_return_copies():
    values = torch.tensor([1.0, 2.0])
    total = reduce_sum(values)
    total += 1
    assert values.tolist() == [1.0, 2.0] and total.tolist() == [2.0, 3.0]
    assert [part.tolist() for part in gather_values(values)] == [[1.0, 2.0]]
    assert all_gather_objects({"a": 1}) == [{"a": 1}]


def test_over_a_group_the_gathers_return_each_process_s_values(gloo_group_of_one):
    assert [part.tolist() for part in gather_values(torch.tensor([3, 1, 2]))] == [[3, 1, 2]]
    assert [part.tolist() for part in gather_values(torch.zeros(0))] == [[]]
    assert all_gather_objects(([torch.arange(3)], "text"))[0][1] == "text"
    assert reduce_sum(torch.tensor([2.0])).tolist() == [2.0]


def test_the_exit_handler_releases_every_hold_and_destroys_the_group(gloo_group_of_one):
    from hf_dynbsz.parallel.collectives import HELD

    reduce_sum(torch.ones(3))
    close_at_exit()
    assert len(HELD) == 0
    assert not dist.is_initialized()


# ---- two processes -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_tensor_of_the_plugin_s_collectives_is_freed_by_a_worker_thread_and_the_exit_waits(tmp_path):
    """tests/exit_collectives.py on 2 processes: each runs every kind of the plugin's collectives 5 times, drops what
    they return, and returns (process 0 a second later). Before the holds, 2 to 41 tensors per process were freed on
    gloo's worker threads in each of 3 launches (one still pending while the interpreter finalizes aborts the
    process), and process 1 did not wait for process 0 at exit."""
    command = accelerate_command("cpu_ddp.yaml", "tests/exit_collectives.py", tmp_path / "exit", "--linger", "1")
    output = run_with_timeout(command, ROOT, LAUNCH_TIMEOUT_S, "the plugin's collectives, then a plain exit")
    assert "terminate called" not in output, output[-2000:]
    records = [json.loads(Path(f"{tmp_path / 'exit'}.rank{rank}.json").read_text()) for rank in range(2)]
    assert [record["freed_off_main"] for record in records] == [0, 0]
    assert records[1]["exit_handlers_done"] >= records[0]["lingered_until"]
    assert [record["total_flos"] for record in records] == [5 * (1 + 2)] * 2  # store_flos: every process's count
