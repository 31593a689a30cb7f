"""Specification of the ``hf-dynbsz plan`` command (through ``main()`` in this process; one run as a subprocess, like
a user would, for its exit status and output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_plan(*options, env_overrides=None, cwd=None):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DIFFU_")}
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + environment.get("PYTHONPATH", "")
    environment.update(env_overrides or {})
    return subprocess.run(
        [sys.executable, "-m", "hf_dynbsz.cli", "plan", *map(str, options)],
        cwd=cwd or REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def plan_in_process(capsys, monkeypatch):
    """``hf-dynbsz plan`` through ``main()`` in this process (fast); same contract as :func:`run_plan`."""
    from hf_dynbsz.cli import main

    def run(*options, env_overrides=None):
        for name, value in (env_overrides or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(["plan", *map(str, options)])
        except SystemExit as exit_:  # argparse usage errors
            code = exit_.code
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def table_row(output: str, setting: str) -> list[str]:
    """The cells after ``setting`` of the plan table row named ``setting``."""
    for line in output.splitlines():
        if line.startswith(setting + "  "):
            return line[len(setting) :].split()
    raise AssertionError(f"no row {setting!r} in:\n{output}")


def test_console_script_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
        assert 'hf-dynbsz = "hf_dynbsz.cli:main"' in section
    else:
        assert tomllib.loads(text)["project"]["scripts"]["hf-dynbsz"] == "hf_dynbsz.cli:main"


def test_valid_config_prints_the_plan(plan_in_process):
    result = plan_in_process(
        "--per_device_train_batch_size", 4,
        "--gradient_accumulation_steps", 4,
        "--num_generations", 8,
        "--max_tokens_per_microbatch", 8192,
        "--num_processes", 8,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0].split()[:4] == ["setting", "per", "device", "global"]
    assert table_row(out, "processes")[:2] == ["-", "8"]
    assert table_row(out, "samples per optimizer step")[:2] == ["16", "128"]
    assert table_row(out, "prompts per optimizer step")[:2] == ["-", "16"]
    # TRL's derivation for 8 processes, although this machine runs 1: 4 x 8 x 4
    assert table_row(out, "generation_batch_size")[:2] == ["16", "128"]
    assert table_row(out, "max_tokens_per_microbatch")[:2] == ["8192", "65536"]


def test_a_distillation_plan_has_its_round_and_its_teachers_budget_and_trainings_checks(plan_in_process, tmp_path):
    """``--trainer distillation`` takes DistillationConfig's options: one completion per prompt, generated once per
    optimizer step (no GRPO round rows), the teacher's budget; a value stock's config refuses exits 2 with its
    message; with a memory limit and the teacher's config, the teacher's passes get memory rows of their own."""
    result = plan_in_process(
        "--trainer", "distillation", "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2,
        "--num_processes", 2, "--beta", 0.5, "--max_tokens_per_microbatch_teacher", 2048,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert table_row(out, "samples per optimizer step")[:2] == ["8", "16"]
    assert table_row(out, "generation")[:2] == ["-", "16"]
    assert table_row(out, "max_tokens_per_microbatch_teacher")[:2] == ["2048", "4096"]
    assert table_row(out, "dynamic_batching")[0] == "on"
    assert "num_generations" not in out and "max_tokens_per_microbatch_logprob" not in out
    refused = plan_in_process("--trainer", "distillation", "--beta", 1.5)
    assert refused.returncode == 2 and "beta must be in [0.0, 1.0], got 1.5" in refused.stderr
    assert plan_in_process("--trainer", "distillation", "--num_generations", 4).returncode == 2  # not its option
    from hf_dynbsz.testing import build_char_tokenizer, build_tiny_teacher

    build_tiny_teacher(build_char_tokenizer()).config.save_pretrained(tmp_path)
    memory = plan_in_process(
        "--trainer", "distillation", "--max_memory_per_device_mib", 4000, "--held_mib", 100,
        "--teacher_model_config", tmp_path, "--use_cpu", "true",
    )  # fmt: skip
    assert memory.returncode == 0, memory.stderr
    assert table_row(memory.stdout, "budget that fits, teacher")[0].isdigit()


def test_output_dir_is_not_required_and_defaults_plan_one_process(plan_in_process):
    result = plan_in_process("--per_device_train_batch_size", 8)
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "processes")[:2] == ["-", "1"]
    assert table_row(result.stdout, "max_tokens_per_microbatch")[0] == "auto"


def test_invalid_config_exits_2_with_message_and_no_traceback():
    """As a user runs it: a process of its own, its exit status and its output."""
    result = run_plan("--per_device_train_batch_size", 4, "--generation_batch_size", 12, "--num_generations", 8)
    assert result.returncode == 2
    assert "generation_batch_size (12) must be divisible by num_generations (8): use 8 or 16" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_invalid_dynamic_field_exits_2(plan_in_process):
    result = plan_in_process("--max_tokens_per_microbatch", 0)
    assert result.returncode == 2
    assert "max_tokens_per_microbatch must be a positive integer number of tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_option_is_a_usage_error(plan_in_process):
    result = plan_in_process("--no_such_option", 3)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_environment_overrides_are_honoured_and_reported(plan_in_process):
    result = plan_in_process("--per_device_train_batch_size", 4, env_overrides={"DIFFU_TRAIN_BATCH_SIZE": "16"})
    assert result.returncode == 0, result.stderr
    assert "DIFFU_TRAIN_BATCH_SIZE=16 overrides per_device_train_batch_size=4" in result.stdout
    assert table_row(result.stdout, "per_device_train_batch_size")[:2] == ["16", "16"]


def test_bad_environment_value_exits_2(plan_in_process):
    result = plan_in_process(env_overrides={"DIFFU_TRAIN_BATCH_SIZE": "2.5"})
    assert result.returncode == 2
    assert "DIFFU_TRAIN_BATCH_SIZE='2.5'" in result.stderr
    assert "a positive integer number of samples per device" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["abc", "0", "", "-1"])
def test_other_bad_environment_values_exit_2(plan_in_process, value):
    result = plan_in_process(env_overrides={"DIFFU_TRAIN_BATCH_SIZE": value})
    assert result.returncode == 2
    assert f"DIFFU_TRAIN_BATCH_SIZE={value!r}" in result.stderr
    assert "Traceback" not in result.stderr


def test_accelerate_yaml_gives_processes_zero_stage_and_precision(tmp_path, plan_in_process):
    config = tmp_path / "zero3.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        "  zero_stage: 3\n"
        "  offload_optimizer_device: none\n"
        "mixed_precision: fp16\n"
        "num_machines: 1\n"
        "num_processes: 4\n"
    )
    result = plan_in_process("--per_device_train_batch_size", 2, "--num_generations", 4, "--config_file", config)
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "processes")[:2] == ["-", "4"]
    assert table_row(result.stdout, "DeepSpeed ZeRO stage")[0] == "3"
    assert table_row(result.stdout, "mixed precision")[0] == "fp16"


def test_num_processes_option_wins_over_accelerate_yaml(tmp_path, plan_in_process):
    config = tmp_path / "ddp.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: no\n")  # YAML 1.1: False
    explicit = plan_in_process("--num_generations", 4, "--config_file", config, "--num_processes", 2)
    assert table_row(explicit.stdout, "processes")[:2] == ["-", "2"]
    assert table_row(explicit.stdout, "mixed precision")[0] == "no"
    assert table_row(explicit.stdout, "DeepSpeed ZeRO stage")[0] == "none"


def test_missing_accelerate_yaml_exits_2(tmp_path, plan_in_process):
    result = plan_in_process("--config_file", tmp_path / "absent.yaml")
    assert result.returncode == 2
    assert "absent.yaml" in result.stderr
    assert "Traceback" not in result.stderr


# ---- --lengths ---------------------------------------------------------------------------------------------

LENGTHS = [100, 20, 30, 400, 25, 60, 10, 15, 300, 40, 35, 20, 20]  # 13 samples: 3 steps of 4 and a partial one


def lengths_table(output: str) -> dict[str, list[str]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "samples"])
    return {line.split()[0]: line.split()[1:] for line in lines[start + 2 :] if line.strip()}


@pytest.mark.parametrize("fmt", ["lines", "json"])
def test_lengths_file_simulates_optimizer_steps(tmp_path, fmt, plan_in_process):
    path = tmp_path / "lengths.txt"
    path.write_text(json.dumps(LENGTHS) if fmt == "json" else "\n".join(map(str, LENGTHS)) + "\n")
    result = plan_in_process(
        "--per_device_train_batch_size", 2,
        "--gradient_accumulation_steps", 2,
        "--num_generations", 2,
        "--max_tokens_per_microbatch", 400,
        "--packing_layout", "padding_free",
        "--lengths", path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = lengths_table(result.stdout)
    assert list(table) == ["1", "2", "3", "4*", "total"]
    # columns: samples, real tokens, budget, micro-batches, lower bound, utilisation, computed, stock, saved
    step1 = table["1"]
    assert step1[:3] == ["4", str(100 + 20 + 30 + 400), "400"]
    assert int(step1[3]) >= int(step1[4]) >= 2  # 550 tokens need at least 2 micro-batches of 400
    assert step1[7] == str(4 * 400)  # stock: 4 rows padded to the step's longest (400)
    assert step1[6] == str(550)  # padding-free computes the real tokens
    total = table["total"]
    assert total[0] == str(len(LENGTHS)) and total[1] == str(sum(LENGTHS))
    assert int(total[6]) < int(total[7])


def test_lengths_with_automatic_budget_use_stock_padded_micro_batch(tmp_path, plan_in_process):
    path = tmp_path / "pairs.json"
    pairs = [[10, 90], [5, 15], [8, 22], [12, 388]]
    path.write_text(json.dumps(pairs))
    result = plan_in_process(
        "--per_device_train_batch_size", 2,
        "--gradient_accumulation_steps", 2,
        "--num_generations", 2,
        "--lengths", path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    step1 = lengths_table(result.stdout)["1"]
    longest_row = 12 + 388  # longest prompt + longest completion
    assert step1[2] == str(2 * longest_row)  # auto budget = per_device_train_batch_size x longest row
    assert step1[7] == str(4 * longest_row)


def test_prompt_completion_lines(tmp_path, plan_in_process):
    path = tmp_path / "pairs.txt"
    path.write_text("# prompt completion\n10 90\n5 15\n")
    result = plan_in_process("--per_device_train_batch_size", 2, "--num_generations", 2, "--lengths", path)
    assert result.returncode == 0, result.stderr
    assert lengths_table(result.stdout)["1"][:2] == ["2", "120"]


def test_a_block_every_prompt_begins_with_is_computed_once_in_a_prefix_tree(tmp_path, plan_in_process):
    """Two prompts of 610 and 620 tokens that begin with the same 600, 4 completions each, one pass: prompt groups
    compute each prompt once (1753 tokens), a prefix tree the block once more (599 tokens fewer); the real tokens
    column counts each sample's own."""
    path = tmp_path / "agentic.txt"
    path.write_text("610 40 0\n610 90 0\n610 12 0\n610 200 0\n620 30 1\n620 60 1\n620 5 1\n620 80 1\n")
    options = ("--per_device_train_batch_size", 8, "--num_generations", 4, "--use_cpu", "true", "--lengths", path)
    computed = {}
    for sharing in ("groups", "tree"):
        result = plan_in_process(*options, "--share_prompt_prefix", sharing, "--shared_prefix", 600)
        assert result.returncode == 0, result.stderr
        row = lengths_table(result.stdout)["1"]
        assert row[1] == "5437"  # real tokens: the samples' own
        computed[sharing] = int(row[6])
    assert computed == {"groups": 1753, "tree": 1753 - 599}
    result = plan_in_process(*options, "--share_prompt_prefix", "tree", "--shared_prefix", 900)
    assert result.returncode == 2 and "--shared_prefix must be" in result.stderr and "(610)" in result.stderr


