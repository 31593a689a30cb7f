"""A process killed mid-step and the job restarted from its last checkpoint, for real (opt-in, ``-m long``).

Each trainer, stock and the plugin's, trains 4 optimizer steps on 2 processes with a checkpoint every 2 steps; process
1 kills itself (SIGKILL, as the kernel's out-of-memory killer or a lost machine would) at its second forward with
gradients of step 3, after a pass of that step's backward. The launcher must stop the other process (no hang: every
launch runs under a timeout), the step-2 checkpoint must be the last one, and the relaunch with
``resume_from_checkpoint`` trains steps 3 and 4. The plugin's parameters then equal stock's after the same kill and
restart (within 1e-5, and the update over the whole job, from the saved model to the end, within 1e-3 of stock's),
under DDP, DeepSpeed ZeRO-3 and FSDP2 (its sharded checkpoint written and read on CPU over gloo), each engine the one
its config asks for (the relaunch's parameters sharded under ZeRO-3 and FSDP2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed import BACKENDS, LAUNCH_TIMEOUT_S, ROOT, assert_parameters_match, read_records

from hf_dynbsz.testing import grpo_worker_command, run_with_timeout

pytestmark = [pytest.mark.slow, pytest.mark.long]

#: 4 optimizer steps, a checkpoint every 2, a reference model (beta > 0), several passes per step for the plugin.
RESTARTED_RUN = dict(max_steps=4, save_steps=2, beta=0.1, budget=24)
#: Process 1 kills itself at its 2nd forward with gradients of optimizer step 3.
KILL = "3:2:1"
#: Samples per process per optimizer step (4 per device x 2 accumulation steps): the relaunch generates for 2 steps.
SAMPLES_PER_STEP = 8


def killed_and_restarted(config: str, out: Path, model_dir: str, trainer: str) -> list[dict]:
    """``trainer``'s run killed mid-step 3, then relaunched from its last checkpoint; each rank's record."""
    killed = grpo_worker_command(config, out, model_dir, trainer, kill_at=KILL, **RESTARTED_RUN)
    output = run_with_timeout(
        killed, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} run killed under {config}", expect_failure=True
    )
    assert "process 1: SIGKILL at its forward 2 of optimizer step 3" in output, output[-3000:]
    checkpoints = sorted(path.name for path in Path(f"{out}-run").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2"], checkpoints
    resumed = grpo_worker_command(config, out, model_dir, trainer, resume=True, **RESTARTED_RUN)
    run_with_timeout(resumed, ROOT, LAUNCH_TIMEOUT_S, f"{trainer} run restarted under {config}")
    return read_records(out, config, trainer)


@pytest.mark.parametrize("backend", ["ddp", "zero3", "fsdp2"])
def test_a_process_killed_mid_step_and_the_job_restarted_from_its_checkpoint_matches_stock(
    backend, tmp_path, model_dir
):
    config, _ = BACKENDS[backend]
    stock = killed_and_restarted(config, tmp_path / "stock", model_dir, "stock")
    ours = killed_and_restarted(config, tmp_path / "ours", model_dir, "dynamic")
    for rank in range(2):
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank} generated differently"
        assert len(ours[rank]["completions"]) == 2 * SAMPLES_PER_STEP  # the relaunch trained steps 3 and 4 only
        assert ours[rank]["metrics"], f"rank {rank} logged no dynbsz metrics"
    assert_parameters_match(tmp_path / "ours", tmp_path / "stock")  # initial: the saved model (the relaunch loads it)
