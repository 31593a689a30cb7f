"""DynamicBatchDistillationTrainer equals stock TRL DistillationTrainer, single process.

Each comparison trains stock ``trl.DistillationTrainer`` and ``DynamicBatchDistillationTrainer`` from the same saved
tiny student (Qwen2-style, hidden 32) and the same teacher (3.4x the student's parameters, the same vocabulary:
hidden 48, 3 layers), with a token budget small enough that every optimizer step is cut into passes unlike stock's
fixed slices, and checks: identical generations, the same parameters afterwards (relative difference <= 1e-5, and the
relative difference of the *updates*, which is what would expose a mis-weighted token), and the same logged loss and
entropy. Stock's settings each get a run: ``beta`` 0 (forward KL), 0.5 (JSD) and 1 (reverse KL), temperatures off 1,
gradient accumulation of 1, 2 and 4 slices, gradient checkpointing on and off, a tool mask; so do the plugin's
capabilities: padded and padding-free rows, shared prompts, the prefix tree (the default: a block shared across
prompts, trunks and branches of a prompt's completions, on both models), the teacher's own budget, the budget from
memory and out-of-memory passes, LoRA, the self-check on both models. Multi-process runs (DDP, ZeRO-3, balancing) are in
``tests/test_distributed_distillation.py``.
"""

from __future__ import annotations

import inspect
import logging

import pytest
from trl import DistillationConfig, DistillationTrainer

from hf_dynbsz import DynamicBatchDistillationTrainer
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.testing import (
    TEST_ALPHABET,
    ScriptedRollout,
    build_char_tokenizer,
    comparison_prefix_rollout,
    distillation_config,
    distillation_trainer,
    numbered_prompts,
    overridden_stock_methods,
    parameter_mismatches,
    relative_difference,
    run_distillation,
    signature_mismatches,
)

# Forces repacking: prompts are 3-18 tokens, completions 1-24, so stock slices of 4 rows get cut up.
SMALL_BUDGET = 40
PARAM_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-3
#: Settings only DynamicBatchDistillationConfig has.
OURS = (
    "max_tokens_per_microbatch",
    "max_tokens_per_microbatch_teacher",
    "packing_layout",
    "share_prompt_prefix",
    "per_device_generation_batch_size",
    "max_memory_per_device_mib",
    "self_check",
)


def compare_with_stock(model_dir, tmp_path, make_rollout=None, **overrides):
    """Stock DistillationTrainer and ours on the same run (``make_rollout``: a new scripted rollout for each, instead
    of generation): same generations, parameters and logged loss and entropy; returns our logged steps."""
    ours_only = {key: overrides.pop(key) for key in list(overrides) if key in OURS}
    ours_only.setdefault("max_tokens_per_microbatch", SMALL_BUDGET)
    if make_rollout is not None:
        overrides["rollout"] = make_rollout()
    init, stock, stock_generated, stock_history = run_distillation(
        "distillation_stock", str(tmp_path / "stock"), model_dir=model_dir, **overrides
    )
    if make_rollout is not None:
        overrides["rollout"] = make_rollout()
    init2, ours, generated, history = run_distillation(
        "distillation_dynamic", str(tmp_path / "ours"), model_dir=model_dir, **overrides, **ours_only
    )
    assert generated == stock_generated and generated, "generations must be identical for the same seed"
    assert relative_difference(init2, init) == 0.0
    tolerances = dict(update_tolerance=UPDATE_TOLERANCE, param_tolerance=PARAM_TOLERANCE)
    assert not parameter_mismatches(init, ours, stock, trained_by=1e-4, **tolerances)
    steps = [entry for entry in history if "dynbsz/microbatches" in entry]
    stock_steps = [entry for entry in stock_history if "entropy" in entry]
    assert len(steps) == len(stock_steps) == overrides.get("max_steps", 2)
    for name in ("loss", "entropy", "completions/mean_length"):  # (a divergence near 0: float noise of 1e-8 shows)
        expected = [step[name] for step in stock_steps]
        assert [step[name] for step in steps] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    return steps


