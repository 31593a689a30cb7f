"""Specification of ``hf-dynbsz report`` (:mod:`hf_dynbsz.report`) and of ``examples/sweep.sh``, which ends with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dynbsz.cli import main

ROOT = Path(__file__).resolve().parents[1]


def write_state(directory: Path, steps: list[dict]) -> Path:
    """A trainer_state.json as ``trainer.save_state()`` writes it: log entries per step, then the summary entry."""
    directory.mkdir(parents=True, exist_ok=True)
    history = [{"step": number, "epoch": 0.1 * number, **entry} for number, entry in enumerate(steps, start=1)]
    history.append({"step": len(steps), "train_runtime": 1.0, "train_loss": 0.1})
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": len(steps), "log_history": history}))
    return directory


def step(tokens_per_second, memory, reward, **more):
    return {
        "dynbsz/tokens_per_second": tokens_per_second,
        "dynbsz/peak_memory_mib": memory,
        "reward": reward,
        "reward_std": 0.05,
        "completions/mean_length": 12.0 * reward,
        "dynbsz/padding_fraction": 0.25,
        "dynbsz/microbatches_max_over_ranks": 3.0,
        "dynbsz/dummy_passes": 0.0,
        "dynbsz/train_seconds": 0.5,
        "dynbsz/shared_tokens_saved": 10.0,
        **more,
    }


def report(*args, capsys):
    capsys.readouterr()
    code = main(["report", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_rows(out: str) -> dict[str, dict[str, str]]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


def test_runs_are_compared_in_one_table_and_one_png(tmp_path, capsys):
    small = write_state(tmp_path / "budget-512", [step(1000, 500, 0.1), step(3000, 700, 0.3)])
    large = write_state(
        tmp_path / "budget-2048",
        [
            step(4000, 900, 0.2, **{"dynbsz/rank_imbalance_after": 1.02}),
            step(6000, 800, 0.4, **{"dynbsz/rank_imbalance_after": 1.04}),
        ],
    )
    png, markdown = tmp_path / "report.png", tmp_path / "report.md"
    code, out, _ = report(small, large, "--png", png, "--markdown", markdown, capsys=capsys)
    assert code == 0
    rows = table_rows(out)
    assert rows["budget-512"]["tokens/s"] == "2,000" and rows["budget-2048"]["tokens/s"] == "5,000"  # means
    assert rows["budget-512"]["peak memory MiB"] == "700" and rows["budget-2048"]["peak memory MiB"] == "900"  # max
    assert rows["budget-512"]["reward (last)"] == "0.300"
    assert rows["budget-512"]["completion length (mean)"] == "2.4"  # mean of 1.2 and 3.6
    assert rows["budget-512"]["padding"] == "25.0%"
    assert rows["budget-512"]["rank imbalance"] == "-" and rows["budget-2048"]["rank imbalance"] == "1.030"
    assert "MFU" not in rows["budget-512"]  # no run logged it: no column
    assert rows["budget-512"]["shared tokens saved/step"] == "10"
    assert markdown.read_text().strip() == "\n".join(line for line in out.splitlines() if line.startswith("|"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_run_of_an_earlier_release_shows_its_metrics_under_their_names_now(tmp_path, capsys):
    """dynbsz/shared_tokens_saved was logged as dynbsz/prompt_tokens_saved before: such a run fills the column."""
    earlier = step(1000, 500, 0.1)
    earlier["dynbsz/prompt_tokens_saved"] = earlier.pop("dynbsz/shared_tokens_saved")
    code, out, _ = report(write_state(tmp_path / "earlier", [earlier]), "--png", tmp_path / "r.png", capsys=capsys)
    assert code == 0 and table_rows(out)["earlier"]["shared tokens saved/step"] == "10"


def test_a_run_without_a_final_state_is_read_from_its_latest_checkpoint(tmp_path, capsys):
    run = tmp_path / "stopped"
    write_state(run / "checkpoint-2", [step(1000, 500, 0.1), step(1000, 500, 0.2)])
    write_state(run / "checkpoint-10", [step(2000, 600, 0.5)] * 10)
    code, out, _ = report(run, "--png", tmp_path / "r.png", capsys=capsys)
    assert code == 0
    assert table_rows(out)["stopped"]["steps"] == "10"  # checkpoint-10, not checkpoint-2 (numeric order)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        ("empty", "holds no trainer_state.json and no checkpoint-N/trainer_state.json"),
        ("no dynbsz metrics", "has no dynbsz/ metrics"),
        ("missing", "is not a directory"),
    ],
)
def test_a_directory_without_a_run_exits_2_naming_it(tmp_path, capsys, content, phrase):
    directory = tmp_path / "run"
    if content == "empty":
        directory.mkdir()
    elif content == "no dynbsz metrics":  # stock GRPOTrainer's state
        write_state(directory, [{"loss": 0.1, "reward": 0.2}])
    code, _, err = report(directory, "--png", tmp_path / "r.png", capsys=capsys)
    assert code == 2
    assert phrase in err and str(directory) in err and "Traceback" not in err


def test_names_must_match_the_directories(tmp_path, capsys):
    run = write_state(tmp_path / "a", [step(1000, 500, 0.1)])
    code, _, err = report(run, "--names", "x,y", capsys=capsys)
    assert code == 2 and "--names gives 2 names for 1 OUTPUT_DIRs" in err


@pytest.mark.long
@pytest.mark.slow
def test_sweep_script_runs_the_example_per_budget_and_reports(tmp_path):
    """examples/sweep.sh end to end, as docs/metrics.md shows it (2 budgets, 2 steps each, offline demo)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("DIFFU_")}
    environment.update(
        STEPS="2",
        BUDGETS="auto 512",
        TILES="256",
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}",
        PYTHONPATH=f"{ROOT}{os.pathsep}{environment.get('PYTHONPATH', '')}",
    )
    result = subprocess.run(
        [
            str(ROOT / "examples" / "sweep.sh"),
            str(tmp_path / "sweep"),
            "--",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
        ],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = table_rows(result.stdout)
    assert set(rows) == {"max_tokens-auto_tensor-256", "max_tokens-512_tensor-256"}
    assert all(row["steps"] == "2" for row in rows.values())
    log = (tmp_path / "sweep" / "max_tokens-512_tensor-256.log").read_text()
    assert "DIFFU_MAX_TOKENS=512 overrides max_tokens_per_microbatch=None" in log  # the variable reached the run
    assert "DIFFU_TENSOR_BATCH_SIZE=256 overrides tensor_batch_size=1024" in log
    assert (tmp_path / "sweep" / "report.png").stat().st_size > 20_000
    assert (tmp_path / "sweep" / "report.md").read_text().count("| max_tokens-") == 2


def test_the_png_draws_the_reward_and_the_completion_length_first(tmp_path, monkeypatch):
    """What an RL user looks at first: the reward (mean and std) and the completion length, beside the efficiency."""
    from hf_dynbsz import report as report_module

    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.set_title", lambda self, title, *a, **k: drawn.append(title))
    run = report_module.read_run(write_state(tmp_path / "run", [step(1000, 500, 0.1), step(2000, 600, 0.5)]))
    report_module.plot_runs([run], tmp_path / "report.png")
    assert drawn[:2] == ["reward: mean (solid) and std (dashed)", "completion length (mean tokens)"]
    assert "padding fraction" in drawn
