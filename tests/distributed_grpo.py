"""Worker for the multi-process tests: `accelerate launch --config_file <yaml> tests/distributed_grpo.py ...`.

Trains stock GRPOTrainer or DynamicBatchGRPOTrainer (``--trainer stock|dynamic``), or stock RLOOTrainer or
DynamicBatchRLOOTrainer (``--trainer rloo_stock|rloo_dynamic``: the GRPO-only flags ``--loss_type``,
``--top_entropy_quantile``, ``--entropy_coef`` do not apply, and RLOO has no ``rollout_func``: generation only), or
stock DistillationTrainer or DynamicBatchDistillationTrainer (``--trainer distillation_stock|distillation_dynamic``,
the teacher loaded by TRL from ``--teacher_dir``; ``--beta`` is the divergence's, ``--temperature`` its temperature;
scripted rollouts stand in for generation, ``multiturn``'s environment mask as the tool mask) from a saved tiny model
and writes, from rank 0, the final (gathered) parameters, the completions every rank generated, and each rank's dynbsz
metrics and every other metric it logged (``logged``: the loss metrics among them).

``--rollout lopsided`` replaces generation by a scripted rollout that gives every long completion to process 1
(18-24 tokens against 1-3 on process 0); ``prefix`` by a lopsided one with prefix structure (a 16-token block every
prompt begins with, each prompt's completions sharing a trunk and one of two branches: a distillation's one completion
per prompt needs ``--repeat_prompts`` for the trunks); ``multiturn`` by scripted
multi-turn completions with an environment mask;
``environment`` trains with an environment that owns the prompts (no dataset) and the reward (no reward function).
``--loss_types a,b,c`` trains once per loss type in the same launch (files suffixed ``.a``...), and ``--scenarios``
(JSON, ``{"name": {"flag": value, ...}, ...}``) once per named set of flags over the command line's (files suffixed
``.name``): a launch's start-up (about 14 s on 2 CPU cores) costs more than a tiny run (about 2 s). ``--vllm
server|colocate`` generates through TRL's vLLM path with the stand-in of :mod:`hf_dynbsz.testing.vllm_standin` (GRPO:
importance-sampling correction in ``--vllm_is_mode``, clipped to [0.5, 2]). ``--mutate`` corrupts, on the process
that receives them, the samples that cross-rank balancing moved (their advantage, old log-probs, loss weight or
teacher hidden states): a check that the comparison with stock would catch a sample that lost what belongs to it.
``--save_steps``, ``--kill_at`` and ``--resume`` make a killed-and-restarted run: checkpoints every N steps, a process
killed mid-step, the relaunch resumed from the latest checkpoint. Under FSDP (real on CPU processes too:
:func:`~hf_dynbsz.testing.fsdp_on_cpu`) and ZeRO-3 the parameters are gathered from every process's shards: the
initial ones (before training: ``<out>.initial.pt``; a resumed run's are the model's, before its first step) and the
final ones (``<out>.params.pt``). Each rank's record holds its ``engine``
(:func:`~hf_dynbsz.testing.engine_record`: accelerate's distributed type, the parameters sharded or whole), which the
tests check against the launch's config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time

import torch

from hf_dynbsz.testing import TEST_ALPHABET as ALPHABET
from hf_dynbsz.testing import (
    CountingEnvironment,
    MultiTurnRollout,
    PrefixRollout,
    RecordingReward,
    ScriptedRollout,
    VisionScriptedRollout,
    base_config_kwargs,
    build_tiny_vision_language_model,
    build_trainer,
    distillation_config,
    distillation_trainer,
    engine_record,
    fsdp_on_cpu,
    gathered_parameters,
    image_prompt_dataset,
    leave_worker,
    load_tokenizer,
    logged_metrics,
    prompt_dataset,
    save_tiny_model,
    trainer_classes,
    vllm_standin,
)

#: ``--rollout``'s choices (see the module's docstring).
ROLLOUTS = ("generate", "lopsided", "prefix", "multiturn", "environment")


def lopsided_dataset(num_blocks: int = 8):
    """With shuffle_dataset=False and 2 prompts per rank per generation round, rank 1 gets the long prompts."""
    from datasets import Dataset

    prompts = []
    for block in range(num_blocks):
        short = [ALPHABET[(block + i) % 4] * 3 for i in range(2)]
        long = [(ALPHABET * 20)[block + i :][:70] for i in range(2)]
        prompts += short + long
    return Dataset.from_dict({"prompt": prompts})


@contextlib.contextmanager
def corrupt_moved_samples(what: str):
    """Inside the context, StepBatch.moved damages ``what`` of every sample that arrives from another process
    (``what`` "none": nothing)."""
    from hf_dynbsz.execution.batch import StepBatch

    if what == "none":
        yield
        return
    moved_batch = StepBatch.moved

    def damaged(self, group, exchange, media=False):
        moved = moved_batch(self, group, exchange, media)
        arrived = torch.tensor([origin != group.rank for origin, _ in exchange.incoming])
        if what == "teacher_hidden":  # a distillation's teacher states of the samples that arrived
            for index in arrived.nonzero().flatten().tolist():
                moved.teacher_hidden[index] = moved.teacher_hidden[index] + 0.5
        elif what == "advantage":
            moved.advantages[arrived] = -moved.advantages[arrived]
        elif what == "old_logps":
            moved.per_token["old_per_token_logps"][arrived] -= 0.5
        else:
            moved.policy_weights[arrived] *= 1.5
        return moved

    StepBatch.moved = damaged
    try:
        yield
    finally:
        StepBatch.moved = moved_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    add_trainer_flags(parser)
    parser.add_argument("--num_iterations", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--top_entropy_quantile", type=float, default=1.0)
    parser.add_argument("--entropy_coef", type=float, default=0.0)
    parser.add_argument("--lopsided", action="store_true")
    parser.add_argument("--loss_types", default=None, help="comma-separated: train once per loss type, in turn")
    parser.add_argument(
        "--scenarios", default=None, help='JSON {"name": {"flag": value}}: train once per name, in turn'
    )
    parser.add_argument("--balance", choices=["on", "off"], default="on")
    add_generation_flags(parser)
    parser.add_argument(
        "--mutate", choices=["none", "advantage", "old_logps", "weight", "teacher_hidden"], default="none"
    )
    parser.add_argument("--rank1_env", default=None, help="VARIABLE=VALUE set in process 1's environment only")
    parser.add_argument("--router_aux_loss_coef", type=float, default=None, help="TRL's MoE router aux loss weight")
    parser.add_argument(
        "--max_memory_mib", type=int, default=None, help="max_memory_per_device_mib (budget from memory)"
    )
    parser.add_argument("--inject_oom", default=None, help="kind:phase:after:rank of an injected out-of-memory error")
    parser.add_argument(
        "--vision",
        default=None,
        help="a tiny vision-language model of this family (built here, not "
        "loaded), image prompts, lopsided completions",
    )
    parser.add_argument(
        "--sequence_parallel",
        type=int,
        default=1,
        help="parallelism_config=ParallelismConfig(sp_backend='deepspeed', sp_size=N) (ours only)",
    )
    parser.add_argument(
        "--no_gradient_checkpointing",
        action="store_true",
        help="gradient_checkpointing=False (GRPOConfig's default is True)",
    )
    parser.add_argument(
        "--architecture",
        default=None,
        help="train save_tiny_model's ARCHITECTURE (qwen3_next: a hybrid) instead of --model_dir's model",
    )
    parser.add_argument("--oversize_policy", choices=["warn", "error"], default="warn")
    parser.add_argument("--tensor_batch_size", type=int, default=None)
    parser.add_argument("--long_rank", type=int, default=1, help="--rollout lopsided: the process given the long ones")
    parser.add_argument(
        "--plain_exit",
        action="store_true",
        help="return from the script as a user's script does: no trainer.end(), no os._exit",
    )
    parser.add_argument(
        "--linger", type=float, default=0.0, help="with --plain_exit: seconds process 0 works on before it saves"
    )
    add_restart_flags(parser)
    cli = parser.parse_args()
    fsdp_on_cpu()  # a distributed_type: FSDP launch on CPU processes runs FSDP, as on GPUs (else plain DDP)
    if cli.rank1_env and os.environ.get("RANK") == "1":  # a DIFFU_* variable exported on one machine only
        name, value = cli.rank1_env.split("=", 1)
        os.environ[name] = value
    trainer = None
    for suffix, run in runs(cli):
        if run.inject_oom:  # armed for this run (a scenario's own), fired once
            from hf_dynbsz.execution.device_memory import inject_out_of_memory

            kind, phase, after, rank = run.inject_oom.split(":")
            inject_out_of_memory(kind, phase, int(after), int(rank))
        with corrupt_moved_samples(run.mutate):
            trainer = train(run, run.loss_type, cli.out + suffix)
    if cli.plain_exit:
        return
    leave_worker(trainer)  # every result is written and closed by now


def add_restart_flags(parser) -> None:
    """A run killed and restarted: checkpoints (``--save_steps``), a process killed mid-step (``--kill_at``), the
    relaunch resumed from the latest checkpoint (``--resume``)."""
    parser.add_argument(
        "--save_steps", type=int, default=None, help="save a checkpoint every N optimizer steps (default: none)"
    )
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint of the output dir")
    parser.add_argument(
        "--kill_at", default=None, help="STEP:PASS:RANK: process RANK SIGKILLs itself in optimizer step STEP, at its "
        "PASS-th forward with gradients (mid-step)",
    )  # fmt: skip


def add_trainer_flags(parser) -> None:
    """What trains, from where, to where: ``--trainer`` (a distillation's teacher from ``--teacher_dir``), the models,
    the output prefix, and the loss's own settings (``--beta``: GRPO's KL coefficient, a distillation's divergence)."""
    parser.add_argument(
        "--trainer",
        choices=["stock", "dynamic", "rloo_stock", "rloo_dynamic", "distillation_stock", "distillation_dynamic"],
        required=True,
    )
    parser.add_argument("--teacher_dir", default=None, help="distillation: the teacher's saved model (TRL loads it)")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0)


