"""The user-facing example and the drop-in promise, run for real (subprocesses, no network).

* ``examples/grpo.py`` in short mode, single process (the offline demo);
* the same under ``accelerate launch`` with 2 CPU processes and DeepSpeed ZeRO-2 (slow);
* a script written for stock ``GRPOTrainer`` runs with only the class swapped, and its first step matches stock;
* ``--resume_from_checkpoint`` continues a run from a mid-run checkpoint, here in the script's
  ``--model_name_or_path`` / ``--dataset_name`` mode on a local model and a local dataset.

Every subprocess runs in its own process group under a timeout; on timeout the whole group is killed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from hf_dynbsz.testing import run_with_timeout, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo.py"
TIMEOUT_S = 300
# Small enough for CI, large enough that lengths vary: 2 prompts x 4 completions per optimizer step.
SHORT = [
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--num_generations",
    "4",
    "--max_completion_length",
    "32",
]


def run(command: list[str], cwd: Path, timeout: float = TIMEOUT_S) -> str:
    """Run ``command`` in a new process group; return its output (stdout + stderr); fail on error or timeout."""
    return run_with_timeout(command, cwd, timeout, " ".join(command))


def summary_steps(output: str) -> int:
    match = re.search(r"Summary: (\d+) optimizer steps", output)
    assert match, f"no summary in the output:\n{output[-3000:]}"
    return int(match.group(1))


def run_demo(script: Path, tmp_path: Path, steps: int, metrics: str, *options: str) -> str:
    """``script``'s offline demo for ``steps`` optimizer steps (``options``: more of its flags), its output in
    ``tmp_path/out``; returns what it printed, having checked what every demo prints: the plan at train start, the
    last step's line opening with ``metrics`` (a regular expression) and naming its micro-batches against stock's 2,
    and the summary of ``steps`` steps."""
    command = [sys.executable, str(script), "--max_steps", str(steps), "--output_dir", str(tmp_path / "out")]
    output = run([*command, *options], cwd=tmp_path)
    assert "hf_dynbsz batch-size plan" in output
    step_line = rf"step +{steps} \| {metrics}.*dynbsz/microbatches_max_over_ranks=\d+ \(stock 2\)"
    assert re.search(step_line, output), output[-3000:]
    assert summary_steps(output) == steps
    return output


def write_dataset(directory: Path, rows: list[dict]) -> str:
    """``rows`` as ``directory/train.jsonl``, a local dataset ``--dataset_name`` loads as it would a Hub one."""
    directory.mkdir()
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(directory)


def run_named_step(script: Path, tmp_path: Path, *options: str) -> None:
    """``script`` on models and a dataset by name (``options``) for one fp32 step of 4 samples per device: TRL loads
    them, the step trains and logs the plugin's metrics."""
    fixed = ["--max_steps", "1", "--bf16", "false", "--output_dir", str(tmp_path / "named")]
    output = run([sys.executable, str(script), *options, *fixed, "--per_device_train_batch_size", "4"], cwd=tmp_path)
    assert summary_steps(output) == 1 and "dynbsz/computed_tokens=" in output


def test_example_short_single_process(tmp_path):
    output = run_demo(EXAMPLE, tmp_path, 3, r"reward=", *SHORT)
    # Per step, the metrics under the names they are logged as.
    line = re.search(
        r"step +3 \| reward=[0-9.]+ \| completions/mean_length=[0-9.]+ \| "
        r"dynbsz/microbatches_max_over_ranks=\d+ \(stock 2\) \| dynbsz/padding_fraction=[0-9.]+ \| "
        r"dynbsz/computed_tokens=\d+ \| dynbsz/stock_computed_tokens=\d+ \| "
        r"dynbsz/tokens_per_second=\d+ \| dynbsz/peak_memory_mib=\d+ \| loss=",
        output,
    )
    assert line, output[-3000:]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())  # saved for `hf-dynbsz report`
    logged = [entry for entry in state["log_history"] if entry.get("step") == 3 and "dynbsz/computed_tokens" in entry]
    assert f"dynbsz/computed_tokens={logged[0]['dynbsz/computed_tokens']:.0f}" in line.group(0)
    assert re.search(r"reward +first 1 logged steps [0-9.]+ -> last 1 [0-9.]+", output)
    assert re.search(r"micro-batches +\d+ run per process vs 6 with stock's fixed 2", output)
    assert re.search(r"tokens computed +[\d,]+ vs [\d,]+ with stock batching", output)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "tokenizer.json").exists()


@pytest.mark.long
@pytest.mark.slow
def test_example_under_accelerate_zero2(tmp_path):
    config = ROOT / "accelerate_configs" / "cpu_zero2.yaml"
    output = run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            str(EXAMPLE),
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
            *SHORT,
        ],
        cwd=tmp_path,
    )
    assert re.search(r"DeepSpeed ZeRO stage +2 ", output)
    assert summary_steps(output) == 2
    assert "on 2 process(es)" in output
    for rank in range(2):  # both ranks got to the end
        assert f"[process {rank} of 2] finished at optimizer step 2" in output, output[-3000:]