DISTILLATION_OPTIONS = {
    # the generalized JSD at a temperature off 1, TRL's default gradient checkpointing, two slices per step
    "jsd_cold": dict(beta=0.5, temperature=0.7),
    # forward KL, one slice per step (GA 1) of 8 rows, no gradient checkpointing, padded rows
    "forward_kl_one_slice_padded": dict(
        beta=0.0, per_device_train_batch_size=8, gradient_accumulation_steps=1, gradient_checkpointing=False,
        packing_layout="padded",
    ),
    # reverse KL, hot, four slices of two rows per step, three steps
    "reverse_kl_hot_four_slices": dict(
        beta=1.0, temperature=1.3, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=3
    ),
}  # fmt: skip


@pytest.mark.parametrize("options", list(DISTILLATION_OPTIONS))
def test_matches_stock(model_dir, tmp_path, options):
    steps = compare_with_stock(model_dir, tmp_path, **DISTILLATION_OPTIONS[options])
    padded = DISTILLATION_OPTIONS[options].get("packing_layout") == "padded"
    assert all((step["dynbsz/padding_fraction"] > 0) == padded for step in steps)
    assert all(step["dynbsz/teacher_seconds"] > 0 for step in steps)


def long_tailed_rollout(seed: int = 0, max_completion_length: int = 48) -> ScriptedRollout:
    """Scripted completions of 1-48 tokens (geometric, a long tail) after prompts of 3-11 tokens."""
    return ScriptedRollout(
        lambda rng, n, rank: rng.geometric(0.08, n),
        lambda rng: rng.integers(3, 12),
        max_completion_length=max_completion_length,
        seed=seed,
    )


def test_shared_prompts_and_the_teachers_own_budget_on_long_tailed_completions(model_dir, tmp_path):
    """Duplicate prompts (4 per prompt string) share their prompt in padding-free passes; the teacher's passes take
    their own budget (here 3 x the training budget): fewer teacher passes than training passes."""
    steps = compare_with_stock(
        model_dir,
        tmp_path,
        make_rollout=long_tailed_rollout,
        dataset=repeated_prompts(),
        max_completion_length=48,
        beta=0.5,
        max_tokens_per_microbatch=64,
        max_tokens_per_microbatch_teacher=192,
    )
    for step in steps:
        assert step["dynbsz/shared_tokens_saved"] > 0 and step["dynbsz/padding_fraction"] == 0
        assert step["dynbsz/computed_tokens"] < step["dynbsz/stock_computed_tokens"]
        assert step["dynbsz/microbatches"] >= 2


def repeated_prompts():
    """4 prompts, each 4 times: stock generates one completion per prompt, so a step of 8 holds several completions of
    a prompt (its prompt shared in a pass; a trunk and branches too under a tree rollout)."""
    return numbered_prompts(4, prefix="p").select([0, 1, 2, 3] * 4)


#: The prefix-tree runs (the default share_prompt_prefix="tree", self-check on): the structures of
#: :data:`~hf_dynbsz.testing.PREFIX_STRUCTURES` (shared across prompts, within a prompt's completions, both), every
#: ``beta``, temperatures off 1; the last one in a budget that cuts the step's tree into pieces, each carrying its path,
#: over four slices of two rows.
PREFIX_TREE_RUNS = {
    "forward_kl_shared_block": dict(structures=("shared block",), beta=0.0, temperature=0.7, budget=160),
    "jsd_tree_rollout": dict(structures=("tree rollout",), beta=0.5, temperature=1.3, budget=160),
    "reverse_kl_both_in_pieces": dict(
        structures=("shared block", "tree rollout"), beta=1.0, temperature=0.7, budget=64,
        per_device_train_batch_size=2, gradient_accumulation_steps=4,
    ),
}  # fmt: skip


