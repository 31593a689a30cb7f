"""One harness for the runs of the tests, the benchmarks and the GPU check: the model from a shape, the scripted
rollouts of a named length mix, stock's or the plugin's config (GRPO and RLOO) with the CPU run's fields, the trainer
(with a step clock), and the commands that launch a worker (``accelerate launch`` or a fresh Python process).

A caller keeps only what it measures: every run is built here, so a benchmark's run and a test's run of the same
shape are the same run. torch, transformers, TRL and datasets are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hf_dynbsz.testing.fixtures import CPU_RUN_FIELDS, ScriptedRollout, build_tiny_causal_lm
from hf_dynbsz.testing.mixes import PREFIX_MIXES, completion_lengths, prompt_lengths
from hf_dynbsz.testing.prefixes import PrefixRollout
from hf_dynbsz.testing.processes import REPO_ROOT, run_with_timeout

__all__ = [
    "CPU_RUN_FIELDS",
    "TRAINERS",
    "ModelShape",
    "accelerate_command",
    "build_trainer",
    "construction_arguments",
    "construction_error",
    "distillation_config",
    "distillation_trainer",
    "flag_arguments",
    "grpo_worker_command",
    "length_reward",
    "mix_rollout",
    "numbered_prompts",
    "positional_trainer",
    "quiet_worker",
    "run_config",
    "run_distillation",
    "run_script_worker",
    "saved_model_trainer",
    "scenario_worker_arguments",
    "scripted_run",
    "snapshot_parameters",
    "step_clock",
    "tokenizer_rollout",
    "training_mode_trainer",
    "trainer_classes",
]

#: The trainers a run can name: (module, trainer class, config class).
TRAINERS = {
    "grpo_stock": ("trl", "GRPOTrainer", "GRPOConfig"),
    "grpo_dynamic": ("hf_dynbsz", "DynamicBatchGRPOTrainer", "DynamicBatchGRPOConfig"),
    "rloo_stock": ("trl", "RLOOTrainer", "RLOOConfig"),
    "rloo_dynamic": ("hf_dynbsz", "DynamicBatchRLOOTrainer", "DynamicBatchRLOOConfig"),
    "distillation_stock": ("trl", "DistillationTrainer", "DistillationConfig"),
    "distillation_dynamic": ("hf_dynbsz", "DynamicBatchDistillationTrainer", "DynamicBatchDistillationConfig"),
    "async_grpo_stock": ("trl.experimental.async_grpo", "AsyncGRPOTrainer", "AsyncGRPOConfig"),
    "async_grpo_dynamic": ("hf_dynbsz", "DynamicBatchAsyncGRPOTrainer", "DynamicBatchAsyncGRPOConfig"),
}
_ALIASES = {"stock": "grpo_stock", "dynamic": "grpo_dynamic", "ours": "grpo_dynamic"}


def trainer_classes(name: str) -> tuple[type, type]:
    """``(trainer class, config class)`` of ``name``: a key of :data:`TRAINERS`, or "stock" / "dynamic" ("ours")
    for GRPO's."""
    import importlib

    key = _ALIASES.get(name, name)
    if key not in TRAINERS:
        raise ValueError(f"trainer {name!r}: choose from {sorted(TRAINERS) + sorted(_ALIASES)}")
    module, trainer, config = TRAINERS[key]
    module = importlib.import_module(module)
    return getattr(module, trainer), getattr(module, config)