@pytest.mark.parametrize("content", ["12\nabc\n", "[1, 2.5]", '{"a": 1}', "", "[1, [2, 3]]"])
def test_bad_lengths_file_exits_2(tmp_path, content, plan_in_process):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    result = plan_in_process("--num_generations", 2, "--lengths", path)
    assert result.returncode == 2
    assert "--lengths" in result.stderr
    assert "Traceback" not in result.stderr


def test_oversize_sequence_with_error_policy_exits_2(tmp_path, plan_in_process):
    path = tmp_path / "lengths.txt"
    path.write_text("10\n500\n")
    result = plan_in_process(
        "--per_device_train_batch_size", 2,
        "--num_generations", 2,
        "--max_tokens_per_microbatch", 100,
        "--oversize_policy", "error",
        "--lengths", path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_main_returns_exit_status_in_process(capsys):
    from hf_dynbsz.cli import main

    assert main(["plan", "--num_generations", "4", "--per_device_train_batch_size", "4"]) == 0
    assert "generation_batch_size" in capsys.readouterr().out
    assert main(["plan", "--per_device_train_batch_size", "3", "--num_generations", "4"]) == 2
    assert "must be divisible by num_generations (4)" in capsys.readouterr().err


def test_lengths_over_several_processes_show_rank_imbalance_with_and_without_balancing(tmp_path, plan_in_process):
    # 2 processes x 4 samples per optimizer step; process 1 holds every long completion.
    pairs = [[10, 20]] * 4 + [[10, 300]] * 4 + [[12, 25]] * 4 + [[12, 280]] * 4
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(pairs))
    options = (
        "--per_device_train_batch_size",
        2,
        "--gradient_accumulation_steps",
        2,
        "--num_generations",
        2,
        "--num_processes",
        2,
        "--max_tokens_per_microbatch",
        700,
        "--packing_layout",
        "padding_free",
        "--lengths",
        path,
    )
    result = plan_in_process(*options)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "samples"])
    first = lines[start + 2].split()
    # step, samples, real tokens, budget, passes off, passes on, imbalance off, imbalance on, moved, computed, stock
    assert first[:4] == ["1", "8", str(4 * 30 + 4 * 310), "700"]
    assert float(first[6]) > 1.5 > 1.1 > float(first[7]) and int(first[8]) > 0
    document = json.loads(plan_in_process(*options, "--json").stdout)
    step = document["steps"][0]
    assert step["rank_imbalance_before"] > step["rank_imbalance_after"]
    ran = sorted(length for process in step["processes"] for length in process["lengths"])
    assert ran == sorted(length for process in step["lengths"] for length in process)  # every sample, once
    for process in step["processes"]:
        assert sorted(i for group in process["microbatches"] for i in group) == list(range(len(process["lengths"])))