@pytest.mark.parametrize("run", list(PREFIX_TREE_RUNS))
def test_a_prefix_tree_matches_stock(model_dir, tmp_path, run):
    """The default prefix tree on both models: the student's training passes and the teacher's no-grad passes compute
    each shared position once (a block shared across prompts, trunks and branches of a prompt's completions), the
    teacher's hidden state there is gathered for every sample holding it, and each sample's divergence terms sum to
    stock's gradient. The tree really ran (tokens saved beyond prompt groups), and the logged counts are the rollout's:
    computed + saved = the samples' tokens, and a step in one pass computes each distinct prefix once."""
    options = dict(PREFIX_TREE_RUNS[run])
    structures, budget = options.pop("structures"), options.pop("budget")
    rollouts = []

    def make_rollout():
        rollouts.append(comparison_prefix_rollout(*structures))
        return rollouts[-1]

    steps = compare_with_stock(
        model_dir, tmp_path, make_rollout=make_rollout, dataset=repeated_prompts(), max_tokens_per_microbatch=budget,
        **options,
    )  # fmt: skip
    assert all(step["dynbsz/tree_tokens_saved"] > 0 for step in steps)  # beyond what prompt groups share
    for step, generated in zip(steps, rollouts[1].rounds):  # one generation per optimizer step
        assert step["dynbsz/computed_tokens"] + step["dynbsz/shared_tokens_saved"] == generated["real_tokens"]
        assert step["dynbsz/padding_fraction"] == 0
        if step["dynbsz/microbatches"] == 1:
            assert step["dynbsz/computed_tokens"] == generated["unique_tokens"]
    assert any(step["dynbsz/microbatches"] == 1 for step in steps) == (budget == 160)


def test_a_prefix_tree_the_teacher_computes_wrong_steps_the_pair_down_to_prompt_groups(
    model_dir, tmp_path, monkeypatch, caplog
):
    """The self-check's tree rung checks the teacher too: the teacher's rows in the check made to lose their
    grandparents' keys (each node sees its parent's only, as in a shared prompt's row: right for prompt groups, wrong
    for a block shared across prompts), the student's right. The pair leaves the tree with the teacher's reason,
    logged once, trains prompt groups and equals stock."""
    from hf_dynbsz.execution.attention.layout import SegmentLayout
    from hf_dynbsz.execution.check_passes import CheckPasses

    build, check = SegmentLayout._build_parts, CheckPasses.layout

    def parent_only(layout):
        return [part._replace(path=part.path[-1:]) for part in build(layout)]

    def teacher_rows_wrong(passes, layout, indices, gradients):
        if passes.model is not teacher:
            return check(passes, layout, indices, gradients)
        with monkeypatch.context() as patch:
            patch.setattr(SegmentLayout, "_build_parts", parent_only)
            return check(passes, layout, indices, gradients)

    options = dict(beta=0.5, temperature=0.7, dataset=repeated_prompts())
    _, stock, _, _ = run_distillation(
        "distillation_stock", str(tmp_path / "a"), model_dir=model_dir,
        rollout=comparison_prefix_rollout("shared block"), **options,
    )  # fmt: skip
    trainer = distillation_trainer(
        "distillation_dynamic", str(tmp_path / "b"), model_dir=model_dir,
        rollout=comparison_prefix_rollout("shared block"), max_tokens_per_microbatch=160, **options,
    )  # fmt: skip
    teacher = trainer._dynbsz.loss.teacher.unwrapped
    monkeypatch.setattr(CheckPasses, "layout", teacher_rows_wrong)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        trainer.train()
    executor = trainer._dynbsz
    assert executor.enabled and executor.scheduler.sharing is SharePrefix.GROUPS
    assert "teacher: padding_free, prefix tree, segment attention (sdpa): log-probs differ" in caplog.text
    assert sum(record.getMessage().count("prefix tree") for record in caplog.records) == 1  # one reason, logged once
    steps = [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry]
    assert steps and all(step["dynbsz/shared_tokens_saved"] > 0 and "dynbsz/tree_tokens_saved" not in step
                         for step in steps)  # fmt: skip
    assert relative_difference(dict(trainer.model.named_parameters()), stock) <= PARAM_TOLERANCE


def test_the_teacher_budget_defaults_to_the_log_prob_rule_at_the_teachers_size(model_dir, tmp_path):
    trainer = distillation_trainer("distillation_dynamic", str(tmp_path), model_dir=model_dir)
    scheduler = trainer._dynbsz.scheduler
    assert 0.3 < scheduler.teacher_scale < 0.8  # a teacher 1.5x as wide and 1.5x as deep holds more per token
    assert scheduler.budget(100, "teacher") == round(2 * 100 * scheduler.teacher_scale)
    assert scheduler.budget(100, "logprob") == 200


