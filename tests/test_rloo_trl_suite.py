"""TRL's own RLOOTrainer tests, restated offline, each run with stock ``RLOOTrainer`` and with the class swapped.

TRL's ``tests/test_rloo_trainer.py`` is not installed with the wheel, and every one of its tests loads models and
datasets from the Hub (``trl-internal-testing/tiny-*``, ``trl-internal-testing/zen``), which this machine cannot
reach: none of them runs here as written. The TRL source stored here is older than 1.16 (the newest snapshot of
``huggingface/trl`` is ``main`` at ``f2cd577``, ``VERSION`` 1.10.0.dev0; its ``tests/test_rloo_trainer.py`` differs
from ``v1.9.0``'s by one test and uses the same trainer API as 1.16). This file restates its tests from that file:
the same configurations and the same assertions, with offline stand-ins for what they download:

* the ``zen`` prompts: the lines of ``import this`` (the Zen of Python), halved as prompts, lowercased for the
  character tokenizer; 17 train, 2 test;
* the tiny models: Qwen2 (``hf_dynbsz.testing``, TRL's Qwen3 chat template), Qwen3-MoE, GPT-OSS and Cohere2 built
  tiny from their default configs (``hf_dynbsz.testing.zoo``), Qwen2-VL / Qwen2.5-VL / LLaVA (``testing.vision``);
* the reward model: a tiny ``Qwen2ForSequenceClassification`` built from its config, saved with the tokenizer.

Each test takes ``trainer_class``: stock ``RLOOTrainer`` and ``DynamicBatchRLOOTrainer`` (the class swapped; the config
stays TRL's ``RLOOConfig``, so the plugin runs its defaults). Every test that passes with stock must pass with ours.
Runs are shortened to ``max_steps`` 2 (TRL trains an epoch). Left out: the vLLM tests (TRL skips them too),
``test_trust_remote_code`` (remote code from the Hub), and the default ``args=None`` of ``test_init_minimal`` (stock's
default config asks for bf16, which this CPU machine refuses: it fails for stock here).

By default the ``representative`` tests run; ``python -m pytest -m trl_suite tests/test_rloo_trl_suite.py`` runs all
(see tests/conftest.py).
"""

from __future__ import annotations

import codecs
import logging
import this
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset, DatasetDict
from trl import RLOOConfig, RLOOTrainer

from hf_dynbsz import DynamicBatchRLOOTrainer
from hf_dynbsz.testing import build_chat_tokenizer, build_tiny_reward_model, load_tokenizer, save_tiny_model

pytestmark = pytest.mark.trl_suite
representative = pytest.mark.representative
ZOO_MODELS = ("qwen3_moe", "gpt_oss", "cohere2")
VISION_MODELS = ("qwen2_vl", "qwen2_5_vl", "llava")


@pytest.fixture(params=[RLOOTrainer, DynamicBatchRLOOTrainer], ids=["stock", "dynamic"])
def trainer_class(request):
    return request.param


