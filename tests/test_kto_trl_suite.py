"""TRL's own KTOTrainer tests, restated offline, each run with stock ``KTOTrainer`` and with the class swapped.

TRL's ``tests/test_kto_trainer.py`` is not installed with the wheel, and its tests load models and datasets from the
Hub (``trl-internal-testing/tiny-*``, ``trl-internal-testing/zen``, ``zen-image``, ``zen-multi-image``,
``toolcall``, ``harmony``), which this machine cannot reach. The TRL source stored here (``huggingface/trl`` at
``f2cd577``, whose ``KTOTrainer`` is 1.16's: datasets tokenized into ``prompt_ids`` / ``completion_ids`` /
``KL_completion_ids``, ``DataCollatorForUnpairedPreference``, paired data unpaired at preparation, the fused LM head)
holds 50 test functions (85 tests with their parameters). This file restates the 61 that can run on this CPU machine,
each run with both classes: the same configurations and the same assertions (TRL's ``setup_method`` objects too: the
model in fp32, the reference, the tokenizer with its EOS as pad token), with offline stand-ins for what they download:

* the ``zen`` datasets: ``tests/test_dpo_trl_suite.py``'s (the Zen of Python's lines cut in half; 17 train rows, 2
  test), paired, and unpaired (``standard_unpaired_preference``, ``conversational_unpaired_preference``: TRL's
  ``unpair_preference_dataset`` of the pairs, one labelled completion a pair, the labels mixed as on the Hub);
* the tiny models: Qwen2 (``hf_dynbsz.testing``, TRL's Qwen3 chat template) and GPT-OSS built tiny from its default
  config (``hf_dynbsz.testing.zoo``); Qwen2-VL, Qwen2.5-VL and LLaVA (``hf_dynbsz.testing.vision``) for the
  vision-language tests, their ``zen-image`` samples the DPO suite's image pairs unpaired;
* the ``toolcall`` preference dataset: the reward suite's stand-in (tool calls against plain answers, ``tools`` a
  JSON string); ``test_train_gpt_oss``'s ``harmony`` data: the unpaired zen samples (GPT-OSS's template is the
  stand-in tokenizer's, so the harmony format itself is not exercised; the test's point kept: GPT-OSS trains and logs
  its load-balancing auxiliary loss).

Each test takes ``trainer_class``: stock ``KTOTrainer`` and ``DynamicBatchKTOTrainer`` (the class swapped; the config
stays TRL's ``KTOConfig``, so the plugin runs its defaults: the automatic budget, the prefix tree). Every test that
passes with stock must pass with ours, and ours must have repacked its steps, except on vision-language samples,
which train stock's micro-batches with one logged reason (``hf_dynbsz/trainers/kto.py``; the tests assert that
fallback). Runs use the DPO suite's configuration (learning rate 0.1, 3 samples per device) with each TRL test's own
settings on top, cut to ``max_steps`` 2 where TRL trains epochs (TRL's ``max_steps=3`` is kept). Left out: the
``DataCollatorForUnpairedPreference`` and ``DataCollatorForVisionUnpairedPreference`` tests (stock's collators, which
the class swap does not touch; the vision ones load Qwen2.5-VL's processor from the Hub), the Liger tests (no
liger-kernel here), ``test_trust_remote_code`` (remote code from the Hub), ``test_peft_with_quantization``
(bitsandbytes, a GPU), ``test_train_vlm_with_max_length`` (its ``max_length=37`` is tied to the Hub model's image
token count), the VLM models without a stand-in here (Gemma 3 and 4, LLaVA-Next, Qwen3-VL, Qwen3.5, Qwen3.5-MoE),
``test_train_vlm_multi_image`` (``test_train_vlm``'s samples hold one or two images) and ``test_train_vlm_gemma_3n`` (a
gated model, a slow GPU test): 24 tests. ``test_tokenize_and_process_tokens`` leaves out its
``multiprocess.set_start_method("spawn", force=True)`` (for a ``num_proc=2`` its body never passes; setting it would
change the start method for every later test of the session). The default ``args=None`` of ``test_tag_added`` and
``test_tag_added_peft`` becomes TRL's test configuration (stock's default config asks for bf16, which this CPU
machine refuses).

By default the ``representative`` tests run; ``python -m pytest -m trl_suite tests/test_kto_trl_suite.py`` runs all
(see tests/conftest.py).
"""

from __future__ import annotations