# ---- bad input: what training rejects, the planner rejects, with training's message ----------------------------


@pytest.mark.parametrize("value", [0, -3])
def test_num_processes_must_be_positive(plan_in_process, value):
    result = plan_in_process("--num_generations", 4, "--num_processes", value)
    assert result.returncode == 2
    assert (
        f"--num_processes must be a positive integer (data-parallel processes over all machines), got {value}"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("yaml_text", "phrase"),
    [
        ("num_processes: 0\n", "num_processes of --config_file"),
        ("num_processes: many\n", "num_processes of --config_file"),
        ("num_machines: 2\nnum_processes: 3\n", "is not a multiple of its num_machines=2"),
    ],
)
def test_accelerate_yaml_process_counts_are_checked(tmp_path, plan_in_process, yaml_text, phrase):
    config = tmp_path / "launch.yaml"
    config.write_text("distributed_type: MULTI_GPU\n" + yaml_text)
    result = plan_in_process("--num_generations", 2, "--config_file", config)
    assert result.returncode == 2
    assert phrase in result.stderr and "Traceback" not in result.stderr


def _training_error(**settings) -> str:
    """The message training gives for ``settings`` (the config is where training validates them)."""
    from hf_dynbsz.configs.grpo import DynamicBatchGRPOConfig

    with pytest.raises(ValueError) as raised:
        DynamicBatchGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **settings)
    return str(raised.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "ppo"},
        {"importance_sampling_level": "batch"},
        {"beta": -0.04},
        {"epsilon": -0.2},
        {"top_entropy_quantile": 1.5},
        {"temperature": 0.0},
        {"auto_find_batch_size": True},
        {"log_completions_hub_repo": "me/completions"},
        {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0},
        {"max_tokens_per_microbatch": 32, "pad_to_multiple_of": 64},
    ],
)
def test_settings_training_rejects_are_rejected_with_the_same_message(plan_in_process, settings):
    options = [item for name, value in settings.items() for item in (f"--{name}", value)]
    result = plan_in_process("--num_generations", 8, *options)
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == f"hf-dynbsz plan: error: {_training_error(num_generations=8, **settings)}"