def run_config(name: str, output_dir: str, **fields):
    """The config of trainer ``name`` (see :func:`trainer_classes`) for a CPU run: :data:`CPU_RUN_FIELDS`, then
    ``fields`` (which override them)."""
    return trainer_classes(name)[1](**{"output_dir": output_dir, **CPU_RUN_FIELDS, **fields})


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The size of a Qwen2-style test model (:func:`~hf_dynbsz.testing.build_tiny_causal_lm`). Left out: the
    benchmarks' proportions, ``max(2, hidden / 32)`` attention heads on ``max(1, hidden / 64)`` key/value heads and an
    MLP of ``3 x hidden``; ``vocab_size`` None: the tokenizer's."""

    hidden_size: int
    num_layers: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None

    def config_fields(self) -> dict:
        """The shape as the fields of a Qwen2 config (the proportions above filled in; ``vocab_size`` None when the
        tokenizer's)."""
        hidden = self.hidden_size
        return dict(
            hidden_size=hidden,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads or max(2, hidden // 32),
            num_key_value_heads=self.num_kv_heads or max(1, hidden // 64),
            intermediate_size=self.intermediate_size or 3 * hidden,
            vocab_size=self.vocab_size,
        )

    def build(self, tokenizer, *, max_positions: int = 2048, attention: str = "sdpa", seed: int = 0):
        """The model (fp32 random weights from ``seed``) with ``max_positions`` positions."""
        fields = self.config_fields()
        return build_tiny_causal_lm(
            tokenizer, **fields, max_position_embeddings=max_positions, attn_implementation=attention, seed=seed
        )


def tokenizer_rollout(
    tokenizer, completion_lengths: Callable, prompt_length: Callable, *, max_completion_length: int, seed: int = 0
):
    """A :class:`~hf_dynbsz.testing.ScriptedRollout` whose tokens are any of ``tokenizer``'s but the three special
    ones (ids 3 and up), ending with its eos."""
    return ScriptedRollout(
        completion_lengths,
        prompt_length,
        max_completion_length=max_completion_length,
        seed=seed,
        token_low=3,
        token_high=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
    )


def mix_rollout(mix: str, tokenizer, max_completion_length: int, seed: int = 0) -> ScriptedRollout:
    """The scripted rollout of the named length mix ``mix`` (:mod:`hf_dynbsz.testing.mixes`): its completion and
    prompt lengths, in tokens, and for a mix of :data:`~hf_dynbsz.testing.mixes.PREFIX_MIXES` its prefix structure
    (:class:`~hf_dynbsz.testing.prefixes.PrefixRollout`)."""
    rollout = tokenizer_rollout(
        tokenizer,
        lambda rng, n, rank: completion_lengths(mix, n, max_completion_length, rng),
        lambda rng: prompt_lengths(mix, 1, rng)[0],
        max_completion_length=max_completion_length,
        seed=seed,
    )
    if mix not in PREFIX_MIXES:
        return rollout
    structure = {key: value for key, value in PREFIX_MIXES[mix].items() if key != "prompts"}
    prefixed = PrefixRollout(rollout.completion_lengths, rollout.prompt_length, **structure,
                             max_completion_length=max_completion_length, seed=seed, token_low=rollout.token_low,
                             token_high=rollout.token_high, eos_id=rollout.eos_id)  # fmt: skip
    return prefixed


def numbered_prompts(count: int, prefix: str = "prompt-", width: int = 0):
    """A dataset of ``count`` distinct prompts ``f"{prefix}{i:0{width}d}"`` (a scripted rollout draws their ids)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{prefix}{i:0{width}d}" for i in range(count)]})


def length_reward(completions, **kwargs) -> list[float]:
    """A reward from the completion's length alone: ``(characters mod 7) / 7``."""
    return [len(completion) % 7 / 7 for completion in completions]


class ScriptedGeneration:
    """RLOOTrainer and DistillationTrainer have no ``rollout_func``: ``rollout`` (a scripted rollout) stands in for
    their prompt tokenization and generation, giving the prompt and completion ids GRPO's runs get from it."""

    rollout = None

    def _tokenize_prompts(self, prompts):
        result = self.rollout(prompts, self)
        self._scripted_completions = result["completion_ids"]
        self._scripted_env_mask = result.get("env_mask")
        return result["prompt_ids"], None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        return self._scripted_completions


class RecordedGeneration:
    """A distillation trainer that records the completion ids it generated, in order (``generated``); with a scripted
    rollout that gives an ``env_mask`` (:class:`~hf_dynbsz.testing.MultiTurnRollout`), that mask is the tool mask,
    as stock's tool loop returns it (0 on a tool result's tokens)."""

    def _generate(self, prompts):
        prompt_ids, completion_ids, tool_mask, images, tool_images = super()._generate(prompts)
        self.__dict__.setdefault("generated", []).extend(list(ids) for ids in completion_ids)
        tool_mask = self.__dict__.pop("_scripted_env_mask", None) or tool_mask
        return prompt_ids, completion_ids, tool_mask, images, tool_images


def build_trainer(
    args, model, processing_class, *, dataset, reward=length_reward, rollout=None, trainer_cls=None, **kwargs
):
    """The trainer of config ``args`` (stock's or the plugin's, GRPO, RLOO or distillation: the config's class picks it,
    unless ``trainer_cls`` is given) on ``model``; ``rollout``: a scripted rollout, GRPO's ``rollout_func`` or, for RLOO
    and distillation (no ``rollout_func``), their tokenization and generation (:class:`ScriptedGeneration`). A
    distillation (``kwargs`` give its ``teacher_model``) takes no reward and records its generations
    (:class:`RecordedGeneration`). ``kwargs`` go to the constructor."""
    key = next((key for key, names in TRAINERS.items() if type(args).__name__ == names[2]), None)
    if key is None:
        raise TypeError(f"args: a config of {sorted(TRAINERS)}, got {type(args).__name__}")
    trainer_cls = trainer_cls or trainer_classes(key)[0]
    if key.startswith("distillation"):
        bases = (RecordedGeneration, ScriptedGeneration) if rollout is not None else (RecordedGeneration,)
        trainer_cls = type(f"Recorded{trainer_cls.__name__}", (*bases, trainer_cls), {"rollout": rollout})
        return trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=processing_class, **kwargs)
    if rollout is not None and key.startswith("rloo"):
        trainer_cls = type(f"Scripted{trainer_cls.__name__}", (ScriptedGeneration, trainer_cls), {"rollout": rollout})
    elif rollout is not None:
        kwargs["rollout_func"] = rollout
    return trainer_cls(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=processing_class, **kwargs
    )


def scripted_run(
    name: str,
    output_dir: str,
    shape: ModelShape,
    *,
    completion_lengths: Callable,
    prompt_length: Callable,
    max_completion_length: int,
    max_positions: int,
    prompts: int,
    prompt_prefix: str = "prompt-",
    rollout_seed: int = 0,
    reward=length_reward,
    shared: int = 0,
    **fields,
):
    """A whole scripted run, ready to train: trainer ``name`` (:func:`trainer_classes`) on a model of ``shape`` with
    the character tokenizer, the scripted completions and prompts of ``completion_lengths`` and ``prompt_length``
    (:class:`~hf_dynbsz.testing.ScriptedRollout`, seeded by ``rollout_seed``; with ``shared``, every prompt begins
    with the same ``shared`` tokens, a system prompt: :class:`~hf_dynbsz.testing.prefixes.PrefixRollout`),
    ``prompts`` numbered prompts, the config of :func:`run_config` with ``fields``."""
    from hf_dynbsz.testing.fixtures import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = shape.build(tokenizer, max_positions=max_positions)
    rollout = tokenizer_rollout(
        tokenizer, completion_lengths, prompt_length, max_completion_length=max_completion_length, seed=rollout_seed
    )
    if shared:
        rollout = PrefixRollout(completion_lengths, prompt_length, shared=shared,
                                max_completion_length=max_completion_length, seed=rollout_seed,
                                token_low=rollout.token_low, token_high=rollout.token_high,
                                eos_id=rollout.eos_id)  # fmt: skip
    args = run_config(name, output_dir, max_completion_length=max_completion_length, **fields)
    dataset = numbered_prompts(prompts, prefix=prompt_prefix)
    return build_trainer(args, model, tokenizer, dataset=dataset, reward=reward, rollout=rollout)


def distillation_config(name: str, output_dir: str, **fields):
    """The config of distillation trainer ``name`` ("distillation_stock" or "distillation_dynamic") for the comparison
    runs: :data:`~hf_dynbsz.testing.fixtures.COMPARISON_FIELDS` (no ``num_generations``: one completion per prompt) on
    a CPU run, ``fields`` on top."""
    from hf_dynbsz.testing.fixtures import COMPARISON_FIELDS

    comparison = {key: value for key, value in COMPARISON_FIELDS.items() if key != "num_generations"}
    return trainer_classes(name)[1](**{"output_dir": output_dir, **comparison, **CPU_RUN_FIELDS, **fields})


def distillation_trainer(
    name: str,
    output_dir: str,
    *,
    model_dir: str,
    teacher=None,
    rollout=None,
    dataset=None,
    trainer_kwargs=None,
    args=None,
    **fields,
):
    """Distillation trainer ``name`` (:func:`distillation_config` with ``fields``, or ``args``) on the student saved in
    ``model_dir`` (fp32) and its tokenizer, recording its generations (:class:`RecordedGeneration`). ``teacher``: a
    model, a saved model's directory (TRL loads it), or None for :func:`~hf_dynbsz.testing.build_tiny_teacher`;
    ``rollout``: a scripted rollout standing in for generation (:class:`ScriptedGeneration`); ``dataset``: the prompts
    (default :func:`~hf_dynbsz.testing.prompt_dataset`); ``trainer_kwargs`` go to the constructor."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.fixtures import build_tiny_teacher, load_tokenizer, prompt_dataset

    tokenizer = load_tokenizer(model_dir)
    return build_trainer(
        args if args is not None else distillation_config(name, output_dir, **fields),
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        tokenizer,
        dataset=prompt_dataset() if dataset is None else dataset,
        rollout=rollout,
        trainer_cls=trainer_classes(name)[0],
        teacher_model=build_tiny_teacher(tokenizer) if teacher is None else teacher,
        **(trainer_kwargs or {}),
    )


def run_distillation(name: str, output_dir: str, **kwargs):
    """Train :func:`distillation_trainer` and return ``(initial parameters, final parameters, generated completion
    ids, log history)``."""
    trainer = distillation_trainer(name, output_dir, **kwargs)
    initial = snapshot_parameters(trainer.model)
    trainer.train()
    return initial, snapshot_parameters(trainer.model), trainer.__dict__.get("generated", []), trainer.state.log_history


def saved_model_trainer(args, model_dir: str, **kwargs):
    """The trainer of ``args`` (:func:`build_trainer`) on the model saved in ``model_dir`` (fp32) with its tokenizer,
    the prompt dataset and a :class:`~hf_dynbsz.testing.RecordingReward`: the comparison runs' trainer."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.fixtures import RecordingReward, load_tokenizer, prompt_dataset

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return build_trainer(
        args, model, load_tokenizer(model_dir), dataset=prompt_dataset(), reward=RecordingReward(), **kwargs
    )


def training_mode_trainer(args, model_dir: str, accumulation: int):
    """:func:`saved_model_trainer` in training mode with the accumulation count the Trainer loop sets
    (``accumulation`` slices per optimizer step): a trainer whose loss methods a test calls directly."""
    trainer = saved_model_trainer(args, model_dir)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def positional_trainer(trainer_cls, config_cls, model_dir: str, output_dir: str):
    """``(trainer, args)``: ``trainer_cls`` built with stock's positional order (model, reward_funcs, args,
    train_dataset, eval_dataset, processing_class) on the model saved in ``model_dir``, ``args`` a plain
    ``config_cls`` of the comparison runs."""
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.fixtures import RecordingReward, base_config_kwargs, load_tokenizer, prompt_dataset

    args = config_cls(**base_config_kwargs(output_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return trainer_cls(model, RecordingReward(), args, prompt_dataset(), None, load_tokenizer(model_dir)), args


def construction_arguments(config_cls, output_dir: str, missing: str) -> dict:
    """A trainer's keyword arguments but the model and tokenizer (a :class:`~hf_dynbsz.testing.RecordingReward`,
    the prompt dataset, ``config_cls``'s comparison config), ``missing`` left out (``args`` missing: stock's default
    config, which wants bf16 on a CPU machine)."""
    from hf_dynbsz.testing.fixtures import RecordingReward, base_config_kwargs, prompt_dataset

    kwargs = dict(
        reward_funcs=RecordingReward(),
        train_dataset=prompt_dataset(),
        args=config_cls(**base_config_kwargs(output_dir)),
    )
    del kwargs[missing]
    return kwargs


def construction_error(trainer_cls, model_dir: str, **kwargs) -> tuple[type, str]:
    """The type and message of the exception ``trainer_cls`` raises when built on the model saved in ``model_dir``
    with ``kwargs`` (AssertionError when it is built)."""
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.fixtures import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    try:
        trainer_cls(model=model, processing_class=load_tokenizer(model_dir), **kwargs)
    except Exception as error:  # noqa: BLE001 - whatever stock raises is the expected answer
        return type(error), str(error)
    raise AssertionError(f"{trainer_cls.__name__} was built with {sorted(kwargs)}")


def snapshot_parameters(model) -> dict:
    """A detached copy of every named parameter of ``model`` (to compare a run's before and after)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def quiet_worker(threads: int | None = 1) -> None:
    """A worker process's setup: transformers' and TRL's notices silenced, ``threads`` torch threads (None: torch's
    default)."""
    import torch
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)


def step_clock(synchronize: Callable[[], None] = lambda: None):
    """A trainer callback recording each optimizer step's wall time in ``seconds`` (``synchronize``, e.g. the
    device's, called at both ends)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.begin = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.seconds.append(time.perf_counter() - self.begin)

    return StepClock()


def accelerate_command(
    config: str | Path, script: str | Path, *arguments, num_processes: int | None = None, machine: tuple = ()
) -> list[str]:
    """``accelerate launch`` of ``script`` (a path, or one relative to the repository) with ``arguments``, under
    ``config`` (a path, or a file of ``accelerate_configs/``); ``num_processes``: the config's unless given.
    ``machine``: ``(machine_rank, machines, main_process_port)``, this machine's launch of a multi-node run over
    TCP on this host (``--num_machines``, ``--machine_rank``, ``--main_process_ip 127.0.0.1``, ``--main_process_port``:
    one launch per machine, started together)."""
    config, script = Path(config), Path(script)
    config = config if config.is_absolute() else REPO_ROOT / "accelerate_configs" / config
    script = script if script.is_absolute() else REPO_ROOT / script
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if machine:
        rank, machines, port = machine
        command += ["--num_machines", str(machines), "--machine_rank", str(rank)]
        command += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    return command + [str(script), *map(str, arguments)]


def flag_arguments(options: dict) -> list[str]:
    """Command-line flags of ``options``: ``--key value`` each, ``--key`` alone for ``True``."""
    arguments = []
    for key, value in options.items():
        arguments += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return arguments


def scenario_worker_arguments(trainers: list[str], scenario: str = "flag"):
    """The command line of a worker that trains a model in turn per scenario (``tests/distributed_dpo.py``,
    ``tests/distributed_async_grpo.py``): ``--trainer`` (one of ``trainers``), ``--model_dir``, ``--out`` and
    ``--scenarios``, a JSON object of the scenarios' ``scenario`` values by name."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=trainers, required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    example = f'{{"name": {{"{scenario}": value}}}}'
    parser.add_argument("--scenarios", required=True, help=f"JSON {example}: one run per name")
    return parser.parse_args()


def grpo_worker_command(
    config: str, out, model_dir: str, trainer: str, *, num_processes: int | None = None, machine: tuple = (), **options
) -> list[str]:
    """``accelerate launch`` of ``tests/distributed_grpo.py`` (the multi-process tests' worker) under ``config``:
    ``trainer`` trained from ``model_dir``, each rank's record written to ``{out}.rank{N}.json``; ``options`` become
    its flags (:func:`flag_arguments`); ``num_processes`` and ``machine``: :func:`accelerate_command`'s."""
    arguments = ["--trainer", trainer, "--model_dir", model_dir, "--out", out, *flag_arguments(options)]
    return accelerate_command(
        config, "tests/distributed_grpo.py", *arguments, num_processes=num_processes, machine=machine
    )


def run_script_worker(
    script: str | Path, spec: dict, timeout: float, label: str, *, prefix: str, threads: int = 1
) -> dict:
    """``python script --worker JSON --worker-out FILE`` in a fresh process with ``threads`` OpenMP/MKL threads;
    ``spec`` gains ``output_dir`` (a scratch folder); returns the JSON the worker wrote."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        spec = dict(spec, output_dir=os.path.join(tmp, "out"))
        result_path = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            str(Path(script).resolve()),
            "--worker",
            json.dumps(spec),
            "--worker-out",
            result_path,
        ]
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        run_with_timeout(command, Path(tmp), timeout, label, env=env)
        with open(result_path) as handle:
            return json.load(handle)
