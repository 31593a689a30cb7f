"""TRL's own RewardTrainer tests, restated offline, each run with stock ``RewardTrainer`` and with the class swapped.

TRL's ``tests/test_reward_trainer.py`` is not installed with the wheel, and its tests load models and datasets from the
Hub (``trl-internal-testing/tiny-*``, ``trl-internal-testing/zen``, ``trl-internal-testing/toolcall``,
``Qwen/Qwen3-4B``'s tokenizer), which this machine cannot reach. The TRL source stored here (``huggingface/trl`` at
``f2cd577``, whose ``RewardTrainer`` API is 1.16's: ``chosen_ids`` / ``rejected_ids``, the legacy ``*_input_ids``
columns deprecated, ``chat_template_path``, ``chat_template_kwargs``, ``tools``) holds 36 test functions (55 tests with
their parameters). This file restates those of ``TestRewardTrainer`` that can run on this CPU machine, 49 tests each
run with both classes: the same configurations and the same assertions, with offline stand-ins for what they download:

* the ``zen`` preference datasets: ``tests/test_dpo_trl_suite.py``'s (the Zen of Python's lines cut in half, as
  standard, conversational and implicit-prompt pairs; 17 train rows, 2 test);
* the tiny models: Qwen2 (``hf_dynbsz.testing``, TRL's Qwen3 chat template), the same saved as a sequence classifier
  of one label (``tiny-Qwen2ForSequenceClassification-2.5``), and Qwen3-MoE, Llama and GPT-NeoX built tiny from their
  default configs (``hf_dynbsz.testing.zoo``), GPT-NeoX's tokenizer without a chat template as on the Hub;
* ``Qwen/Qwen3-4B`` as the source of a cloned chat template: the Qwen2 stand-in's tokenizer (TRL's Qwen3 template and
  its special tokens); TRL's ``tests/data/template.jinja`` (a Qwen3 template): TRL's installed ``qwen3.jinja``;
* the ``toolcall`` preference dataset: a few conversational pairs of tool calls against plain answers, their
  ``tools`` a JSON string, as the Hub's stores them.

Each test takes ``trainer_class``: stock ``RewardTrainer`` and ``DynamicBatchRewardTrainer`` (the class swapped; the
config stays TRL's ``RewardConfig``, so the plugin runs its defaults: the automatic budget, the prefix tree). Every
test that passes with stock must pass with ours, and ours must have repacked its steps (not fallen back to stock's
micro-batches), except on GPT-NeoX, whose classifier is its own (not transformers' generic one), which runs stock's
micro-batches with one logged reason ([Reward models](../docs/reward.md#what-runs-stocks-micro-batches)). Runs use
the DPO suite's configuration (learning rate 0.1, 3 pairs per device) cut to ``max_steps`` 2 (TRL trains 3 epochs of
8 pairs at its default rate). Left out: the ``DataCollatorForPreference`` tests (stock's collator, which
the class swap does not touch) and ``test_trust_remote_code`` (remote code from the Hub); the default ``args=None`` of
``test_tag_added`` and ``test_tag_added_peft`` becomes TRL's test configuration (stock's default config asks for bf16,
which this CPU machine refuses).

By default the ``representative`` tests run; ``python -m pytest -m trl_suite tests/test_reward_trl_suite.py`` runs
all (see tests/conftest.py).
"""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import test_dpo_trl_suite as dpo_suite
import test_rloo_trl_suite as rloo_suite
from datasets import Dataset
from test_rloo_trl_suite import peft_rules
from trl import RewardConfig, RewardTrainer

from hf_dynbsz import DynamicBatchRewardTrainer
from hf_dynbsz.testing import build_chat_tokenizer, load_tokenizer, save_tiny_model
from hf_dynbsz.testing.reward import reward_model

pytestmark = pytest.mark.trl_suite
representative = pytest.mark.representative

#: The dataset nearly every TRL reward test trains on.
IMPLICIT = "standard_implicit_prompt_preference"
ZOO_MODELS = ("qwen3_moe", "llama")


trainer_class = dpo_suite.trainer_class_fixture(RewardTrainer, DynamicBatchRewardTrainer)


# ---- offline stand-ins -------------------------------------------------------------------------------------------
def zen(config: str = IMPLICIT, split: str = "train") -> Dataset:
    return dpo_suite.zen(config, split)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Directories standing in for the Hub's tiny models (see the module), by the name of the architecture."""
    root = tmp_path_factory.mktemp("hub")
    tokenizer = build_chat_tokenizer()
    paths = {"qwen2": save_tiny_model(str(root / "qwen2"), chat=True)}
    paths.update(rloo_suite.save_zoo_models(root, tokenizer, ZOO_MODELS))
    reward_model(paths["qwen2"]).save_pretrained(root / "qwen2_seqcls")
    tokenizer.save_pretrained(root / "qwen2_seqcls")
    paths["qwen2_seqcls"] = str(root / "qwen2_seqcls")
    tokenizer.chat_template = None  # the Hub's tiny GPT-NeoX has no chat template
    paths.update(rloo_suite.save_zoo_models(root, tokenizer, ("gpt_neox",)))
    return paths