def add_generation_flags(parser) -> None:
    """Where the completions come from: ``--rollout`` (generated or scripted), ``--vllm`` (TRL's vLLM path through the
    stand-in) and ``--vllm_is_mode`` (GRPO's importance-sampling mode there); ``--repeat_prompts``: how many of a
    distillation's completions (one per prompt) share a prompt."""
    parser.add_argument("--rollout", choices=ROLLOUTS, default="generate")
    parser.add_argument(
        "--repeat_prompts", type=int, default=1, help="distillation: each dataset prompt this many times in a row"
    )
    parser.add_argument("--vllm", choices=["none", "server", "colocate"], default="none", help="TRL's vLLM path")
    parser.add_argument("--vllm_is_mode", default="token_truncate", help="vllm_importance_sampling_mode (GRPO)")


def runs(cli) -> list[tuple[str, argparse.Namespace]]:
    """``(file suffix, flags)`` of each run of this launch: one, one per ``--loss_types`` or one per ``--scenarios``."""
    if cli.loss_types and cli.scenarios:
        raise SystemExit("--loss_types and --scenarios do not combine")
    if cli.loss_types:
        return [(f".{loss_type}", argparse.Namespace(**{**vars(cli), "loss_type": loss_type})) for loss_type in
                cli.loss_types.split(",")]  # fmt: skip
    if cli.scenarios:
        scenarios = json.loads(cli.scenarios)
        for name, flags in scenarios.items():
            unknown = sorted(set(flags) - set(vars(cli)))
            if unknown:
                raise SystemExit(f"--scenarios {name}: unknown flags {unknown}")
        return [(f".{name}", argparse.Namespace(**{**vars(cli), **flags})) for name, flags in scenarios.items()]
    return [("", cli)]