# ---- offline stand-ins -------------------------------------------------------------------------------------------
def zen(config: str = "standard_prompt_only", split: str = "train") -> Dataset:
    """The Zen of Python's lines, each cut to its first half, as prompts (TRL's ``zen`` dataset is built the same
    way from them); ``conversational_prompt_only``: as user messages."""
    lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]
    prompts = [" ".join(line.split()[: max(1, len(line.split()) // 2)]).lower() for line in lines]
    prompts = prompts[:17] if split == "train" else prompts[17:]
    if config == "conversational_prompt_only":
        prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    return Dataset.from_dict({"prompt": prompts})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Directories standing in for the Hub's tiny models, by the name of the architecture."""
    root = tmp_path_factory.mktemp("hub")
    tokenizer = build_chat_tokenizer()
    paths = {"qwen2": save_tiny_model(str(root / "qwen2"), chat=True), **save_zoo_models(root, tokenizer, ZOO_MODELS)}
    build_tiny_reward_model(tokenizer).save_pretrained(root / "reward")
    tokenizer.save_pretrained(root / "reward")
    paths["reward"] = str(root / "reward")
    return paths


def save_zoo_models(root, tokenizer, model_types) -> dict[str, str]:
    """The tiny models of ``model_types`` (:mod:`hf_dynbsz.testing.zoo`, on ``tokenizer``'s vocabulary), each saved
    with the tokenizer under ``root``, by type."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    paths = {}
    for model_type in model_types:
        model = build_tiny_causal_lm_of_type(
            model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=1
        )
        model.save_pretrained(root / model_type)
        tokenizer.save_pretrained(root / model_type)
        paths[model_type] = str(root / model_type)
    return paths


#: What TRL's tests need on this CPU machine, where their configuration leaves the rest at its defaults.
TRL_CPU_FIELDS = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)


def trl_test_settings(tmp_path, **overrides) -> dict:
    """TRL's test configuration (learning rate 0.1: the gradients are tiny; 3 samples per device), on this CPU machine
    and cut to 2 optimizer steps (the distillation, DPO and asynchronous GRPO suites' too)."""
    settings = dict(output_dir=str(tmp_path / "out"), learning_rate=0.1, per_device_train_batch_size=3, max_steps=2)
    return {**settings, **TRL_CPU_FIELDS, **overrides}


def args(tmp_path, **overrides) -> RLOOConfig:
    """TRL's RLOO test configuration (:func:`trl_test_settings`, 3 completions per prompt of up to 8 tokens)."""
    return RLOOConfig(**trl_test_settings(tmp_path, **{"num_generations": 3, "max_completion_length": 8, **overrides}))


def train_and_check(trainer, unchanged=lambda name: False, unchecked=lambda name: False):
    """TRL's checks after training: a train loss, and every parameter moved, except the ``unchanged`` ones, which
    must not, and the ``unchecked`` ones."""
    previous = {name: param.clone() for name, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, param in previous.items():
        new = trainer.model.get_parameter(name)
        if unchanged(name):
            torch.testing.assert_close(param, new, msg=f"Parameter {name} has changed.")
        elif not unchecked(name):
            assert not torch.equal(param, new), f"Parameter {name} has not changed."
    return trainer


def length_reward(completions, **kwargs):
    """Reward function that rewards longer completions (TRL's)."""
    return [
        float(len(completion if isinstance(completion, str) else completion[0]["content"]))
        for completion in completions
    ]


# ---- training ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [pytest.param("qwen2", marks=representative), "qwen3_moe", "gpt_oss", "cohere2"])
def test_train(trainer_class, hub, tmp_path, model):
    trainer = trainer_class(model=hub[model], reward_funcs=hub["reward"], args=args(tmp_path), train_dataset=zen())
    train_and_check(trainer)
    if trainer.aux_loss_enabled:  # MoE models log the load-balancing auxiliary loss
        assert trainer.state.log_history[-1]["aux_loss"] is not None


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_train_dataset_format(trainer_class, hub, tmp_path, config_name):
    trainer = trainer_class(
        model=hub["qwen2"], reward_funcs=hub["reward"], args=args(tmp_path), train_dataset=zen(config_name)
    )
    train_and_check(trainer)


@pytest.mark.parametrize("num_generations_eval", [pytest.param(None, marks=representative), 1])
def test_train_with_eval(trainer_class, hub, tmp_path, num_generations_eval):
    config = args(
        tmp_path,
        per_device_eval_batch_size=3,
        eval_strategy="steps",
        eval_steps=2,
        num_generations_eval=num_generations_eval,
    )
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        args=config,
        train_dataset=zen(),
        eval_dataset=zen(split="test"),
    )
    trainer.train()
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


def test_train_with_iterable_dataset(trainer_class, hub, tmp_path):
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        args=args(tmp_path),
        train_dataset=zen().to_iterable_dataset(),
    )
    assert trainer.args.accelerator_config.dispatch_batches is False  # the stream is sharded per process
    train_and_check(trainer)


def test_train_dataset_required(trainer_class, hub, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        trainer_class(model=hub["qwen2"], reward_funcs=hub["reward"], args=args(tmp_path))


EVAL_DATASET_TYPES = ["dataset", "iterable_dataset", "dataset_dict", "dict_of_dataset", "none"]


def eval_dataset_of(eval_dataset_type: str):
    """TRL's ``test_init_with_eval_dataset`` cases: the zen test split as each kind of eval dataset."""
    split = zen(split="test")
    return {
        "dataset": split,
        "iterable_dataset": split.to_iterable_dataset(),
        "dataset_dict": DatasetDict({"data1": split, "data2": split}),
        "dict_of_dataset": {"data1": split, "data2": split},
        "none": None,
    }[eval_dataset_type]


def check_eval_dataset(trainer, eval_dataset) -> None:
    """TRL's check: the trainer holds the eval dataset it was given (a dict by its keys)."""
    if eval_dataset is None:
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset


@pytest.mark.parametrize("eval_dataset_type", EVAL_DATASET_TYPES)
def test_init_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    eval_dataset = eval_dataset_of(eval_dataset_type)
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        args=args(tmp_path),
        train_dataset=zen(),
        eval_dataset=eval_dataset,
    )
    check_eval_dataset(trainer, eval_dataset)


def test_iterable_dataset_requires_dispatch_batches_false_and_one_worker(trainer_class, hub, tmp_path):
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        trainer_class(
            model=hub["qwen2"],
            reward_funcs=hub["reward"],
            train_dataset=zen().to_iterable_dataset(),
            args=args(tmp_path, accelerator_config={"dispatch_batches": True}),
        )
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        train_dataset=zen().to_iterable_dataset(),
        args=args(tmp_path, dataloader_num_workers=4, max_steps=1),
    )
    assert trainer.args.dataloader_num_workers == 0


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dict_of_dataset"])
def test_evaluate_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    split = zen(split="test")
    eval_dataset = split if eval_dataset_type == "dataset" else {"data1": split, "data2": split}
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        args=args(tmp_path, per_device_eval_batch_size=3),
        train_dataset=zen(),
    )
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    if eval_dataset_type == "dataset":
        assert metrics["eval_loss"] is not None
    else:
        assert metrics["eval_data1_loss"] is not None and metrics["eval_data2_loss"] is not None


def test_train_multiple_iterations(trainer_class, hub, tmp_path):
    trainer = trainer_class(
        model=hub["qwen2"], reward_funcs=hub["reward"], args=args(tmp_path, num_iterations=2), train_dataset=zen()
    )
    train_and_check(trainer)


# ---- PEFT --------------------------------------------------------------------------------------------------------
def peft_rules(base_param_names) -> dict:
    """TRL's rule: the base model's parameters stay, the adapters' move; the base layers and a frozen 'ref' copy of
    the adapter are not checked."""
    return {
        "unchanged": lambda name: name in base_param_names,
        "unchecked": lambda name: "base_layer" in name or ".ref." in name,
    }


#: TRL's PEFT test cases (:func:`peft_case`).
PEFT_CASES = [
    pytest.param("peft_config", marks=representative),
    "peft_model",
    "peft_config_with_gradient_checkpointing",
]


def peft_case(path: str, how: str) -> tuple:
    """TRL's PEFT test cases on the model at ``path`` (fp32): ``peft_config`` (a LoRA config to the trainer),
    ``peft_model`` (the model wrapped in a LoRA adapter) and ``peft_config_with_gradient_checkpointing``. Returns the
    model, the trainer's extra arguments, the config's overrides and the :func:`peft_rules` of the base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    base_param_names = {f"base_model.model.{name}" for name, _ in model.named_parameters()}
    kwargs = {"peft_config": LoraConfig()} if how != "peft_model" else {}
    if how == "peft_model":
        model = get_peft_model(model, LoraConfig())
    overrides = {"gradient_checkpointing": True} if "checkpointing" in how else {}
    return model, kwargs, overrides, peft_rules(base_param_names)


@pytest.mark.parametrize("how", PEFT_CASES)
def test_train_peft(trainer_class, hub, tmp_path, how):
    model, kwargs, overrides, rules = peft_case(hub["qwen2"], how)
    config = args(tmp_path, **overrides)
    trainer = trainer_class(model=model, reward_funcs=hub["reward"], args=config, train_dataset=zen(), **kwargs)
    train_and_check(trainer, **rules)


def test_train_moe_peft_model(trainer_class, hub, tmp_path):
    """An adapter on GPT-OSS's expert parameters (``target_parameters``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub["gpt_oss"], dtype="float32")
    base_param_names = {f"base_model.model.{name}" for name, _ in model.named_parameters()}
    model = get_peft_model(model, LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]))
    trainer = trainer_class(model=model, reward_funcs=hub["reward"], args=args(tmp_path), train_dataset=zen())
    train_and_check(trainer, **peft_rules(base_param_names))


