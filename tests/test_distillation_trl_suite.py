"""TRL's own DistillationTrainer tests, restated offline, each run with stock ``DistillationTrainer`` and with the class
swapped.

TRL's ``tests/test_distillation_trainer.py`` is not installed with the wheel, and its tests load models and datasets
from the Hub (``trl-internal-testing/tiny-*``, ``trl-internal-testing/zen``), which this machine cannot reach. The TRL
source stored here (the code index's ``tests/test_distillation_trainer.py`` of ``huggingface/trl``; the repository
snapshot has no 1.16 tag) tests the same ``DistillationTrainer`` API as the installed 1.16.0
(``_chunked_divergence_loss``, ``trl.kernels.chunked_divergence``, ``_forward_redirection``). This file restates its
``TestDistillationTrainer`` and ``TestDistillationTrainerVLM`` tests: the same configurations and the same assertions,
with offline stand-ins:

* the ``zen`` prompts of ``tests/test_rloo_trl_suite.py`` (the Zen of Python's lines);
* ``tiny-Qwen3ForCausalLM`` (the student): the tiny Qwen2 with TRL's Qwen3 chat template of ``hf_dynbsz.testing``;
  ``small-Qwen3ForCausalLM`` (the teacher): :func:`~hf_dynbsz.testing.build_tiny_teacher` on the same vocabulary,
  3.4x the student's parameters; ``tiny-Qwen3MoeForCausalLM`` (the tools test): Qwen3-MoE tiny from its default
  config (``hf_dynbsz.testing.zoo``), its turns ending at ``<|im_end|>``; the VLMs: Qwen2-VL, Qwen2.5-VL, LLaVA
  (``testing.vision``), self-distilled as TRL's tests do; a teacher of another vocabulary: the teacher on a wider
  one; a tokenizer without a pad token: the test tokenizer with its pad token removed.

Each test takes ``trainer_class``: stock ``DistillationTrainer`` and ``DynamicBatchDistillationTrainer`` (the class
swapped; the config stays TRL's ``DistillationConfig``, so the plugin runs its defaults). Every test that passes with
stock must pass with ours. Runs are shortened to ``max_steps`` 2 (TRL trains an epoch). Left out: the kernel's own
unit tests (``TestChunkedDivergenceLoss``: TRL's kernel, which the plugin calls unchanged; they need an accelerator),
the vLLM tests (no vLLM here), ``test_trust_remote_code`` (remote code from the Hub), the bitsandbytes and fp16 tests
(they need an accelerator), the tests of a Qwen3.5 VLM with tools (no tiny Qwen3.5 VLM builder here), and the default
``args=None`` of ``test_init_minimal`` (stock's default config asks for bf16, which this CPU machine refuses).

By default the ``representative`` tests run; ``python -m pytest -m trl_suite tests/test_distillation_trl_suite.py``
runs all (see tests/conftest.py).
"""

from __future__ import annotations

import logging
from unittest.mock import patch

import pytest
import torch
from test_rloo_trl_suite import (
    EVAL_DATASET_TYPES,
    PEFT_CASES,
    check_eval_dataset,
    eval_dataset_of,
    image_dataset,
    peft_case,
    train_and_check,
    trl_test_settings,
    vision_model,
    zen,
)
from trl import DistillationConfig, DistillationTrainer

from hf_dynbsz import DynamicBatchDistillationTrainer
from hf_dynbsz.testing import build_chat_tokenizer, load_tokenizer, save_tiny_model

pytestmark = pytest.mark.trl_suite
representative = pytest.mark.representative


@pytest.fixture(params=[DistillationTrainer, DynamicBatchDistillationTrainer], ids=["stock", "dynamic"])
def trainer_class(request):
    return request.param


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Directories standing in for the Hub's tiny models, by role."""
    from hf_dynbsz.testing import TEST_ALPHABET, build_char_tokenizer, build_tiny_teacher, save_tiny_teacher
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    root = tmp_path_factory.mktemp("hub")
    tokenizer = build_chat_tokenizer()
    paths = {"student": save_tiny_model(str(root / "student"), chat=True)}
    paths["teacher"] = save_tiny_teacher(str(root / "teacher"), chat=True)
    moe = build_tiny_causal_lm_of_type(
        "qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=1
    )
    moe.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")  # a Qwen3 turn's end
    moe.save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    paths["moe"] = str(root / "moe")
    other = build_tiny_teacher(build_char_tokenizer(TEST_ALPHABET + "xyz"))
    other.save_pretrained(root / "other_vocabulary")
    paths["other_vocabulary"] = str(root / "other_vocabulary")
    return paths