import pytest
import test_dpo_trl_suite as dpo_suite
import test_reward_trl_suite as reward_suite
import test_rloo_trl_suite as rloo_suite
import torch
from datasets import Dataset
from test_rloo_trl_suite import peft_rules
from trl import KTOConfig, KTOTrainer, unpair_preference_dataset

from hf_dynbsz import DynamicBatchKTOTrainer
from hf_dynbsz.testing import load_tokenizer

pytestmark = pytest.mark.trl_suite
representative = pytest.mark.representative

#: The dataset nearly every TRL KTO test trains on.
UNPAIRED = "standard_unpaired_preference"


trainer_class = dpo_suite.trainer_class_fixture(KTOTrainer, DynamicBatchKTOTrainer)


# ---- offline stand-ins -------------------------------------------------------------------------------------------
def zen(config: str = UNPAIRED, split: str = "train") -> Dataset:
    return dpo_suite.zen(config, split)


hub = dpo_suite.hub_fixture(("gpt_oss",))


def causal_lm(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **{"dtype": "float32", **kwargs})


def setup_tokenizer(hub):
    """TRL's ``setup_method`` tokenizer: its EOS token as the pad token (the stand-in's ``<pad>`` is another)."""
    tokenizer = load_tokenizer(hub["qwen2"])
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def setup_trainer(trainer_class, hub, config, *, ref_model: bool = True, **kwargs):
    """A trainer on TRL's ``setup_method`` objects: the model loaded in fp32, the reference (``ref_model`` False:
    none) in its saved dtype, :func:`setup_tokenizer`; ``kwargs``: the datasets and the rest."""
    reference = causal_lm(hub["qwen2"], dtype="auto") if ref_model else None
    model = causal_lm(hub["qwen2"])
    return trainer_class(model=model, ref_model=reference, args=config, processing_class=setup_tokenizer(hub), **kwargs)


#: The settings of TRL's short runs (``test_train``, ``test_tokenize_and_process_tokens``,
#: ``test_train_without_providing_ref_model``): 2 samples a micro-batch, 3 steps, learning rate 0.9, beta 0.1, an
#: evaluation every ``logging_steps`` (10: never in 3 steps).
SHORT_RUN = dict(
    per_device_train_batch_size=2,
    max_steps=3,
    gradient_accumulation_steps=1,
    learning_rate=9e-1,
    eval_strategy="steps",
    beta=0.1,
)


def args(tmp_path, **overrides) -> KTOConfig:
    """TRL's test configuration on this CPU machine, cut to 2 optimizer steps (``tests/test_rloo_trl_suite.py``'s)."""
    return KTOConfig(**rloo_suite.trl_test_settings(tmp_path, **overrides))


def check_dynamic_batching(trainer, *, repacks: bool = True) -> None:
    """For the class swapped, after training: that it repacked its steps (its figures logged, or waiting for a log
    TRL's config skips), or (``repacks`` False: vision-language samples, the documented fallback) that it trained
    stock's micro-batches."""
    if isinstance(trainer, DynamicBatchKTOTrainer):
        assert trainer._dynbsz.enabled == repacks
        figures = any("dynbsz/microbatches" in entry for entry in trainer.state.log_history)
        assert (figures or bool(trainer._metrics["train"].get("dynbsz/microbatches"))) == repacks


def train_and_check(trainer, unchanged=lambda name: False, unchecked=lambda name: False):
    """TRL's checks after training (``tests/test_rloo_trl_suite.py``'s), and :func:`check_dynamic_batching`."""
    rloo_suite.train_and_check(trainer, unchanged, unchecked)
    check_dynamic_batching(trainer)
    return trainer


def zero_sum(trainer):
    """TRL's ``if param.sum() != 0: # ignore 0 biases``: the parameters it leaves unchecked."""
    names = {name for name, param in trainer.model.named_parameters() if param.sum() == 0}
    return lambda name: name in names


# ---- training ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_name,loss_type,pre_compute",
    [
        ("standard_preference", "kto", True),
        pytest.param(UNPAIRED, "kto", False, marks=representative),
        ("conversational_implicit_prompt_preference", "apo_zero_unpaired", True),
        (UNPAIRED, "apo_zero_unpaired", False),
    ],
)
def test_train(trainer_class, hub, tmp_path, config_name, loss_type, pre_compute):
    """TRL's ``test_train`` (its ``eval_dataset`` True in every case)."""
    config = args(tmp_path, **SHORT_RUN, precompute_ref_log_probs=pre_compute, loss_type=loss_type)
    trainer = setup_trainer(
        trainer_class, hub, config, train_dataset=zen(config_name), eval_dataset=zen(config_name, split="test")
    )
    train_and_check(trainer, unchecked=zero_sum(trainer))