# ---- rewards -----------------------------------------------------------------------------------------------------
def test_train_different_reward_model(trainer_class, hub, tmp_path):
    from transformers import AutoModelForSequenceClassification

    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=AutoModelForSequenceClassification.from_pretrained(hub["reward"]),
        reward_processing_classes=load_tokenizer(hub["reward"]),
        args=args(tmp_path),
        train_dataset=zen("conversational_prompt_only"),
    )
    train_and_check(trainer)


def unique_letters(completions, **kwargs):
    """Reward function that rewards completions with more unique letters (TRL's)."""
    return [float(len(set(completion))) for completion in completions]


async def async_unique_letters(completions, **kwargs):
    return unique_letters(completions)


def none_reward(completions, **kwargs):
    """A reward function that is not applicable to any sample (TRL's)."""
    return [None] * len(completions)


REWARD_SETUPS = {
    "standard": (dict(reward_funcs=length_reward), {}),
    "conversational": (dict(reward_funcs=length_reward, train_dataset=zen("conversational_prompt_only")), {}),
    "multiple": (dict(reward_funcs=[length_reward, unique_letters]), {}),
    "sync_and_async": (
        dict(reward_funcs=[length_reward, lambda completions, **kw: [1] * len(completions), async_unique_letters]),
        {},
    ),
    "with_none_output": (dict(reward_funcs=[length_reward, none_reward]), {}),
    "with_weights": (dict(reward_funcs=[length_reward, unique_letters]), dict(reward_weights=[0.7, 0.3])),
    "mixed_model_and_function": (dict(reward_funcs=[length_reward, "reward"]), {}),
}