STOCK_SCRIPT = """
import json, sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]


def reward_len(completions, **kwargs):
    return [-abs(12 - len(completion)) for completion in completions]


dataset = Dataset.from_dict({"prompt": ["abc", "abcdabcd", "dd", "cab", "bbbbbbbbbbbb", "a", "acd", "dcba"]})
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  num_generations=4, max_completion_length=24, max_steps=2, learning_rate=1e-3, seed=0,
                  logging_steps=1, report_to="none", save_strategy="no", bf16=False, use_cpu=True,
                  disable_tqdm=True)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
trainer.train()
print("LOG_HISTORY=" + json.dumps(trainer.state.log_history))
"""


def swap_class(script: str) -> str:
    """The whole migration: import the subclass, use it instead of GRPOTrainer."""
    swapped = script.replace(
        "from trl import GRPOConfig, GRPOTrainer",
        "from trl import GRPOConfig\nfrom hf_dynbsz import DynamicBatchGRPOTrainer",
    )
    return swapped.replace("GRPOTrainer(", "DynamicBatchGRPOTrainer(")


def log_history(output: str) -> list[dict]:
    line = next(line for line in output.splitlines() if line.startswith("LOG_HISTORY="))
    return json.loads(line.removeprefix("LOG_HISTORY="))


def test_stock_script_runs_with_the_class_swapped(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "model"))
    swapped = swap_class(STOCK_SCRIPT)
    assert swapped.count("DynamicBatchGRPOTrainer") == 2 and "hf_dynbsz" not in STOCK_SCRIPT
    histories = {}
    for name, text in (("stock", STOCK_SCRIPT), ("swapped", swapped)):
        script = tmp_path / f"{name}.py"
        script.write_text(text)
        histories[name] = log_history(run([sys.executable, str(script), model_dir, str(tmp_path / name)], cwd=tmp_path))
    stock, ours = ([entry for entry in histories[name] if "reward" in entry] for name in ("stock", "swapped"))
    assert [entry["step"] for entry in ours] == [1, 2]
    assert all("dynbsz/microbatches" in entry for entry in ours)
    assert not any("dynbsz/microbatches" in entry for entry in stock)
    # Same seed, same model: the first generation round and its rewards are stock's exactly.
    assert ours[0]["reward"] == pytest.approx(stock[0]["reward"], abs=1e-6)
    assert ours[0]["completions/mean_length"] == pytest.approx(stock[0]["completions/mean_length"])


def test_resume_from_mid_run_checkpoint(tmp_path):
    # The --model_name_or_path / --dataset_name path, on a saved tiny model and a local JSON-lines dataset.
    model_dir = save_tiny_model(str(tmp_path / "model"))
    rows = [{"prompt": "abcd"[: 1 + i % 4] * (1 + i % 3), "target_length": 4 + 3 * (i % 5)} for i in range(32)]
    data_dir = write_dataset(tmp_path / "data", rows)
    out = tmp_path / "out"
    common = [
        sys.executable,
        str(EXAMPLE),
        "--model_name_or_path",
        model_dir,
        "--dataset_name",
        data_dir,
        "--reward_funcs",
        "length_reward",
        "--output_dir",
        str(out),
        "--bf16",
        "false",
        "--activation_checkpointing",
        "false",
        "--learning_rate",
        "1e-3",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        *SHORT,
    ]

    first = run([*common, "--max_steps", "4"], cwd=tmp_path)
    assert summary_steps(first) == 4
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()

    # Resume from the mid-run checkpoint and train on to a later max_steps.
    second = run([*common, "--max_steps", "6", "--resume_from_checkpoint", str(out / "checkpoint-2")], cwd=tmp_path)
    assert summary_steps(second) == 6
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    logged = [entry["step"] for entry in state["log_history"] if "reward" in entry]
    assert logged == [1, 2, 3, 4, 5, 6]  # steps 1-2 from the checkpoint, 3-6 from the resumed run
    assert all("dynbsz/computed_tokens" in entry for entry in state["log_history"] if "reward" in entry)


def test_rloo_example_short_single_process(tmp_path):
    """examples/rloo.py: the same demo on DynamicBatchRLOOTrainer, with RLOO's reference model (beta 0.05) loaded
    from the initial tiny model it saves."""
    run_demo(ROOT / "examples" / "rloo.py", tmp_path, 2, r"reward=[0-9.]+ \| ", *SHORT)
    assert (tmp_path / "out" / "initial-model" / "config.json").exists()  # the reference model's weights