def test_fully_truncated_completion_examples_dropped(trainer_class, hub, tmp_path):
    dataset = Dataset.from_dict(
        {
            "prompt": ["hi", "this is a very long prompt that fills up the whole max_length budget on its own"],
            "completion": [" there", " yes"],
            "label": [True, False],
        }
    )
    trainer = trainer_class(model=hub["qwen2"], args=args(tmp_path, max_length=6), train_dataset=dataset)
    assert len(trainer.train_dataset) == 1
    assert trainer.train_dataset[0]["prompt_ids"] == trainer.processing_class("hi")["input_ids"]


def test_train_gpt_oss(trainer_class, hub, tmp_path):
    """TRL's ``test_train_gpt_oss`` on the unpaired zen samples (see the module)."""
    trainer = trainer_class(model=hub["gpt_oss"], args=args(tmp_path), train_dataset=zen())
    train_and_check(trainer)
    assert trainer.aux_loss_enabled  # MoE models log the load-balancing auxiliary loss (on by default)
    assert trainer.state.log_history[-1]["aux_loss"] is not None


def test_train_with_ref_model_is_model_raises(trainer_class, hub, tmp_path):
    model = causal_lm(hub["qwen2"])
    config = args(tmp_path, per_device_train_batch_size=2, max_steps=3)
    with pytest.raises(ValueError):
        trainer_class(
            model=model,
            ref_model=model,  # ref_model can't be the same as model
            args=config,
            processing_class=setup_tokenizer(hub),
            train_dataset=zen(),
        )


def test_tokenize_and_process_tokens(trainer_class, hub, tmp_path):
    train_dataset = zen()
    config = args(tmp_path, **SHORT_RUN)
    trainer = setup_trainer(trainer_class, hub, config, train_dataset=train_dataset, eval_dataset=zen(split="test"))
    tokenizer = trainer.processing_class
    # the dataset stores raw token ids: prompt_ids start with the tokenized prompt, completion_ids are not empty
    prompt_ids = tokenizer(train_dataset["prompt"][0])["input_ids"]
    assert trainer.train_dataset[0]["prompt_ids"][: len(prompt_ids)] == prompt_ids
    assert len(trainer.train_dataset[0]["completion_ids"]) > 0
    # the collator's output: ends with EOS; the completion mask 0 over the prompt, then 1
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"][0, -1].item() == tokenizer.eos_token_id
    assert "completion_mask" in batch
    completion_mask = batch["completion_mask"][0].tolist()
    assert 0 in completion_mask and 1 in completion_mask
    first_completion = next(i for i, m in enumerate(completion_mask) if m == 1)
    assert first_completion > 0
    assert all(m == 0 for m in completion_mask[:first_completion])


@pytest.mark.parametrize("lora", [pytest.param(False, marks=representative), True])
def test_train_without_providing_ref_model(trainer_class, hub, tmp_path, lora):
    """TRL's ``test_train_without_providing_ref_model`` and ``..._with_lora``: 4 micro-batches of 2 a step, 3 steps
    over 17 samples (the third step the data's last sample alone: a short step at the end of the data)."""
    from peft import LoraConfig

    config = args(tmp_path, **{**SHORT_RUN, "gradient_accumulation_steps": 4})
    kwargs = {}
    if lora:
        kwargs["peft_config"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
    trainer = setup_trainer(
        trainer_class, hub, config, ref_model=False, train_dataset=zen(), eval_dataset=zen(split="test"), **kwargs
    )
    ignored = zero_sum(trainer)
    unchecked = (lambda name: "lora" not in name or ignored(name)) if lora else ignored
    train_and_check(trainer, unchecked=unchecked)


def test_compute_metrics(trainer_class, hub, tmp_path):
    config = args(
        tmp_path,
        per_device_train_batch_size=2,
        do_eval=True,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
    )
    trainer = setup_trainer(
        trainer_class,
        hub,
        config,
        train_dataset=zen(),
        eval_dataset=zen(split="test"),
        compute_metrics=lambda *_args, **_kwargs: {"test": 0.0},
    )
    trainer.train()
    assert trainer.state.log_history[-2]["eval_test"] == 0.0


def test_train_with_explicit_ref_model(trainer_class, hub, tmp_path):
    ref_model = causal_lm(hub["qwen2"])
    trainer = trainer_class(model=hub["qwen2"], ref_model=ref_model, args=args(tmp_path), train_dataset=zen())
    dpo_suite.train_keeping_reference(trainer, train_and_check)


def test_train_with_sync_ref_model(trainer_class, hub, tmp_path):
    config = args(tmp_path, sync_ref_model=True, ref_model_sync_steps=2)
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen())
    dpo_suite.train_syncing_reference(trainer, train_and_check)


