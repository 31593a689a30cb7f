"""examples/async_grpo.py: the offline demo (a tiny model, the stand-in rollout worker on a thread producing samples
while the trainer trains, the no-op weight transfer) prints the plan, a line per optimizer step and its summary."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hf_dynbsz.testing import run_with_timeout

ROOT = Path(__file__).resolve().parents[1]


def test_the_offline_demo_trains_steps_of_samples(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "async_grpo.py"), "--max_steps", "3"]
    command += ["--max_completion_length", "64", "--output_dir", str(tmp_path / "out")]
    command += ["--max_tokens_per_microbatch", "200"]
    output = run_with_timeout(command, tmp_path, 600, "examples/async_grpo.py")
    assert "hf_dynbsz batch-size plan" in output
    assert re.search(r"step +3 \| loss=\S+ \| ratio=\S+ .*batch/samples_per_step=16 \| dynbsz/microbatches=\d+", output)
    assert "3 optimizer steps of 16.0 samples" in output
    assert (tmp_path / "out" / "initial-model" / "config.json").exists()