def test_a_tool_mask_leaves_tool_tokens_out_of_the_loss_as_stock(model_dir, tmp_path):
    """Completions with tool-result tokens (tool_mask 0, as stock's tool loop marks them): the teacher and the
    student run every completion token, the divergence counts the model's tokens only, num_items_in_batch too."""
    from hf_dynbsz.testing import MultiTurnRollout

    def rollout():
        return MultiTurnRollout(
            lambda rng: rng.integers(2, 8), lambda rng: rng.integers(2, 6), lambda rng: rng.integers(3, 10),
            max_completion_length=32, seed=0,
        )  # fmt: skip

    steps = compare_with_stock(model_dir, tmp_path, make_rollout=rollout, max_completion_length=32, beta=0.5)
    assert all(step["dynbsz/microbatches"] >= 2 for step in steps)


def test_dynamic_batching_off_is_stock(model_dir, tmp_path):
    _, stock, generated, _ = run_distillation("distillation_stock", str(tmp_path / "a"), model_dir=model_dir)
    _, ours, ours_generated, history = run_distillation(
        "distillation_dynamic", str(tmp_path / "b"), model_dir=model_dir, dynamic_batching=False
    )
    assert ours_generated == generated
    assert relative_difference(ours, stock) == 0.0
    assert not any("dynbsz/microbatches" in entry for entry in history)


def test_plain_distillation_config_is_accepted_and_environment_overrides_apply(
    model_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "33")
    _, stock, _, _ = run_distillation("distillation_stock", str(tmp_path / "a"), model_dir=model_dir, max_steps=1)
    args = distillation_config("distillation_stock", str(tmp_path / "b"), max_steps=1)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        _, ours, _, history = run_distillation(
            "distillation_dynamic", str(tmp_path / "b"), model_dir=model_dir, args=args
        )
    assert type(args) is DistillationConfig and args.max_tokens_per_microbatch == 33
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    steps = [entry for entry in history if "dynbsz/budget_tokens" in entry]
    assert steps and all(step["dynbsz/budget_tokens"] == 33 for step in steps)
    plan = caplog.text[caplog.text.index("hf_dynbsz batch-size plan") :]
    assert "DIFFU_MAX_TOKENS" in plan and "num_generations" not in plan  # a distillation's plan: no GRPO round
    teacher = next(line for line in plan.splitlines() if line.startswith("max_tokens_per_microbatch_teacher"))
    assert "2 x training x scale" in teacher


# ---- drop-in: stock's constructor, hooks and errors ------------------------------------------------------------------
def test_constructor_and_overridden_hooks_have_stocks_signatures():
    overridden = set(overridden_stock_methods(DynamicBatchDistillationTrainer, DistillationTrainer))
    assert {"__init__", "training_step", "_generate_single_turn", "store_flos"} <= overridden
    assert "_get_per_token_logps_and_entropies" not in dir(DynamicBatchDistillationTrainer)  # GRPO's, not stock's
    assert not signature_mismatches(DynamicBatchDistillationTrainer, DistillationTrainer)


def construction_error(name: str, tmp_path, model_dir: str, **kwargs) -> tuple[type, str]:
    """The exception trainer ``name`` raises when built with ``kwargs`` on the saved student."""
    try:
        distillation_trainer(name, str(tmp_path / name), model_dir=model_dir, **kwargs)
    except Exception as error:  # noqa: BLE001 - whatever stock raises is the expected answer
        return type(error), str(error)
    raise AssertionError(f"{name} was built with {sorted(kwargs)}")


def other_vocabulary_teacher():
    from hf_dynbsz.testing import build_tiny_teacher

    return build_tiny_teacher(build_char_tokenizer(TEST_ALPHABET + "xyz"))


@pytest.mark.parametrize(
    "case",
    ["teacher_vocabulary", "teacher_init_kwargs_with_a_model", "lm_head_adapter", "prompt_learning", "beta"],
)
def test_construction_errors_are_stocks(model_dir, tmp_path, case):
    from peft import LoraConfig, PromptTuningConfig

    kwargs = {
        "teacher_vocabulary": dict(teacher=other_vocabulary_teacher()),
        "teacher_init_kwargs_with_a_model": dict(teacher_model_init_kwargs={"dtype": "float32"}),
        "lm_head_adapter": dict(trainer_kwargs={"peft_config": LoraConfig(r=2, target_modules=["lm_head"])}),
        "prompt_learning": dict(
            trainer_kwargs={"peft_config": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)}
        ),
        "beta": dict(beta=1.5),
    }[case]
    stock = construction_error("distillation_stock", tmp_path, model_dir, **kwargs)
    assert construction_error("distillation_dynamic", tmp_path, model_dir, **kwargs) == stock