def args(tmp_path, **overrides) -> RewardConfig:
    """TRL's test configuration on this CPU machine, cut to 2 optimizer steps (``tests/test_rloo_trl_suite.py``'s)."""
    return RewardConfig(**rloo_suite.trl_test_settings(tmp_path, **overrides))


def train_and_check(trainer, unchanged=lambda name: False, unchecked=lambda name: False, *, repacks: bool = True):
    """TRL's checks after training (``tests/test_rloo_trl_suite.py``'s), and for the class swapped, that it repacked
    its steps, or (``repacks`` False: a model it runs in stock's micro-batches) that it did not."""
    rloo_suite.train_and_check(trainer, unchanged, unchecked)
    if isinstance(trainer, DynamicBatchRewardTrainer):
        assert trainer._dynbsz.enabled == repacks
        if repacks:  # the plugin's figures were logged (TRL's config logs once, at the end of the 2 steps)
            assert any("dynbsz/microbatches" in entry for entry in trainer.state.log_history)
    return trainer


def toolcall_preference(count: int = 8) -> Dataset:
    """The ``toolcall`` preference dataset's shape: a user's question, a tool call chosen over a plain answer, the
    tool schema as a JSON string (lowercase: the stand-in tokenizer's alphabet)."""
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    tools = json.dumps([{"type": "function", "function": {"name": "multiply", "parameters": schema}}])
    rows = {"prompt": [], "chosen": [], "rejected": [], "tools": []}
    for i in range(count):
        a, b = i + 2, 3 * i + 1
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        rows["prompt"].append([{"role": "user", "content": f"what is {a} times {b}?"}])
        rows["chosen"].append([{"role": "assistant", "content": "", "tool_calls": [call]}])
        rows["rejected"].append([{"role": "assistant", "content": f"it is {a + b}.", "tool_calls": []}])
        rows["tools"].append(tools)
    return Dataset.from_dict(rows)


# ---- models and datasets -----------------------------------------------------------------------------------------
def test_raises_error_when_model_num_labels_not_one(trainer_class, hub, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hub["qwen2"], dtype="float32")  # 2 labels by default
    with pytest.raises(ValueError, match=r"reward models require `num_labels=1`"):
        trainer_class(model=model, args=args(tmp_path), train_dataset=zen())


@pytest.mark.parametrize("model", [pytest.param("qwen2", marks=representative), *ZOO_MODELS])
def test_train(trainer_class, hub, tmp_path, model):
    train_and_check(trainer_class(model=hub[model], args=args(tmp_path), train_dataset=zen()))


@pytest.mark.parametrize(
    "config_name",
    [
        "standard_preference",
        pytest.param("conversational_preference", marks=representative),
        IMPLICIT,
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_dataset_types(trainer_class, hub, tmp_path, config_name):
    train_and_check(trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=zen(config_name)))


def test_train_model(trainer_class, hub, tmp_path):
    model = reward_model(hub["qwen2"])  # AutoModelForSequenceClassification, num_labels=1, fp32
    train_and_check(trainer_class(model=model, args=args(tmp_path), train_dataset=zen()))


def test_train_from_sequence_classification_model(trainer_class, hub, tmp_path):
    train_and_check(trainer_class(model=hub["qwen2_seqcls"], args=args(tmp_path), train_dataset=zen()))


@pytest.mark.parametrize(
    "chosen_column,rejected_column,expect_deprecation_warning",
    [("chosen_ids", "rejected_ids", False), ("chosen_input_ids", "rejected_input_ids", True)],
)
def test_train_with_pretokenized_data(
    trainer_class, hub, tmp_path, chosen_column, rejected_column, expect_deprecation_warning
):
    tokenizer = load_tokenizer(hub["qwen2"])
    dataset = zen().map(
        lambda example: {
            chosen_column: tokenizer(example["chosen"]).input_ids,
            rejected_column: tokenizer(example["rejected"]).input_ids,
        },
        remove_columns=["chosen", "rejected"],
    )
    config = args(tmp_path)
    if expect_deprecation_warning:
        with pytest.warns(FutureWarning, match=r"will not be supported in v1"):
            trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=dataset)
    else:
        trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=dataset)
    columns = trainer.train_dataset.column_names
    assert {"chosen_ids", "rejected_ids"} <= set(columns)
    assert "chosen_input_ids" not in columns and "rejected_input_ids" not in columns
    train_and_check(trainer)