def test_environment_value_behind_an_error_is_named(plan_in_process):
    result = plan_in_process(
        "--per_device_train_batch_size", 8, "--num_generations", 8, env_overrides={"DIFFU_TRAIN_BATCH_SIZE": "3"}
    )
    assert result.returncode == 2
    assert "must be divisible by num_generations (8)" in result.stderr
    assert "per_device_train_batch_size from DIFFU_TRAIN_BATCH_SIZE=3" in result.stderr


def test_plan_table_marks_environment_values(plan_in_process):
    result = plan_in_process("--num_generations", 2, env_overrides={"DIFFU_MAX_TOKENS": "4096"})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("max_tokens_per_microbatch "))
    assert row.endswith("[set by DIFFU_MAX_TOKENS=4096]")
    document = json.loads(
        plan_in_process("--num_generations", 2, "--json", env_overrides={"DIFFU_MAX_TOKENS": "4096"}).stdout
    )
    assert document["env_overrides"] == {"max_tokens_per_microbatch": "DIFFU_MAX_TOKENS=4096"}


def test_oversize_sequences_are_accounted_consistently(tmp_path, plan_in_process):
    path = tmp_path / "lengths.txt"
    path.write_text("250\n10\n10\n30\n")  # one sequence over the budget of 100, three that fit in one pass
    result = plan_in_process(
        "--per_device_train_batch_size",
        4,
        "--num_generations",
        2,
        "--max_tokens_per_microbatch",
        100,
        "--packing_layout",
        "padding_free",
        "--lengths",
        path,
    )
    assert result.returncode == 0, result.stderr
    # columns: samples, real tokens, budget, micro-batches, lower bound, utilisation, ...
    step = lengths_table(result.stdout)["1"]
    assert step[3] == "2" and step[4] == "2"  # the oversize pass alone + one pass of 50 tokens; no fewer possible
    assert step[5] == "50.0%"  # of the pass within the budget: 50 / 100
    assert "Their passes count in micro-batches and lower bound and are left out of utilisation" in result.stdout