def args(tmp_path, **overrides) -> DistillationConfig:
    """TRL's test configuration (``tests/test_rloo_trl_suite.py``'s: this CPU machine, 2 optimizer steps; completions
    of up to 8 tokens)."""
    return DistillationConfig(**trl_test_settings(tmp_path, **{"max_completion_length": 8, **overrides}))


def trainer(trainer_class, hub, tmp_path, dataset=None, trainer_kwargs=None, **overrides):
    """The trainer of TRL's tests: the student and the teacher by path, the zen prompts, :func:`args` with
    ``overrides``; ``trainer_kwargs``: more of the trainer's arguments (an eval dataset, a tokenizer, another
    student, ...)."""
    models = {"model": hub["student"], "teacher_model": hub["teacher"], **(trainer_kwargs or {})}
    return trainer_class(
        **models, args=args(tmp_path, **overrides), train_dataset=zen() if dataset is None else dataset
    )


# ---- training ----------------------------------------------------------------------------------------------------
@representative
def test_train(trainer_class, hub, tmp_path):
    trained = train_and_check(trainer(trainer_class, hub, tmp_path))
    assert any("entropy" in entry for entry in trained.state.log_history)  # the student's entropy is logged


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_train_dataset_format(trainer_class, hub, tmp_path, config_name):
    trained = trainer(trainer_class, hub, tmp_path, dataset=zen(config_name))
    trained.train()
    assert trained.state.log_history[-1]["train_loss"] is not None
    assert all(torch.isfinite(param).all() for param in trained.model.parameters())


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


@representative
def test_train_with_tools(trainer_class, hub, tmp_path):
    """Generation patched as TRL's test does: for 3 prompts, one valid tool call, one with a wrong argument name, one
    answer; then "done!" after each tool result. The tool loop runs, its tool mask reaches the loss."""
    tokenizer = load_tokenizer(hub["moe"])
    first = [
        '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "c": 4}}\n</tool_call><|im_end|>',
        "i do not know any tool<|im_end|>",
    ]
    first_ids = [tokenizer.encode(text, add_special_tokens=False) for text in first]
    width = max(map(len, first_ids))
    first_ids = [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in first_ids]
    done = tokenizer.encode("done!<|im_end|>", add_special_tokens=False)

    def fake_generate(input_ids, **kwargs):
        completions = first_ids if input_ids.shape[0] == 3 else [done] * input_ids.shape[0]
        return torch.cat([input_ids, torch.tensor(completions, device=input_ids.device)], dim=-1)

    distilled = trainer_class(
        model=hub["moe"],
        teacher_model=hub["moe"],
        args=args(tmp_path, max_completion_length=128),
        train_dataset=zen("conversational_prompt_only"),
        tools=[multiply_tool],
    )
    with patch.object(distilled.model, "generate", side_effect=fake_generate):
        distilled.train()
    last = distilled.state.log_history[-1]
    assert last["train_loss"] is not None and torch.isfinite(torch.tensor(last["train_loss"]))
    logged = next(entry for entry in reversed(distilled.state.log_history) if "tools/call_frequency" in entry)
    assert logged["tools/call_frequency"] == pytest.approx(2 / 3)
    assert logged["tools/failure_frequency"] == pytest.approx(1 / 2)
    if trainer_class is DynamicBatchDistillationTrainer:  # the tool mask went through the plugin's passes
        assert any("dynbsz/microbatches" in entry for entry in distilled.state.log_history)