@representative
def test_train_with_iterable_dataset(trainer_class, hub, tmp_path):
    config = args(tmp_path, max_steps=3)
    train_and_check(trainer_class(model=hub["qwen2"], args=config, train_dataset=zen().to_iterable_dataset()))


#: TRL's simplified Qwen chat template, whose ``role_capital`` argument capitalises the roles (verbatim).
ROLE_CAPITAL_TEMPLATE = '{%- if messages[0]["role"] == "system" -%}    {{ "<|im_start|>" + ("SYSTEM" if role_capital else "system") + "\\n" + messages[0]["content"] + "<|im_end|>\\n" }}{%- else -%}    {{ "<|im_start|>" + ("SYSTEM" if role_capital else "system") + "\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n" }}{%- endif -%}{%- for message in messages -%}    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) -%}        {{ "<|im_start|>" + (message.role.upper() if role_capital else message.role) + "\\n" + message.content + "<|im_end|>\\n" }}    {%- elif message.role == "assistant" -%}        {{ "<|im_start|>" + ("ASSISTANT" if role_capital else "assistant") }}        {%- if message.content -%}            {{ "\\n" + message.content }}        {%- endif -%}        {{ "<|im_end|>\\n" }}    {%- elif message.role == "tool" -%}        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") -%}            {{ "<|im_start|>" + ("USER" if role_capital else "user") }}        {%- endif -%}        {{ "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" }}        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") -%}            {{ "<|im_end|>\\n" }}        {%- endif -%}    {%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}    {{ "<|im_start|>" + ("ASSISTANT" if role_capital else "assistant") + "\\n" }}{%- endif -%}'  # noqa: E501


def test_train_with_chat_template_kwargs(trainer_class, hub, tmp_path):
    """Each row's chat template arguments (``chat_template_kwargs``) reach its tokenization (the template's uppercase
    letters are unknown tokens to the stand-in tokenizer, the same in both strings compared)."""
    tokenizer = load_tokenizer(hub["qwen2"])
    tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE
    dataset = zen("conversational_implicit_prompt_preference")
    dataset = dataset.add_column("chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))])
    assert "chat_template_kwargs" in dataset.features
    trainer = trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=dataset, processing_class=tokenizer)
    assert trainer.processing_class.chat_template == tokenizer.chat_template
    for i in range(2):
        role = "SYSTEM" if i else "system"
        system_prompt = (
            f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
        )
        system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
        assert trainer.train_dataset[i]["chosen_ids"][: len(system_prompt_ids)] == system_prompt_ids
        assert trainer.train_dataset[i]["rejected_ids"][: len(system_prompt_ids)] == system_prompt_ids
    train_and_check(trainer)


def gpt_neox_rules() -> dict:
    """TRL's GPT-NeoX exception: the final layer norm's bias gets no gradient (the loss ignores a uniform shift of
    the rewards); and ours runs GPT-NeoX's own classifier in stock's micro-batches."""
    return {"unchecked": lambda name: name == "gpt_neox.final_layer_norm.bias", "repacks": False}


def test_train_with_set_chat_template_from_model(trainer_class, hub, tmp_path):
    config = args(tmp_path, chat_template_path=hub["qwen2"])  # stands in for Qwen/Qwen3-4B's tokenizer
    trainer = trainer_class(model=hub["gpt_neox"], args=config, train_dataset=zen("conversational_preference"))
    train_and_check(trainer, **gpt_neox_rules())