@pytest.mark.parametrize("setup", list(REWARD_SETUPS))
def test_train_reward_funcs(trainer_class, hub, tmp_path, setup):
    kwargs, config = REWARD_SETUPS[setup]
    kwargs = {"train_dataset": zen(), **kwargs}
    if isinstance(kwargs["reward_funcs"], list):
        kwargs["reward_funcs"] = [hub[f] if isinstance(f, str) else f for f in kwargs["reward_funcs"]]
    trainer = train_and_check(trainer_class(model=hub["qwen2"], args=args(tmp_path, **config), **kwargs))
    if setup == "with_weights":
        for name in ("rewards/length_reward/mean", "rewards/length_reward/std", "rewards/unique_letters/mean"):
            assert name in trainer.state.log_history[-1]  # the last log: the metrics since the one before


def test_reward_metric_reflects_reward_weights(trainer_class, hub, tmp_path):
    trainer = trainer_class(
        model=hub["qwen2"],
        args=args(tmp_path, reward_weights=[0.7, 0.3]),
        train_dataset=zen(),
        reward_funcs=[
            lambda completions, **kw: [1.0] * len(completions),
            lambda completions, **kw: [0.0] * len(completions),
        ],
    )
    trainer.train()
    assert abs(trainer.state.log_history[-1]["reward"] - 0.7) < 1e-5


def test_train_reward_func_additional_column(trainer_class, hub, tmp_path):
    dataset = zen()
    dataset = dataset.add_column("some_values", list(range(len(dataset))))

    def reward_func(completions, some_values, **kwargs):
        return [float(abs(len(completion) - value)) for completion, value in zip(completions, some_values)]

    train_and_check(
        trainer_class(model=hub["qwen2"], reward_funcs=reward_func, args=args(tmp_path), train_dataset=dataset)
    )