def test_train_stops_on_every_eos_token_id(trainer_class, hub, tmp_path):
    """A turn ends on a token only the generation config declares as eos (Phi-3.5's ``<|end|>`` in TRL's test; here
    the test model's ``d``): completions are cut after it and count as terminated."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(hub["student"])
    end, ids = tokenizer.convert_tokens_to_ids("d"), tokenizer.encode("ad", add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(hub["student"])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end]
    distilled = trainer_class(model=model, teacher_model=hub["teacher"], args=args(tmp_path), train_dataset=zen())
    assert end in distilled.generation_config.eos_token_id

    def fake_generate(input_ids, **kwargs):  # 'ad' then 'ab': the turn ends on 'd' and generation goes on after it
        completion = ids + tokenizer.encode("ab", add_special_tokens=False)
        return torch.cat([input_ids, torch.tensor([completion] * input_ids.shape[0])], dim=-1)

    with patch.object(distilled.model, "generate", side_effect=fake_generate):
        distilled.train()
    assert distilled.state.log_history[-1]["completions/mean_length"] == 2.0
    assert distilled.state.log_history[-1]["completions/clipped_ratio"] == 0.0


def test_train_with_eval(trainer_class, hub, tmp_path):
    evaluation = dict(per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2)
    distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs={"eval_dataset": zen(split="test")}, **evaluation)
    distilled.train()
    assert distilled.state.log_history[-1]["train_loss"] is not None
    assert any("eval_loss" in entry for entry in distilled.state.log_history)


def test_train_eval_on_start(trainer_class, hub, tmp_path):
    evaluation = dict(per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2, eval_on_start=True)
    distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs={"eval_dataset": zen(split="test")}, **evaluation)
    distilled.train()


def test_train_with_iterable_dataset(trainer_class, hub, tmp_path):
    distilled = trainer(trainer_class, hub, tmp_path, dataset=zen().to_iterable_dataset())
    assert distilled.args.accelerator_config.dispatch_batches is False  # the stream is sharded per process
    distilled.train()
    assert distilled.state.log_history[-1]["train_loss"] is not None


def test_iterable_dataset_requires_dispatch_batches_false_and_one_worker(trainer_class, hub, tmp_path):
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        trainer(
            trainer_class, hub, tmp_path, dataset=zen().to_iterable_dataset(),
            accelerator_config={"dispatch_batches": True},
        )  # fmt: skip
    distilled = trainer(
        trainer_class, hub, tmp_path, dataset=zen().to_iterable_dataset(), dataloader_num_workers=4, max_steps=1
    )
    assert distilled.args.dataloader_num_workers == 0


def test_iterable_eval_keeps_map_style_train_workers(trainer_class, hub, tmp_path):
    evaluated = {"eval_dataset": zen(split="test").to_iterable_dataset()}
    workers = dict(per_device_eval_batch_size=3, dataloader_num_workers=4)
    distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs=evaluated, **workers)
    assert distilled.get_train_dataloader().num_workers == 4
    assert distilled.get_eval_dataloader().num_workers == 0
    assert distilled.args.dataloader_num_workers == 4


@pytest.mark.parametrize("eval_dataset_type", EVAL_DATASET_TYPES)
def test_init_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    eval_dataset = eval_dataset_of(eval_dataset_type)
    distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs={"eval_dataset": eval_dataset})
    check_eval_dataset(distilled, eval_dataset)


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dict_of_dataset"])
def test_evaluate_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    split = zen(split="test")
    eval_dataset = split if eval_dataset_type == "dataset" else {"data1": split, "data2": split}
    distilled = trainer(trainer_class, hub, tmp_path, per_device_eval_batch_size=3)
    metrics = distilled.evaluate(eval_dataset=eval_dataset)
    if eval_dataset_type == "dataset":
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None and metrics["eval_data2_loss"] is not None


@pytest.mark.parametrize(
    "option",
    [
        dict(beta=0.5),
        pytest.param(dict(pad_to_multiple_of=8), marks=representative),
        dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1),
        dict(generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}),
    ],
    ids=["beta_non_zero", "pad_to_multiple_of", "additional_generation_kwargs", "generation_kwargs"],
)
def test_train_with_option(trainer_class, hub, tmp_path, option):
    distilled = trainer(trainer_class, hub, tmp_path, **option)
    distilled.train()
    assert distilled.state.log_history[-1]["train_loss"] is not None


def test_train_with_chat_template_kwargs(trainer_class, hub, tmp_path):
    distilled = trainer(
        trainer_class, hub, tmp_path, dataset=zen("conversational_prompt_only"),
        chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    distilled.train()
    assert distilled.state.log_history[-1]["train_loss"] is not None


def test_train_multiple_dataloader_workers(trainer_class, hub, tmp_path):
    torch.multiprocessing.set_start_method("spawn", force=True)
    distilled = trainer(trainer_class, hub, tmp_path, dataloader_num_workers=2)
    distilled.train()
    assert distilled.state.log_history[-1]["train_loss"] is not None


@representative
def test_train_with_gradient_accumulation(trainer_class, hub, tmp_path):
    train_and_check(trainer(trainer_class, hub, tmp_path, gradient_accumulation_steps=2))


# ---- PEFT --------------------------------------------------------------------------------------------------------
def test_peft_init_is_seeded(trainer_class, hub, tmp_path):
    from peft import LoraConfig

    adapters = []
    for global_seed in range(2):
        torch.manual_seed(global_seed)  # a different global RNG state, as in two separate runs
        distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs={"peft_config": LoraConfig()})
        adapters.append({n: p.clone() for n, p in distilled.model.named_parameters() if "lora_A" in n})
    assert adapters[0]
    for name, param in adapters[0].items():
        assert torch.equal(param, adapters[1][name]), f"Parameter {name} differs between the two trainers."


@pytest.mark.parametrize("how", PEFT_CASES)
def test_train_peft(trainer_class, hub, tmp_path, how):
    model, kwargs, overrides, rules = peft_case(hub["student"], how)
    train_and_check(
        trainer(trainer_class, hub, tmp_path, trainer_kwargs={"model": model, **kwargs}, **overrides), **rules
    )


@pytest.mark.parametrize(
    "peft_config",
    [dict(target_modules=["q_proj", "v_proj"]), dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])],
    ids=["non_lm_head_target", "modules_to_save_lm_head"],
)
def test_peft_setups_the_loss_can_train_are_allowed(trainer_class, hub, tmp_path, peft_config):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    trainer_class(  # must construct without raising
        model=AutoModelForCausalLM.from_pretrained(hub["student"], dtype="float32"),
        teacher_model=hub["teacher"],
        args=args(tmp_path),
        train_dataset=zen(),
        peft_config=LoraConfig(**peft_config),
    )


# ---- errors ------------------------------------------------------------------------------------------------------
@representative
@pytest.mark.parametrize("case", ["lm_head_adapter", "prompt_learning", "vocab_size", "teacher_model_init_kwargs"])
def test_bad_setups_raise(trainer_class, hub, tmp_path, case):
    from peft import LoraConfig, PrefixTuningConfig
    from transformers import AutoModelForCausalLM

    kwargs, teacher, config, match = {}, hub["teacher"], args(tmp_path), ""
    if case == "lm_head_adapter":
        kwargs, match = {"peft_config": LoraConfig(target_modules=["q_proj", "lm_head"])}, "lm_head"
    elif case == "prompt_learning":
        peft_config = PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")
        kwargs, match = {"peft_config": peft_config}, "Prompt-learning"
    elif case == "vocab_size":
        teacher, match = hub["other_vocabulary"], "vocab_size"
    else:
        teacher = AutoModelForCausalLM.from_pretrained(hub["student"])
        config, match = args(tmp_path, teacher_model_init_kwargs={"dtype": "float32"}), "teacher_model_init_kwargs"
    with pytest.raises(ValueError, match=match):
        trainer_class(model=hub["student"], teacher_model=teacher, args=config, train_dataset=zen(), **kwargs)


# ---- the loss ----------------------------------------------------------------------------------------------------
def completion_batch(distilled):
    generator = torch.Generator().manual_seed(0)
    vocab_size = distilled.model.config.vocab_size
    return {
        "prompt_ids": torch.randint(3, vocab_size, (2, 4), generator=generator),
        "prompt_mask": torch.ones(2, 4, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (2, 3), generator=generator),
        "completion_mask": torch.ones(2, 3, dtype=torch.long),
    }


def test_loss_normalizes_by_num_items_in_batch(trainer_class, hub, tmp_path):
    distilled = trainer(trainer_class, hub, tmp_path, beta=0.5)
    batch = completion_batch(distilled)
    num_valid = batch["completion_mask"].sum()
    distilled.model.eval()
    with torch.no_grad():
        loss_mean = distilled.compute_loss(distilled.model, batch)
        loss_global = distilled.compute_loss(distilled.model, batch, num_items_in_batch=num_valid)
        loss_double = distilled.compute_loss(distilled.model, batch, num_items_in_batch=num_valid * 2)
    torch.testing.assert_close(loss_global, loss_mean, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss_double, loss_mean / 2, rtol=1e-4, atol=1e-6)


def test_compute_loss_matches_full_logit_reference(trainer_class, hub, tmp_path):
    """The chunked loss equals the full-logit generalized JSD (beta 0.25: a student/teacher swap would show); with the
    plugin, whose fused LM head a forward without ``fused_lm_head=True`` leaves alone, the models' logits too."""
    import torch.nn.functional as F  # noqa: N812

    distilled = trainer(trainer_class, hub, tmp_path, beta=0.25)
    batch = completion_batch(distilled)
    num_valid = batch["completion_mask"].sum()
    distilled.model.eval()
    with torch.no_grad():
        loss = distilled.compute_loss(distilled.model, batch, num_items_in_batch=num_valid)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        keep = slice(-4, -1)
        student = distilled.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, keep, :]
        teacher = distilled.teacher_model(input_ids=input_ids, attention_mask=attention_mask).logits[:, keep, :]
        student_lp, teacher_lp = torch.log_softmax(student.float(), -1), torch.log_softmax(teacher.float(), -1)
        beta = torch.tensor(0.25)
        mixture = torch.logsumexp(torch.stack([student_lp + torch.log1p(-beta), teacher_lp + torch.log(beta)]), 0)
        jsd = 0.25 * F.kl_div(mixture, teacher_lp, reduction="none", log_target=True) + 0.75 * F.kl_div(
            mixture, student_lp, reduction="none", log_target=True
        )
    torch.testing.assert_close(loss, jsd.sum() / num_valid, rtol=1e-4, atol=1e-6)