def test_stocks_positional_call_order_works(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing import build_tiny_teacher, load_tokenizer, prompt_dataset

    args = distillation_config("distillation_stock", str(tmp_path))
    trainer = DynamicBatchDistillationTrainer(
        AutoModelForCausalLM.from_pretrained(model_dir), build_tiny_teacher(), args, prompt_dataset(), None,
        load_tokenizer(model_dir),
    )  # fmt: skip
    assert trainer.args is args and trainer._dynbsz.enabled and args.max_tokens_per_microbatch_teacher is None


def test_a_dataset_too_small_for_one_step_and_sequence_parallelism_are_refused_before_any_work(model_dir, tmp_path):
    from hf_dynbsz.testing import prompt_dataset

    with pytest.raises(ValueError, match="train_dataset has 7 rows .* fewer than the 8 prompts"):
        distillation_trainer(
            "distillation_dynamic", str(tmp_path / "a"), model_dir=model_dir, dataset=prompt_dataset(7)
        )
    with pytest.raises(ValueError, match="sequence_parallel_size=2: DynamicBatchDistillationTrainer does not run"):
        distillation_config("distillation_dynamic", str(tmp_path / "b"), sequence_parallel_size=2)


# ---- the plugin's capabilities ----------------------------------------------------------------------------------
def test_the_budget_from_memory_and_out_of_memory_passes_match_stock(model_dir, tmp_path, monkeypatch):
    """With a memory limit each kind's budget is the largest the memory model fits, the teacher's from its own model,
    keeping room for the teacher's last hidden states its passes will hold (every completion token of the step, of
    the teacher's width, fp32); a teacher pass and a training pass that run out of memory are each re-planned (the
    training step runs again from no gradients)."""

    from hf_dynbsz.execution.device_memory import inject_out_of_memory
    from hf_dynbsz.planning.memory import MemoryModel
    from hf_dynbsz.testing.fixtures import TEACHER_SHAPE

    reserved, budget = [], MemoryModel.budget

    def observed(self, kind, held_mib, longest, path_keys_per_token=0.0, reserved_mib=0.0):  # the real one, watched
        if not any(frame.function == "plan_rows" for frame in inspect.stack()):  # (not the start-up plan table's)
            reserved.append((kind, reserved_mib))
        return budget(self, kind, held_mib, longest, path_keys_per_token, reserved_mib)

    monkeypatch.setattr(MemoryModel, "budget", observed)
    inject_out_of_memory("teacher", "forward", 1)
    inject_out_of_memory("training", "backward", 1)
    steps = compare_with_stock(model_dir, tmp_path, beta=0.5, max_memory_per_device_mib=100_000)
    assert sum(step["dynbsz/oom_retries"] for step in steps) == 2
    assert all(step["dynbsz/predicted_peak_memory_mib"] > 0 for step in steps)
    samples = 8  # per_device_train_batch_size 4 x gradient_accumulation_steps 2, one process
    states = [step["completions/mean_length"] * samples * TEACHER_SHAPE["hidden_size"] * 4 / 2**20 for step in steps]
    teacher = [mib for kind, mib in reserved if kind == "teacher"]
    assert teacher[0] == teacher[1] == pytest.approx(states[0])  # the first step's, and its retry after the failure
    assert teacher[2:] == pytest.approx(states[1:]) and min(teacher) > 0
    assert all(mib == 0.0 for kind, mib in reserved if kind == "training")  # one process: nothing arrives


def test_a_lora_student_matches_stock(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    compare_with_stock(model_dir, tmp_path, trainer_kwargs={"peft_config": lora}, beta=0.5)


def test_the_self_check_checks_the_teacher_too(model_dir, tmp_path, caplog):
    """A hybrid teacher (Qwen3-Next-style: linear attention) whose layout list is made to start with padding-free
    rows without segment recurrence (as if the decision module had missed its recurrent layers): the student passes
    that layout, the teacher does not, and the pair trains the next one (segment recurrence on the teacher's
    sequence mixers) and equals stock."""
    from hf_dynbsz.planning.model_support import Layout
    from hf_dynbsz.planning.schedule import Scheduler
    from hf_dynbsz.testing import build_tiny_hybrid_lm

    def hybrid_teacher():
        return build_tiny_hybrid_lm(build_char_tokenizer(TEST_ALPHABET), seed=1)

    _, stock, _, _ = run_distillation(
        "distillation_stock", str(tmp_path / "a"), model_dir=model_dir, teacher=hybrid_teacher()
    )
    trainer = distillation_trainer(
        "distillation_dynamic", str(tmp_path / "b"), model_dir=model_dir, teacher=hybrid_teacher(),
        max_tokens_per_microbatch=SMALL_BUDGET,
    )  # fmt: skip
    executor = trainer._dynbsz
    assert executor.scheduler.segment_recurrence  # the pair runs the teacher's mixers per sequence
    mixing = Layout("padding_free", attention="dense")  # the linear attention's state crosses sequences
    executor.capabilities.layouts.insert(0, mixing)
    executor.scheduler = Scheduler.from_args(trainer.args, executor.capabilities.support, layout=mixing)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        trainer.train()
    assert executor.scheduler.layout == "padding_free" and executor.scheduler.segment_recurrence
    assert "teacher: padding_free" in executor.self_check_summary and "differ from each sample's own" in caplog.text
    assert relative_difference(dict(trainer.model.named_parameters()), stock) <= PARAM_TOLERANCE


def test_generation_is_chunked_by_per_device_generation_batch_size(model_dir, tmp_path):
    """8 prompts per device and optimizer step, generated 3, 3 and 2 at a time; the same chunks, the same completions
    (the training on them equals stock's: the chunking is the plugin's own, so stock is not the reference here)."""
    rows = []

    def record(module, args, kwargs):  # rows of each generation forward (it has a KV cache)
        if kwargs.get("use_cache") is not False:
            rows.append(kwargs["input_ids"].size(0))

    generated = []
    for run in ("a", "b"):
        trainer = distillation_trainer(
            "distillation_dynamic", str(tmp_path / run), model_dir=model_dir, per_device_generation_batch_size=3,
            max_steps=1,
        )  # fmt: skip
        trainer.model.model.register_forward_pre_hook(record, with_kwargs=True)
        trainer.train()
        generated.append(trainer.generated)
    assert rows and max(rows) <= 3 and generated[0] == generated[1] and len(generated[0]) == 8


@pytest.mark.parametrize("vllm_mode", ["server", pytest.param("colocate", marks=pytest.mark.long)])
def test_vllm_generation_matches_stock(model_dir, tmp_path, vllm_mode):
    """TRL's vLLM path through the stand-in of ``hf_dynbsz.testing.vllm_standin`` (TRL's own ``VLLMGeneration``, an
    engine on a copy of the student that samples from the weights of its last sync): stock and ours each in a stand-in
    of their own, the same completions (the weights were synced after step 1 in both) and parameters within 1e-5.
    Server mode by default, colocate mode under ``-m long``."""
    from hf_dynbsz.testing import vllm_standin

    runs = []
    for name, ours in (("distillation_stock", {}), ("distillation_dynamic", {"max_tokens_per_microbatch": 40})):
        with vllm_standin() as standin:
            runs.append(
                run_distillation(
                    name,
                    str(tmp_path / name),
                    model_dir=model_dir,
                    use_vllm=True,
                    vllm_mode=vllm_mode,
                    beta=0.5,
                    **ours,
                )  # fmt: skip
            )
            assert [engine.syncs for engine in standin.engines] == [2]  # before each of the 2 steps' generation
    (init, stock, stock_generated, _), (_, plugin, generated, history) = runs
    assert generated == stock_generated and len(generated) == 16
    assert relative_difference(plugin, stock) <= PARAM_TOLERANCE and relative_difference(stock, init) > 1e-4
    assert all(entry["dynbsz/microbatches"] >= 2 for entry in history if "dynbsz/microbatches" in entry)