@pytest.mark.parametrize("name", ["multi_node_ddp", "multi_node_zero3"])
def test_multi_node_accelerate_config_plans_the_world_size_the_trainer_sees(plan_in_process, name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "accelerate_configs" / f"{name}.yaml"
    launcher = load_config_from_file(str(path))  # what `accelerate launch` reads
    assert launcher.num_machines == 2 and launcher.main_process_ip
    result = plan_in_process("--per_device_train_batch_size", 4, "--num_generations", 8, "--config_file", path)
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "processes")[:2] == ["-", str(launcher.num_processes)]
    assert table_row(result.stdout, "per_device_train_batch_size")[:2] == ["4", str(4 * launcher.num_processes)]


@pytest.mark.parametrize("model_type, mode", [("qwen2_vl", "repacked"), ("llava", "repacked"), ("idefics3", "stock")])
def test_vision_language_model_config_shows_how_image_steps_train(tmp_path, plan_in_process, model_type, mode):
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[model_type]().save_pretrained(tmp_path)
    result = plan_in_process(
        "--model_config",
        tmp_path,
        "--per_device_train_batch_size",
        4,
        "--num_generations",
        4,
        "--attn_implementation",
        "sdpa",
        "--use_cpu",  # on a GPU, sdpa's padding-free rows are not used (test_a_gpu_plan_...)
        "true",
    )
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "image inputs")[0] == mode
    assert table_row(result.stdout, "packing layout")[0] == ("padding_free" if mode == "repacked" else "padded")
    refused = plan_in_process(
        "--model_config",
        tmp_path,
        "--per_device_train_batch_size",
        4,
        "--num_generations",
        4,
        "--packing_layout",
        "padding_free",
    )
    if mode == "repacked":
        assert refused.returncode == 0, refused.stderr
    else:
        assert refused.returncode == 2
        assert "a vision-language model computes its own (multimodal) position ids" in refused.stderr