def test_pad_token_id_synced_with_model_config(trainer_class, hub, tmp_path):
    """A tokenizer without a pad token: the trainer falls back to eos, and the model configs follow."""
    tokenizer = load_tokenizer(hub["student"])
    tokenizer.pad_token = None
    distilled = trainer(trainer_class, hub, tmp_path, trainer_kwargs={"processing_class": tokenizer})
    pad_token_id = distilled.processing_class.pad_token_id
    assert pad_token_id is not None
    assert distilled.model.config.pad_token_id == pad_token_id
    assert distilled.model.generation_config.pad_token_id == pad_token_id


# ---- vision-language ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, overrides",
    [
        pytest.param("qwen2_vl", {}, marks=representative),
        ("qwen2_5_vl", {}),
        ("llava", {}),
        ("qwen2_vl", dict(gradient_accumulation_steps=2)),
    ],
    ids=["qwen2_vl", "qwen2_5_vl", "llava", "qwen2_vl_gradient_accumulation"],
)
def test_train_vlm(trainer_class, tmp_path, family, overrides):
    """Self-distillation, as TRL's test (no tiny/small VLM pair): the multimodal path runs end to end, the loss is
    finite. The plugin trains image steps with stock's micro-batches (a teacher's image inputs are not repacked)."""
    path, processor = vision_model(family, tmp_path)
    distilled = trainer_class(
        model=path,
        teacher_model=path,
        args=args(tmp_path, per_device_train_batch_size=2, **overrides),
        train_dataset=image_dataset(),
        processing_class=processor,
    )
    distilled.train()
    loss = distilled.state.log_history[-1]["train_loss"]
    assert loss is not None and torch.isfinite(torch.tensor(loss))


@representative
def test_the_swapped_class_logs_its_plan(hub, tmp_path, caplog):
    """The class swapped really is the plugin's (each test above runs it with TRL's own DistillationConfig)."""
    distilled = trainer(DynamicBatchDistillationTrainer, hub, tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        distilled.train()
    assert "hf_dynbsz batch-size plan" in caplog.text
    assert any("dynbsz/microbatches" in entry for entry in distilled.state.log_history)