def test_warning_raised_all_rewards_none(trainer_class, hub, tmp_path, caplog):
    trainer = trainer_class(model=hub["qwen2"], reward_funcs=none_reward, args=args(tmp_path), train_dataset=zen())
    with caplog.at_level("WARNING", logger="trl.trainer.rloo_trainer"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


@pytest.mark.parametrize("check", ["trainer_state", "log_extra", "log_metric"])
def test_reward_func_hooks(trainer_class, hub, tmp_path, check):
    def reward_func(completions, **kwargs):
        if check == "trainer_state":
            assert hasattr(kwargs["trainer_state"], "global_step")
        elif check == "log_extra":
            kwargs["log_extra"]("test_column", [completion[:5] for completion in completions])
        else:
            kwargs["log_metric"]("custom_accuracy", 0.75)
        return [float(len(completion)) for completion in completions]

    config = args(tmp_path, log_completions=check == "log_extra")
    trainer = trainer_class(model=hub["qwen2"], reward_funcs=reward_func, args=config, train_dataset=zen())
    trainer.train()
    if check == "log_extra":
        assert "test_column" in trainer._logs["extra"]
    if check == "log_metric":
        assert "custom_accuracy" in {key for entry in trainer.state.log_history for key in entry}


@pytest.mark.parametrize("classes", ["mismatched", "correct_list", "single"])
def test_reward_processing_classes(trainer_class, hub, tmp_path, classes):
    tokenizer = load_tokenizer(hub["reward"])
    if classes == "mismatched":
        with pytest.raises(ValueError, match="must match"):
            trainer_class(
                model=hub["qwen2"],
                reward_funcs=[hub["reward"], hub["reward"]],
                reward_processing_classes=tokenizer,
                args=args(tmp_path),
                train_dataset=zen(),
            )
        return
    reward_funcs = [hub["reward"], hub["reward"]] if classes == "correct_list" else hub["reward"]
    processing = [tokenizer, load_tokenizer(hub["reward"])] if classes == "correct_list" else tokenizer
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=reward_funcs,
        reward_processing_classes=processing,
        args=args(tmp_path),
        train_dataset=zen(),
    )
    assert len(trainer.reward_processing_classes) == (2 if classes == "correct_list" else 1)
    if classes == "single":
        assert trainer.reward_processing_classes[0] is tokenizer


# ---- RLOO's options ----------------------------------------------------------------------------------------------
OPTIONS = {
    "sync_ref_model": dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, max_steps=3),
    "beta_zero": dict(beta=0.0),
    "pad_to_multiple_of": dict(pad_to_multiple_of=8),
    "additional_generation_kwargs": dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1),
    "normalized_advantages": dict(normalize_advantages=True),
    "clipped_rewards": dict(reward_clip_range=(-1, 1)),
    "num_generations_larger_than_batch_size": dict(num_generations=6, gradient_accumulation_steps=2),
    "generation_kwargs": dict(
        generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}
    ),
    "chat_template_kwargs": dict(chat_template_kwargs={"enable_thinking": False}),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_train_with_option(trainer_class, hub, tmp_path, option):
    dataset = zen("conversational_prompt_only" if option == "chat_template_kwargs" else "standard_prompt_only")
    trainer = trainer_class(
        model=hub["qwen2"], reward_funcs=hub["reward"], args=args(tmp_path, **OPTIONS[option]), train_dataset=dataset
    )
    if option != "sync_ref_model":
        train_and_check(trainer)
        return
    previous_ref = {name: param.clone() for name, param in trainer.ref_model.named_parameters()}
    train_and_check(trainer)
    for name, param in previous_ref.items():
        assert not torch.equal(param, trainer.ref_model.get_parameter(name)), f"Ref parameter {name} has not changed."