# ---- PEFT --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "how", [pytest.param("peft_model", marks=representative), "peft_config_with_gradient_checkpointing"]
)
def test_train_peft(trainer_class, hub, tmp_path, how):
    """TRL's ``test_train_peft_model`` (its adapter copied as a frozen ``ref`` adapter, the reference; learning rate
    1.0) and ``test_train_with_peft_config_and_gradient_checkpointing``."""
    from peft import LoraConfig, get_peft_model

    model = causal_lm(hub["qwen2"])
    base_param_names = {f"base_model.model.{name}" for name, _ in model.named_parameters()}
    if how == "peft_model":
        config = args(tmp_path, learning_rate=1.0)
        trainer = trainer_class(model=get_peft_model(model, LoraConfig()), args=config, train_dataset=zen())
    else:
        config = args(tmp_path, gradient_checkpointing=True)
        trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen(), peft_config=LoraConfig())
    train_and_check(trainer, **peft_rules(base_param_names))


# ---- datasets: iterable, chat-template arguments, tool calls ------------------------------------------------------
@pytest.mark.parametrize("iterable_as", ["train", "eval", "eval_dict", "eval_iterable_dataset_dict"])
def test_precompute_ref_log_probs_raises_for_iterable_dataset(trainer_class, hub, tmp_path, iterable_as):
    """``apo_zero_unpaired``: no KL term, whose constraints would fail first."""
    train_dataset, eval_dataset = dpo_suite.iterable_case(iterable_as, zen())
    config = args(tmp_path, loss_type="apo_zero_unpaired", max_steps=1, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        trainer_class(model=hub["qwen2"], args=config, train_dataset=train_dataset, eval_dataset=eval_dataset)


@pytest.mark.parametrize("loss_type", [pytest.param("kto", marks=representative), "apo_zero_unpaired"])
def test_train_with_iterable_dataset(trainer_class, hub, tmp_path, loss_type):
    config = args(tmp_path, loss_type=loss_type, per_device_train_batch_size=2, max_steps=3)
    train_and_check(trainer_class(model=hub["qwen2"], args=config, train_dataset=zen().to_iterable_dataset()))


def test_train_with_chat_template_kwargs(trainer_class, hub, tmp_path):
    """Each row's chat template arguments (``chat_template_kwargs``) reach its tokenization: the prepared prompts open
    with both system headers (the template's uppercase letters are unknown tokens to the stand-in tokenizer, so the
    token ids are compared, not decoded text)."""
    tokenizer = load_tokenizer(hub["qwen2"])
    tokenizer.chat_template = reward_suite.ROLE_CAPITAL_TEMPLATE
    dataset = zen("conversational_preference")
    dataset = dataset.add_column("chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))])
    assert "chat_template_kwargs" in dataset.features
    trainer = trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=dataset, processing_class=tokenizer)
    assert trainer.processing_class.chat_template == tokenizer.chat_template
    prompts = trainer.train_dataset["prompt_ids"]
    for role in ("SYSTEM", "system"):
        opening = trainer.processing_class(f"<|im_start|>{role}\n")["input_ids"]
        assert any(prompt[: len(opening)] == opening for prompt in prompts), role
    train_and_check(trainer)


def test_train_toolcall_data(trainer_class, hub, tmp_path):
    config = args(tmp_path, per_device_train_batch_size=2, max_length=512)  # TRL's, against out-of-memory
    train_and_check(trainer_class(model=hub["qwen2"], args=config, train_dataset=reward_suite.toolcall_preference()))


# ---- evaluation --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precompute_ref_log_probs", [False, True])
@pytest.mark.parametrize(
    "eval_dataset_type", [pytest.param("dataset", marks=representative), *dpo_suite.EVAL_DATASET_TYPES[1:]]
)
def test_evaluate_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type, precompute_ref_log_probs):
    """A raw eval dataset passed to ``evaluate`` directly (TRL's issue 6115); ``apo_zero_unpaired``: no KL term."""
    config = args(tmp_path, loss_type="apo_zero_unpaired", precompute_ref_log_probs=precompute_ref_log_probs)
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen())
    eval_dataset = dpo_suite.eval_split(eval_dataset_type, UNPAIRED)
    dpo_suite.evaluate_and_check(trainer, eval_dataset_type, eval_dataset, precompute_ref_log_probs)


