"""Two machines, for real (opt-in, ``-m long``): two ``accelerate launch`` commands on this host, one process each,
joined over TCP (``--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1 --main_process_port P``), started
together under one timeout that kills both.

The plugin trained on two machines ends with the parameters stock ``GRPOTrainer`` ends with on one machine with two
processes (within 1e-5, its update within 1e-3 of stock's, both runs moved the parameters), with the same completions
on every rank, and cross-rank balancing moves samples between the machines (every long completion is on the second
machine's process).
"""

from __future__ import annotations

import socket

import pytest
from test_distributed import (
    BALANCED,
    LAUNCH_TIMEOUT_S,
    LOPSIDED_ROLLOUT,
    ROOT,
    assert_parameters_match,
    launch,
    read_records,
)

from hf_dynbsz.testing import grpo_worker_command, run_together

pytestmark = [pytest.mark.slow, pytest.mark.long]

#: Every long completion on the process of the second machine (balancing moves samples over TCP), beta > 0.
TWO_MACHINE_RUN = dict(LOPSIDED_ROLLOUT, **BALANCED["ddp"][1])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_machines_of_one_process_each_match_stock_on_one_machine(tmp_path, model_dir):
    port, out = free_port(), tmp_path / "two-machines"
    machines = [
        grpo_worker_command("cpu_ddp.yaml", out, model_dir, "dynamic", machine=(rank, 2, port), **TWO_MACHINE_RUN)
        for rank in range(2)
    ]
    run_together(machines, ROOT, LAUNCH_TIMEOUT_S, "the plugin on 2 machines x 1 process")
    ours = read_records(out, "cpu_ddp.yaml", "dynamic on 2 machines")
    stock = launch("cpu_ddp.yaml", tmp_path / "one-machine", model_dir, "stock", **TWO_MACHINE_RUN)
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        assert all(step["dynbsz/samples_moved"] > 0 for step in ours[rank]["metrics"])  # across the machines
    assert_parameters_match(out, tmp_path / "one-machine")