def test_plan_answers_what_budget_fits_in_a_memory_limit(tmp_path, plan_in_process):
    from transformers import Qwen2Config

    from hf_dynbsz.planning.memory import MemoryModel

    config = Qwen2Config.from_pretrained(memory_model_config(tmp_path))
    options = (
        "--model_config",
        tmp_path,
        "--per_device_train_batch_size",
        4,
        "--num_generations",
        4,
        "--max_completion_length",
        4096,
        "--max_memory_per_device_mib",
        20000,
        "--held_mib",
        3000,
    )
    result = plan_in_process(*options)
    assert result.returncode == 0, result.stderr
    memory = MemoryModel.from_config(
        config,
        20000,
        activation_bytes=2,  # the table's mixed precision: GRPOConfig's default, bf16
        tensor_batch_size=1024,
        gradient_checkpointing=True,
        attn_implementation="sdpa",
    )  # GRPOConfig's default
    assert table_row(result.stdout, "budget that fits, training")[0] == str(memory.budget("training", 3000, 4096))
    assert table_row(result.stdout, "memory held before passes")[:2] == ["3000", "MiB"]
    more = plan_in_process(*options[:-4], "--max_memory_per_device_mib", 40000, "--held_mib", 3000)
    assert int(table_row(more.stdout, "budget that fits, training")[0]) > int(
        table_row(result.stdout, "budget that fits, training")[0]
    )
    assert "budget that fits" not in plan_in_process(*options[:-4]).stdout


def memory_model_config(tmp_path):
    from transformers import Qwen2Config

    from hf_dynbsz.testing import ModelShape

    shape = ModelShape(1024, 8, num_heads=16, num_kv_heads=4, intermediate_size=2816, vocab_size=32000)
    Qwen2Config(**shape.config_fields()).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "precision, same_as",
    [
        ((), ("--bf16", "true")),  # TRL's default mixed precision is bf16
        (("--bf16", "false"), ("--bf16", "false", "--fp16", "false")),
        (("--fp16", "true", "--bf16", "false"), ("--bf16", "true")),  # half precision either way: 2 bytes
    ],
)
def test_memory_rows_use_the_mixed_precision_the_table_shows(tmp_path, plan_in_process, precision, same_as):
    """The memory rows' activations are in the precision of the "mixed precision" row (TRL's default bf16 included),
    not fp32 while the table says bf16."""
    options = (
        "--num_processes", 8,
        "--per_device_train_batch_size", 4,
        "--num_generations", 8,
        "--model_config", memory_model_config(tmp_path),
        "--max_memory_per_device_mib", 60000,
    )  # fmt: skip
    result, reference = plan_in_process(*options, *precision), plan_in_process(*options, *same_as)
    assert result.returncode == 0 and reference.returncode == 0, result.stderr + reference.stderr
    shown = table_row(result.stdout, "mixed precision")[0]
    assert shown == {(): "bf16", ("--bf16", "false"): "no"}.get(precision, "fp16")
    for row in ("memory of a training pass", "budget that fits, training", "budget that fits, no-grad"):
        assert table_row(result.stdout, row) == table_row(reference.stdout, row), row
    per_token = {
        name: float(table_row(output, "memory of a training pass")[3])
        for name, output in (("result", result.stdout), ("bf16", plan_in_process(*options, "--bf16", "true").stdout))
    }
    half = shown in ("bf16", "fp16")
    assert per_token["result"] == (per_token["bf16"] if half else 2 * per_token["bf16"])


@pytest.mark.parametrize(
    "attention, use_cpu, layout",
    [("sdpa", "false", "padded"), ("sdpa", "true", "padding_free"), ("flex_attention", "false", "padding_free")],
)
def test_a_gpu_plan_trains_padded_rows_on_sdpa_and_padding_free_ones_on_flex(
    plan_in_process, attention, use_cpu, layout
):
    """On a GPU, sdpa's segment attention runs a kernel per span shape and layer (measured 6.4x slower than stock
    on an H200): "auto" plans padded rows there, padding-free ones on a CPU or with flex_attention."""
    result = plan_in_process(
        "--per_device_train_batch_size", 4, "--num_generations", 4, "--attn_implementation", attention,
        "--use_cpu", use_cpu,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "packing layout")[0] == layout