def test_evaluate_precompute_ref_log_probs_after_training_raises(trainer_class, hub, tmp_path):
    config = args(tmp_path, max_steps=1, precompute_ref_log_probs=True)
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen())
    dpo_suite.check_evaluate_after_training_raises(trainer, zen(split="test"))


@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dataset_dict", "dict_of_dataset"])
def test_evaluate_precompute_ref_log_probs_at_init_after_training(trainer_class, hub, tmp_path, eval_dataset_type):
    config = args(tmp_path, max_steps=1, precompute_ref_log_probs=True)
    eval_dataset = dpo_suite.eval_split(eval_dataset_type, UNPAIRED)
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen(), eval_dataset=eval_dataset)
    trainer.train()
    dpo_suite.check_eval_metrics(trainer.evaluate(), eval_dataset_type)


@pytest.mark.parametrize("eval_dataset_type", [*dpo_suite.EVAL_DATASET_TYPES, "none"])
def test_init_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    eval_dataset = dpo_suite.eval_split(eval_dataset_type, UNPAIRED)
    config = args(tmp_path, loss_type="apo_zero_unpaired")
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=zen(), eval_dataset=eval_dataset)
    dpo_suite.check_prepared_eval_dataset(trainer, eval_dataset, "prompt_ids")


# ---- vision-language models (their samples train stock's micro-batches in ours: one logged reason) ----------------
def image_samples(count: int = 8) -> Dataset:
    """The ``zen-image`` ``conversational_unpaired_preference`` stand-in: the DPO suite's image pairs unpaired."""
    return unpair_preference_dataset(dpo_suite.image_preference_dataset(count))


@pytest.mark.parametrize("family", dpo_suite.VISION_MODELS)
def test_train_vlm(trainer_class, tmp_path, family):
    """TRL's ``test_train_vlm`` (and ``test_train_vlm_multi_image``: the samples hold one or two images). TRL checks
    every parameter; here the language model trained (as in the DPO suite: the tiny vision stand-ins' towers are
    not all reached in 2 steps)."""
    path, processor = dpo_suite.vision_model(family, tmp_path)
    config = args(tmp_path, per_device_train_batch_size=2, max_length=None)
    trainer = trainer_class(model=path, args=config, train_dataset=image_samples(), processing_class=processor)
    previous = {name: param.clone() for name, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    changed = [name for name, param in previous.items() if not torch.equal(param, trainer.model.get_parameter(name))]
    assert any("lm_head" in name for name in changed)
    check_dynamic_batching(trainer, repacks=False)


@representative
def test_train_vlm_apo_zero_unpaired(trainer_class, tmp_path):
    path, processor = dpo_suite.vision_model("qwen2_5_vl", tmp_path)
    config = args(tmp_path, per_device_train_batch_size=2, max_length=None, loss_type="apo_zero_unpaired")
    trainer = trainer_class(model=path, args=config, train_dataset=image_samples(), processing_class=processor)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    check_dynamic_batching(trainer, repacks=False)


@pytest.mark.parametrize("dataset_config", ["conversational_unpaired_preference", UNPAIRED])
def test_train_vlm_text_only_data(trainer_class, tmp_path, dataset_config):
    """A vision-language model on text samples: no image inputs, so ours repacks them; the vision tower gets no
    gradient and must not move."""
    path, processor = dpo_suite.vision_model("qwen2_5_vl", tmp_path)
    trainer = trainer_class(
        model=path, args=args(tmp_path), train_dataset=zen(dataset_config), processing_class=processor
    )
    train_and_check(trainer, unchanged=lambda name: name.startswith("model.visual"))


#: The model tags the trainer adds (``TestShared``'s ``test_tag_added``).
MODEL_TAGS = {"kto", "trl"}
#: ``TestShared``'s vision refusals: the image dataset, the vision-language model, stock's errors.
VISION_REFUSALS = (
    image_samples, "qwen2_5_vl", "vision-related.*vision-language model",
    "precompute_ref_log_probs.*not supported for vision datasets",
)  # fmt: skip


# ---- TRL's tests the DPO, reward and KTO suites share --------------------------------------------------------------
class TestShared(dpo_suite.SharedSuiteTests, dpo_suite.VisionRefusalTests):
    """TRL's tests restated alike in the three suites, on this suite's data and config:
    ``test_dpo_trl_suite.SharedSuiteTests``, ``VisionRefusalTests``."""