def test_train_with_mask_truncated_completions(trainer_class, hub, tmp_path):
    """Generation patched as TRL's test does: one completion truncated, one with EOS inside, one with EOS last."""
    eos = load_tokenizer(hub["qwen2"]).eos_token_id

    def fake_generate(input_ids, **kwargs):
        completions = torch.tensor(
            [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, eos, 0, 0, 0, 0], [14, 15, 16, 17, 18, 19, 20, eos]],
            device=input_ids.device,
        )
        return torch.cat([input_ids, completions.repeat(input_ids.size(0) // 3, 1)], dim=1)

    with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate):
        trainer = trainer_class(
            model=hub["qwen2"],
            reward_funcs=hub["reward"],
            args=args(tmp_path, mask_truncated_completions=True),
            train_dataset=zen(),
        )
        trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None


def test_train_with_mask_truncated_completions_all_masked(trainer_class, hub, tmp_path):
    """Every completion truncated (EOS suppressed; TRL's test relies on its model rarely generating one): no learning
    signal, no parameter moves."""
    eos = load_tokenizer(hub["qwen2"]).eos_token_id
    config = args(tmp_path, mask_truncated_completions=True, generation_kwargs={"suppress_tokens": [eos]})
    trainer = trainer_class(model=hub["qwen2"], reward_funcs=hub["reward"], args=config, train_dataset=zen())
    train_and_check(trainer, unchanged=lambda name: True)


def test_train_multiple_dataloader_workers(trainer_class, hub, tmp_path):
    torch.multiprocessing.set_start_method("spawn", force=True)
    trainer = trainer_class(
        model=hub["qwen2"],
        reward_funcs=hub["reward"],
        args=args(tmp_path, dataloader_num_workers=2),
        train_dataset=zen(),
    )
    train_and_check(trainer)


def test_prepare_input_called_with_correct_data(trainer_class, hub, tmp_path):
    """Each generation round's prompts reach ``training_step`` steps_per_generation x num_iterations times, in order."""
    config = args(
        tmp_path,
        per_device_train_batch_size=6,
        gradient_accumulation_steps=3,
        steps_per_generation=4,
        num_generations=4,
        num_iterations=2,
        shuffle_dataset=False,
        max_steps=5,
    )
    dataset = zen()
    trainer = trainer_class(model=hub["qwen2"], reward_funcs=hub["reward"], args=config, train_dataset=dataset)
    prompts = dataset["prompt"]
    first = [{"prompt": prompt} for prompt in prompts[:6] for _ in range(4)]
    second = [{"prompt": prompt} for prompt in prompts[6:12] for _ in range(4)]
    with patch.object(trainer_class, "training_step", wraps=trainer.training_step) as mock_prepare:
        trainer.train()
    assert mock_prepare.call_count == 15  # 5 optimizer steps of 3 accumulation steps
    for i in range(8):  # the generation batch, steps_per_generation x num_iterations times
        assert mock_prepare.call_args_list[i].args[1] == first
    for i in range(8, 15):
        assert mock_prepare.call_args_list[i].args[1] == second


# ---- vision-language ---------------------------------------------------------------------------------------------
def vision_model(family: str, tmp_path):
    """A tiny vision-language model saved with its processor (TRL loads the reference model from the path)."""
    from hf_dynbsz.testing import build_tiny_vision_language_model

    model, processor = build_tiny_vision_language_model(family)
    model.save_pretrained(tmp_path / family)
    return str(tmp_path / family), processor


def image_dataset():
    from hf_dynbsz.testing import image_prompt_dataset

    return image_prompt_dataset([1, 2, 1, 1, 2, 1, 1, 1])


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen2_vl", {}),
        ("qwen2_5_vl", {}),
        ("llava", {}),
        ("qwen2_vl", dict(pad_to_multiple_of=7)),
        ("qwen2_5_vl", dict(beta=0.1)),
    ],
)
def test_train_vlm(trainer_class, tmp_path, family, overrides):
    path, processor = vision_model(family, tmp_path)
    config = args(tmp_path, per_device_train_batch_size=2, num_generations=2, max_completion_length=8, **overrides)
    trainer = trainer_class(
        model=path, reward_funcs=length_reward, args=config, train_dataset=image_dataset(), processing_class=processor
    )
    # LLaVA's vision tower feeds the projector from its last layer's input: the last layer's output side stays
    train_and_check(trainer, lambda name: family == "llava" and "post_layernorm" in name)


def test_train_vlm_peft(trainer_class, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText

    path, processor = vision_model("qwen2_5_vl", tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype="float32")
    base_param_names = {f"base_model.model.{name}" for name, _ in model.named_parameters()}
    trainer = trainer_class(
        model=model,
        reward_funcs=length_reward,
        train_dataset=image_dataset(),
        processing_class=processor,
        args=args(tmp_path, per_device_train_batch_size=2, num_generations=2),
        peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]),
    )
    train_and_check(trainer, **peft_rules(base_param_names))


def test_the_swapped_class_logs_its_plan(hub, tmp_path, caplog):
    """The class swapped really is the plugin's (each test above runs it with TRL's own RLOOConfig)."""
    trainer = DynamicBatchRLOOTrainer(
        model=hub["qwen2"], reward_funcs=hub["reward"], args=args(tmp_path, max_steps=1), train_dataset=zen()
    )
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        trainer.train()
    assert "hf_dynbsz batch-size plan" in caplog.text
    assert any("dynbsz/microbatches" in entry for entry in trainer.state.log_history)