def text_model(cli, out: str):
    """The tiny text model of the run: the one saved in ``--model_dir``, or ``--architecture``'s, saved here first by
    the main process (TRL loads a reference model from the model's path when ``beta`` > 0)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    directory = cli.model_dir
    if cli.architecture:
        directory, state = f"{out}-{cli.architecture}", PartialState()
        with state.main_process_first():
            if state.is_main_process:
                save_tiny_model(directory, architecture=cli.architecture)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def config_fields(cli, loss_type: str) -> dict:
    """The config fields the flags set, for stock's and the plugin's trainers alike."""
    if cli.trainer.startswith("distillation"):  # no generation round, no reward, no router aux loss
        fields = dict(beta=cli.beta, temperature=cli.temperature, max_steps=cli.max_steps)
        if cli.lopsided:
            fields.update(shuffle_dataset=False, per_device_train_batch_size=4, gradient_accumulation_steps=2)
        if cli.no_gradient_checkpointing:
            fields.update(gradient_checkpointing=False)
        return fields
    fields = dict(
        beta=cli.beta,
        num_iterations=cli.num_iterations,
        max_steps=cli.max_steps,
        router_aux_loss_coef=cli.router_aux_loss_coef,
    )
    if not cli.trainer.startswith("rloo"):  # GRPO's loss settings
        fields.update(loss_type=loss_type, top_entropy_quantile=cli.top_entropy_quantile, entropy_coef=cli.entropy_coef)
    if cli.vllm != "none":
        fields.update(use_vllm=True, vllm_mode=cli.vllm)
        if not cli.trainer.startswith("rloo"):  # RLOO has no importance-sampling correction
            fields.update(vllm_importance_sampling_mode=cli.vllm_is_mode, vllm_importance_sampling_clip_min=0.5,
                          vllm_importance_sampling_clip_max=2.0)  # fmt: skip
    if cli.lopsided:
        fields.update(
            shuffle_dataset=False, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4
        )
    if cli.save_steps:
        fields.update(save_strategy="steps", save_steps=cli.save_steps)
    if cli.no_gradient_checkpointing:
        fields.update(gradient_checkpointing=False)
    if cli.rollout == "environment":
        fields.update(max_completion_length=16)  # chat prompts with a tool schema are ~680 tokens long
    if cli.vision:  # a pass without images leaves the vision tower without gradients: DDP must be told
        fields.update(ddp_find_unused_parameters=True, max_completion_length=24)
    return fields


def make_config(trainer: str, output_dir: str, **fields):
    """``trainer``'s config of the comparison runs (:func:`~hf_dynbsz.testing.base_config_kwargs`, or a
    distillation's :func:`~hf_dynbsz.testing.distillation_config`) with ``fields``."""
    if trainer.startswith("distillation"):
        return distillation_config(trainer, output_dir, **fields)
    return trainer_classes(trainer)[1](**base_config_kwargs(output_dir, **fields))