# ---- every combination of the command's discrete flags prints a plan ------------------------------------------
#: The flags whose every combination is run (processes x lengths format x samples past the full steps x balancing x
#: layout x shared prompts x budget): 648 runs of about 10 ms each.
CORE_FLAGS = {
    "processes": (1, 3),
    "format": ("totals", "pairs", "triples"),
    "extra_samples": (0, 1, 5),  # past 2 full steps of 4 samples per process: none, process 0's alone, two processes
    "balance_across_ranks": ("true", "false"),
    "packing_layout": ("auto", "padding_free", "padded"),
    "share_prompt_prefix": ("true", "false"),
    "budget": ("auto", "fits", "oversize"),
}
#: Flags each taking every value on a share of the combinations (shuffled, seeded): every value meets many of the
#: core ones. ``model`` is a folder written by :func:`flag_models`.
OTHER_FLAGS = {
    "json": (False, True),
    "pad_to_multiple_of": (None, 8),
    "oversize_policy": ("warn", "error"),
    "attn_implementation": (None, "sdpa", "eager", "flex_attention", "flash_attention_2"),
    "use_cpu": (None, "true"),
    "model": (None, "qwen2", "qwen2_vl"),
    "max_memory_per_device_mib": (None, 20000),
}
BUDGETS = {"auto": None, "fits": 400, "oversize": 100}  # lengths up to 160 tokens


def flag_combinations() -> list[dict]:
    """Every combination of :data:`CORE_FLAGS`, each with values of :data:`OTHER_FLAGS` (balanced, shuffled)."""
    import itertools
    import random

    core = [dict(zip(CORE_FLAGS, values)) for values in itertools.product(*CORE_FLAGS.values())]
    for number, (name, values) in enumerate(OTHER_FLAGS.items()):
        spread = [values[i % len(values)] for i in range(len(core))]
        random.Random(number).shuffle(spread)
        for combination, value in zip(core, spread):
            combination[name] = value
    return core


def flag_lengths_file(folder: Path, fmt: str, samples: int) -> Path:
    """``samples`` lengths in ``fmt``: prompts of 5-40 tokens shared by runs of 4 (num_generations), completions of
    1-120 tokens (seeded)."""
    import random

    rng = random.Random(samples)
    lines = []
    for i in range(samples):
        if i % 4 == 0:
            prompt = rng.randint(5, 40)
        completion = rng.randint(1, 120)
        lines.append({"totals": f"{prompt + completion}", "pairs": f"{prompt} {completion}"}.get(fmt, ""))
        lines[-1] = lines[-1] or f"{prompt} {completion} {i // 4}"
    path = folder / f"{fmt}_{samples}.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def flag_models(folder: Path) -> dict[str, Path]:
    """A text model and a vision-language model, as config folders (``--model_config``)."""
    from transformers import CONFIG_MAPPING

    models = {"qwen2": memory_model_config(folder / "qwen2")}
    CONFIG_MAPPING["qwen2_vl"]().save_pretrained(folder / "qwen2_vl")
    return {**models, "qwen2_vl": folder / "qwen2_vl"}


def flag_options(combination: dict, lengths: Path, models: dict[str, Path]) -> list:
    options = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2, "--num_generations", 4]
    options += ["--num_processes", combination["processes"], "--lengths", lengths]
    for name in ("balance_across_ranks", "packing_layout", "share_prompt_prefix", "oversize_policy"):
        options += [f"--{name}", combination[name]]
    if BUDGETS[combination["budget"]]:
        options += ["--max_tokens_per_microbatch", BUDGETS[combination["budget"]]]
    for name in ("pad_to_multiple_of", "attn_implementation", "use_cpu", "max_memory_per_device_mib"):
        if combination[name] is not None:
            options += [f"--{name}", combination[name]]
    if combination["model"]:
        options += ["--model_config", models[combination["model"]]]
    return options + (["--json"] if combination["json"] else [])