@representative
def test_train_with_set_chat_template_from_path(trainer_class, hub, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text((files("trl") / "chat_templates" / "qwen3.jinja").read_text())
    config = args(tmp_path, chat_template_path=str(template), save_strategy="steps")
    trainer = trainer_class(model=hub["gpt_neox"], args=config, train_dataset=zen("conversational_preference"))
    train_and_check(trainer, **gpt_neox_rules())
    saved = tmp_path / "out" / "checkpoint-2" / "chat_template.jinja"  # TRL's checkpoint-9: 3 epochs of 3 steps
    assert saved.exists(), f"Chat template not found at {saved}"
    assert saved.read_text() == template.read_text(), "Chat template content does not match the original"


@pytest.mark.parametrize("tools_as", [pytest.param("json_string", marks=representative), "list_of_dicts"])
def test_train_toolcall_data(trainer_class, hub, tmp_path, tools_as):
    """TRL's ``test_train_toolcall_data`` and ``test_train_toolcall_data_as_json`` (``tools`` decoded to a list of
    dicts, which Arrow may pad with ``None``s)."""
    dataset = toolcall_preference()
    if tools_as == "list_of_dicts":
        dataset = dataset.map(lambda example: {"tools": json.loads(example["tools"])})
    config = args(tmp_path, per_device_train_batch_size=2, max_length=512)  # TRL's, against out-of-memory
    trainer = trainer_class(model=hub["qwen2"], args=config, train_dataset=dataset)
    assert len(trainer.train_dataset) == len(dataset)  # the stand-in's pairs (about 500 tokens) all fit
    train_and_check(trainer)


# ---- PEFT --------------------------------------------------------------------------------------------------------
def base_names(path: str) -> set[str]:
    """TRL's base-model parameter names: those of the model at ``path`` as a sequence classifier (2 labels, TRL's
    default here), under PEFT's prefix."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype="float32")
    return {f"base_model.model.{name}" for name, _ in model.named_parameters()}


@pytest.mark.parametrize(
    "how", [pytest.param("peft_config", marks=representative), "peft_model", "peft_config_with_gradient_checkpointing"]
)
def test_train_peft(trainer_class, hub, tmp_path, how):
    """TRL's ``test_train_dense_with_peft_config``, ``test_train_peft_model`` and
    ``test_train_with_peft_config_and_gradient_checkpointing``."""
    from peft import LoraConfig, get_peft_model

    rules = peft_rules(base_names(hub["qwen2"]))
    model, kwargs = hub["qwen2"], {"peft_config": LoraConfig()}
    if how == "peft_model":
        model, kwargs = get_peft_model(reward_model(hub["qwen2"]), LoraConfig()), {}
    config = args(tmp_path, **({"gradient_checkpointing": True} if "checkpointing" in how else {}))
    train_and_check(trainer_class(model=model, args=config, train_dataset=zen(), **kwargs), **rules)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_peft_config_and_gradient_checkpointing_reentrant(trainer_class, hub, tmp_path, use_reentrant):
    from peft import LoraConfig

    config = args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    trainer = trainer_class(model=hub["qwen2_seqcls"], args=config, train_dataset=zen(), peft_config=LoraConfig())
    train_and_check(trainer, **peft_rules(base_names(hub["qwen2_seqcls"])))


def test_train_moe_with_peft_config(trainer_class, hub, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj", "score"])
    trainer = trainer_class(model=hub["qwen3_moe"], args=args(tmp_path), train_dataset=zen(), peft_config=lora)
    train_and_check(trainer, **peft_rules(base_names(hub["qwen3_moe"])))


# ---- evaluation --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "eval_dataset_type", [pytest.param("dataset", marks=representative), *dpo_suite.EVAL_DATASET_TYPES[1:]]
)
def test_evaluate_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    """A raw eval dataset passed to ``evaluate`` directly (TRL's issue 6115)."""
    trainer = trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=zen())
    metrics = trainer.evaluate(eval_dataset=dpo_suite.eval_split(eval_dataset_type, IMPLICIT))
    dpo_suite.check_eval_metrics(metrics, eval_dataset_type)


@pytest.mark.parametrize("eval_dataset_type", [*dpo_suite.EVAL_DATASET_TYPES, "none"])
def test_init_with_eval_dataset(trainer_class, hub, tmp_path, eval_dataset_type):
    eval_dataset = dpo_suite.eval_split(eval_dataset_type, IMPLICIT)
    trainer = trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=zen(), eval_dataset=eval_dataset)
    dpo_suite.check_prepared_eval_dataset(trainer, eval_dataset, "chosen_ids")


# ---- gradient checkpointing, margins, centering ------------------------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_train_with_gradient_checkpointing_reentrant(trainer_class, hub, tmp_path, use_reentrant):
    config = args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    train_and_check(trainer_class(model=hub["qwen2_seqcls"], args=config, train_dataset=zen()))


@representative
def test_train_with_margin(trainer_class, hub, tmp_path):
    dataset = zen().map(lambda example: {"margin": len(example["chosen"])})  # TRL's dummy margin
    train_and_check(trainer_class(model=hub["qwen2"], args=args(tmp_path), train_dataset=dataset))


@representative
def test_train_with_center_rewards_coefficient(trainer_class, hub, tmp_path):
    config = args(tmp_path, center_rewards_coefficient=0.01)
    train_and_check(trainer_class(model=hub["qwen2"], args=config, train_dataset=zen()))


#: The model tags the trainer adds (``TestShared``'s ``test_tag_added``).
MODEL_TAGS = {"reward-trainer", "trl"}


# ---- TRL's tests the DPO, reward and KTO suites share --------------------------------------------------------------
class TestShared(dpo_suite.SharedSuiteTests, dpo_suite.ComputeMetricsTest):
    """TRL's tests restated alike in the three suites, on this suite's data and config:
    ``test_dpo_trl_suite.SharedSuiteTests``, ``ComputeMetricsTest``."""

    @representative
    def test_train_with_compute_metrics(self, trainer_class, hub, tmp_path):
        super().test_train_with_compute_metrics(trainer_class, hub, tmp_path)