def run_args(cli, loss_type: str, out: str):
    """The config of ``--trainer``: the comparison runs' with the flags' fields, and for the plugin its own
    settings."""
    fields = config_fields(cli, loss_type)
    if cli.trainer.endswith("stock"):
        # stock TRL needs ddp_backend="gloo" spelled out for DeepSpeed on CPU; the plugin's configs set it themselves
        return make_config(cli.trainer, out + "-run", ddp_backend="gloo", **fields)
    if cli.sequence_parallel > 1:  # accelerate's own object, as a user passes it (stock's config refuses it)
        from accelerate.parallelism_config import ParallelismConfig

        fields.update(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=cli.sequence_parallel))
    plugin = dict(
        max_tokens_per_microbatch=cli.budget or None,
        tensor_batch_size=cli.tensor_batch_size,
        oversize_policy=cli.oversize_policy,
        balance_across_ranks=cli.balance == "on",
        max_memory_per_device_mib=cli.max_memory_mib,
    )
    return make_config(cli.trainer, out + "-run", **plugin, **fields)


def scripted_rollout(cli):
    """``--rollout``'s scripted rollout (None: the model generates)."""
    if cli.rollout == "lopsided":
        return ScriptedRollout(
            lambda rng, n, rank: rng.integers(18, 25, n) if rank == cli.long_rank else rng.integers(1, 4, n),
            lambda rng: rng.integers(3, 9),
            max_completion_length=24,
            seed=1,
        )
    if cli.rollout == "prefix":  # the leaves lopsided: rank ``long_rank``'s 12-17 tokens, the other's 1-3
        return PrefixRollout(
            lambda rng, n, rank: rng.integers(12, 18, n) if rank == cli.long_rank else rng.integers(1, 4, n),
            lambda rng: rng.integers(3, 9),
            max_completion_length=24,
            seed=1,
            shared=16,
            trunk=3,
            branches=2,
            branch=2,
        )
    if cli.rollout == "multiturn":
        turn_lengths, env_lengths = (lambda rng: rng.integers(1, 7)), (lambda rng: rng.integers(2, 9))
        prompt_length = lambda rng: rng.integers(3, 12)  # noqa: E731
        return MultiTurnRollout(turn_lengths, env_lengths, prompt_length, max_completion_length=24, seed=2)
    return None