def printed_steps(result, combination: dict) -> list[str]:
    """The step labels the plan printed (``2*``: partial), from its table or its JSON document."""
    if combination["json"]:
        steps = json.loads(result.stdout)["steps"]
        return [str(n) + ("*" if step["partial"] else "") for n, step in enumerate(steps, start=1)]
    assert table_row(result.stdout, "per_device_train_batch_size")  # the plan table
    steps = lengths_table(result.stdout)
    assert ("total" in steps) == (combination["processes"] == 1), "the table over one process has a total row"
    return [step for step in steps if step != "total"]


def test_every_combination_of_the_plan_flags_prints_a_plan(tmp_path, plan_in_process):
    """Processes 1 and 3, balancing on and off, every layout, shared prompts on and off, totals / pairs / groups,
    the automatic budget and given ones (with sequences over it), partial last steps on one process or two: each
    prints the plan and the simulation of every step (a partial step on one process crashed the table), or, with a
    sequence over the budget and oversize_policy="error", training's error (exit 2)."""
    models = flag_models(tmp_path)
    failures = []
    for combination in flag_combinations():
        samples = 2 * 4 * combination["processes"] + combination["extra_samples"]
        lengths = flag_lengths_file(tmp_path, combination["format"], samples)
        try:
            result = plan_in_process(*flag_options(combination, lengths, models))
            if combination["budget"] == "oversize" and combination["oversize_policy"] == "error":
                assert result.returncode == 2 and "more than the micro-batch budget" in result.stderr
                continue
            assert result.returncode == 0, result.stderr
            full, partial = divmod(samples, 4 * combination["processes"])
            expected = [str(n) for n in range(1, full + 1)] + ([f"{full + 1}*"] if partial else [])
            assert printed_steps(result, combination) == expected
        except AssertionError as error:
            failures.append(f"{combination}: {error}\n{result.stdout[-600:]}{result.stderr[-600:]}")
        except Exception as error:  # noqa: BLE001 - a crash of the command is a failure of this combination
            failures.append(f"{combination}: {type(error).__name__}: {error}")
    assert not failures, f"{len(failures)} combinations failed, the first:\n" + "\n".join(failures[:3])


def test_a_dpo_plan_counts_pairs_and_simulates_them_whole(plan_in_process, tmp_path):
    """``--trainer dpo`` takes DPOConfig's options: pairs per optimizer step, no generation rows, the reference's
    budget; ``--lengths`` of ``PROMPT CHOSEN REJECTED`` simulates each pair's two sequences in one pass, against stock's
    micro-batches of 2 x per_device_train_batch_size rows padded to their longest; a value stock's config refuses exits
    2 with its message."""
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("20 30 50\n400 10 900\n12 300 20\n600 40 35\n30 30 30\n80 200 400\n15 15 15\n900 60 50\n")
    result = plan_in_process(
        "--trainer", "dpo", "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2,
        "--max_tokens_per_microbatch", 2500, "--lengths", pairs, "--use_cpu", "true", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    import json

    document = json.loads(result.stdout)
    assert document["plan"]["trainer"] == "dpo"
    steps = document["steps"]
    assert [len(step["lengths"]) for step in steps] == [8, 8]  # 4 pairs a step, two sequences each
    for step in steps:
        for group in step["microbatches"]:
            assert all(index ^ 1 in group for index in group)  # whole pairs
    table = plan_in_process("--trainer", "dpo", "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2)
    assert table.returncode == 0, table.stderr
    assert table_row(table.stdout, "pairs per optimizer step")[:2] == ["4", "4"]
    assert "generation" not in table.stdout and "num_generations" not in table.stdout
    assert "reference" in " ".join(table_row(table.stdout, "max_tokens_per_microbatch_logprob"))
    refused = plan_in_process("--trainer", "dpo", "--loss_type", "sigmoid", "--loss_weights", "1.0", "2.0")
    assert refused.returncode == 2 and "`loss_weights` must have the same length as `loss_type`" in refused.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text("20 30\n")
    wrong = plan_in_process("--trainer", "dpo", "--lengths", bad)
    assert wrong.returncode == 2 and "expected PROMPT CHOSEN REJECTED" in wrong.stderr