def test_distill_example_short_single_process_and_its_hub_mode_on_local_models(tmp_path):
    """examples/distill.py: the offline demo (a tiny student and a 3x teacher of its vocabulary) prints the plan with
    the teacher's budget, a line per step and the loss's summary; with ``--model_name_or_path`` and
    ``--teacher_model_name_or_path`` (here local directories, as TRL's script loads Hub ones) TRL loads both by
    name."""
    script = ROOT / "examples" / "distill.py"
    output = run_demo(script, tmp_path, 2, r"loss=[0-9.]+ \| entropy=[0-9.]+ \| ")
    assert "max_tokens_per_microbatch_teacher" in output  # the plan's teacher budget
    assert re.search(r"loss +first 1 logged steps [0-9.e+-]+ -> last 1", output)
    student = save_tiny_model(str(tmp_path / "student"))
    from hf_dynbsz.testing import save_tiny_teacher

    teacher = save_tiny_teacher(str(tmp_path / "teacher"))
    prompts = write_dataset(tmp_path / "prompts", [{"prompt": "abcd"[: 1 + i % 4] * (1 + i % 3)} for i in range(16)])
    models = ["--model_name_or_path", student, "--teacher_model_name_or_path", teacher]
    run_named_step(script, tmp_path, *models, "--dataset_name", prompts, "--max_completion_length", "16")


def test_dpo_example_short_single_process_and_its_hub_mode_on_local_models(tmp_path):
    """examples/dpo.py: the offline demo (the tiny model learns to prefer the alphabet in order over random letters)
    prints the plan, a line per step with the rewards and the tokens computed against stock's, and the summary; with
    ``--model_name_or_path`` and ``--dataset_name`` (a local directory and a local JSON-lines preference dataset, as
    TRL's script loads Hub ones) TRL loads the model and its reference by name."""
    script = ROOT / "examples" / "dpo.py"
    metrics = r"loss=[0-9.]+ \| rewards/accuracies=[0-9.]+ \| rewards/margins=-?[0-9.]+ \| "
    output = run_demo(script, tmp_path, 3, metrics)
    assert "pairs per optimizer step" in output  # the plan counts pairs
    assert re.search(r"tokens computed +[\d,]+ vs [\d,]+ with stock batching", output)
    model = save_tiny_model(str(tmp_path / "model"))
    pairs = write_dataset(tmp_path / "pairs", preference_rows())
    run_named_step(script, tmp_path, "--model_name_or_path", model, "--dataset_name", pairs)


def preference_rows(count: int = 16) -> list[dict]:
    """A local preference dataset's rows (``prompt`` / ``chosen`` / ``rejected``) for a script's named mode."""
    return [
        {"prompt": "ab"[: 1 + i % 2] * (1 + i % 3), "chosen": "abcd"[: 1 + i % 4], "rejected": "dc"}
        for i in range(count)
    ]


def test_kto_example_short_single_process_and_its_hub_mode_on_local_models(tmp_path):
    """examples/kto.py: the offline demo (examples/dpo.py's pairs unpaired: the alphabet in order desirable, random
    letters not) prints the plan, a line per step with the loss, the KL estimate and the rewards, and the summary;
    with ``--model_name_or_path`` and ``--dataset_name`` (a local directory and a local JSON-lines unpaired dataset)
    TRL loads the model and its reference by name."""
    script = ROOT / "examples" / "kto.py"
    metrics = r"loss=[0-9.]+ \| kl=[0-9.]+ \| rewards/chosen=-?[0-9.]+ \| rewards/rejected=-?[0-9.]+ \| "
    output = run_demo(script, tmp_path, 3, metrics)
    assert re.search(r"tokens computed +[\d,]+ vs [\d,]+ with stock batching", output)
    model = save_tiny_model(str(tmp_path / "model"))
    rows = [{"prompt": "ab"[: 1 + i % 2] * (1 + i % 3), "completion": "abcd"[: 1 + i % 4], "label": i % 3 > 0}
            for i in range(16)]  # fmt: skip
    samples = write_dataset(tmp_path / "samples", rows)
    run_named_step(script, tmp_path, "--model_name_or_path", model, "--dataset_name", samples)


def test_reward_example_short_single_process_and_its_hub_mode_on_local_models(tmp_path):
    """examples/reward.py: the offline demo (a classifier of one label from the tiny model's config learns to score
    the alphabet in order above random letters) prints the plan, a line per step with the loss, the accuracy and the
    margin, and the summary; with ``--model_name_or_path`` and ``--dataset_name`` (a local causal LM, which TRL loads
    as a classifier of one label, and a local preference dataset) the named mode trains a step."""
    script = ROOT / "examples" / "reward.py"
    output = run_demo(script, tmp_path, 3, r"loss=[0-9.]+ \| accuracy=[0-9.]+ \| margin=-?[0-9.]+ \| ")
    assert "pairs per optimizer step" in output  # the plan counts pairs
    model = save_tiny_model(str(tmp_path / "model"))
    pairs = write_dataset(tmp_path / "pairs", preference_rows())
    run_named_step(script, tmp_path, "--model_name_or_path", model, "--dataset_name", pairs)