def train_distillation(cli, loss_type: str, out: str):
    """One distillation run (the student from ``--model_dir``, the teacher from ``--teacher_dir``; stock generates one
    completion per prompt: ``--repeat_prompts`` N gives a generation batch N completions of each prompt); writes each
    rank's record and, from rank 0, the final parameters, under ``out``."""
    args = run_args(cli, loss_type, out)
    dataset = lopsided_dataset() if cli.lopsided else prompt_dataset()
    dataset = dataset.select([row for row in range(len(dataset)) for _ in range(cli.repeat_prompts)])
    trainer = distillation_trainer(
        cli.trainer, out, model_dir=cli.model_dir, teacher=cli.teacher_dir, rollout=scripted_rollout(cli),
        dataset=dataset, args=args,
    )  # fmt: skip
    save_initial_parameters(trainer, out)
    trainer.train()
    write_results(trainer, None, cli, out, [])
    return trainer


def train(cli, loss_type: str, out: str):
    """One training run; writes each rank's record and, from rank 0, the final parameters, under ``out``."""
    if cli.trainer.startswith("distillation"):
        return train_distillation(cli, loss_type, out)
    if cli.trainer.startswith("rloo") and (cli.rollout != "generate" or cli.vision):
        raise SystemExit("--trainer rloo_*: RLOOTrainer takes no rollout_func (--rollout generate, no --vision)")
    if cli.vision:  # built before the config: under ZeRO-3 a config makes models built afterwards partitioned at birth
        model, processing_class = build_tiny_vision_language_model(cli.vision)
        dataset = image_prompt_dataset([1, 2, 2, 1, 1, 1, 2, 1])
        rollout = VisionScriptedRollout(
            processing_class,
            lambda rng, n, rank: rng.integers(18, 25, n) if rank == 1 else rng.integers(1, 4, n),
            max_completion_length=24,
            seed=1,
            token_low=3,
            token_high=30,
            eos_id=processing_class.tokenizer.eos_token_id,
        )
    args = run_args(cli, loss_type, out)
    if not cli.vision:
        model, processing_class, rollout = text_model(cli, out), load_tokenizer(cli.model_dir), None
        dataset = lopsided_dataset() if cli.lopsided else prompt_dataset()
    rollout = scripted_rollout(cli) or rollout
    reward = RecordingReward()
    funcs, kwargs = reward, {}
    if cli.rollout == "environment":  # the environment owns the prompts (no dataset) and the reward
        CountingEnvironment.restart()
        dataset, funcs, kwargs = None, None, dict(environment_factory=CountingEnvironment)
    trainer_cls = trainer_classes(cli.trainer)[0]
    with vllm_standin() if cli.vllm != "none" else contextlib.nullcontext() as standin:
        trainer = build_trainer(
            args, model, processing_class, dataset=dataset, reward=funcs, rollout=rollout, trainer_cls=trainer_cls,
            **kwargs,
        )  # fmt: skip
        save_initial_parameters(trainer, out)
        if cli.kill_at:
            kill_at(trainer, cli.kill_at)
        trainer.train(resume_from_checkpoint=True if cli.resume else None)
    engines = [(engine.syncs, engine.requests) for engine in standin.engines] if standin else []
    write_results(trainer, reward, cli, out, engines)
    return trainer


def save_initial_parameters(trainer, out: str) -> None:
    """The trainer's model's parameters before training, whole, written by the main process to
    ``<out>.initial.pt`` (every process takes part in gathering them)."""
    initial = gathered_parameters(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save(initial, f"{out}.initial.pt")


def kill_at(trainer, spec: str) -> None:
    """``--kill_at STEP:PASS:RANK``: process RANK kills itself (SIGKILL, as the kernel's out-of-memory killer or a
    lost machine would) at the start of its PASS-th forward with gradients of optimizer step STEP (1-based), so
    after PASS - 1 passes of that step's backward; the same point for stock's trainer and the plugin's."""
    step, nth, rank = (int(part) for part in spec.split(":"))
    if trainer.accelerator.process_index != rank:
        return
    seen = []

    def hook(module, args, kwargs):
        if torch.is_grad_enabled() and module.training and trainer.state.global_step == step - 1:
            seen.append(None)
            if len(seen) == nth:
                print(f"process {rank}: SIGKILL at its forward {nth} of optimizer step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)


def write_results(trainer, reward, cli, out: str, engines: list) -> None:
    """Each rank's record and, from rank 0, the final (gathered) parameters, under ``out``. ``engines``: the
    ``(weight syncs, requests)`` of each vLLM stand-in engine of this process."""
    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model_wrapped)
    params = gathered_parameters(unwrapped)  # ZeRO-3 partitions, FSDP2 shards: every process takes part
    metrics = [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry]
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    aux_losses = [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # every metric the Trainer logged but the timings and the plugin's own (the loss metrics stock logs per slice
    # among them), entry by entry
    logged = logged_metrics(trainer.state.log_history)
    # the importance-sampling figures TRL logs at each generation round (vLLM path)
    sampling = [
        {name: entry[name] for name in entry if name.startswith("sampling/")}
        for entry in trainer.state.log_history
        if any(name.startswith("sampling/") for name in entry)
    ]
    rank_record = {
        "rank": accelerator.process_index,
        "engine": engine_record(accelerator, unwrapped),
        "completions": reward.completions if reward is not None else trainer.generated,  # (a distillation's ids)
        "metrics": metrics,
        "rewards": rewards,
        "aux_losses": aux_losses,
        "losses": losses,
        "logged": logged,
        "sampling": sampling,
        "vllm_engines": engines,
        "self_check": getattr(getattr(trainer, "_dynbsz", None), "self_check_summary", None),
    }
    with open(f"{out}.rank{accelerator.process_index}.json", "w") as f:
        json.dump(rank_record, f)
    if accelerator.is_main_process:
        time.sleep(cli.linger if cli.plain_exit else 0.0)  # still working after train() while the others exit
        torch.save(params, f"{out}.params.pt")
    if not cli.plain_exit:
        accelerator.wait_for_everyone()
    # --plain_exit: as a user's script, no barrier: process 0 still saves while the others return and exit


if __name__ == "__main__":
    main()
