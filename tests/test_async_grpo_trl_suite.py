"""TRL's own AsyncGRPOTrainer tests, restated offline, each run with stock ``AsyncGRPOTrainer`` and with the class
swapped to ``DynamicBatchAsyncGRPOTrainer``.

TRL's ``tests/experimental/test_async_grpo_trainer.py`` is not installed with the wheel, and its trainer tests load a
model, a tokenizer and the ``zen`` dataset from the Hub and are skipped without an Ampere GPU (FlashAttention-3); none
runs here as written. The version read (``huggingface/trl``'s file, which passes ``rollout_worker=`` and
``weight_transfer=`` stubs as 1.16's protocols take them) is restated here with the same configurations and assertions
and offline stand-ins: the ``zen`` prompts and completions from the lines of ``import this`` (the Zen of Python), a
tiny Qwen2 with TRL's Qwen3 chat template (:func:`~hf_dynbsz.testing.build_chat_tokenizer`), a rollout worker of our
own with TRL's stub's behaviour (each group: one prompt's chat ids, ``num_generations`` completions "<completion>
<index>", rewards from the completion's text, advantages normalised in the group, old log-probs -0.5, the queue refilled
at every weight sync), the no-op weight transfer of :mod:`hf_dynbsz.testing.async_grpo`, and stock's tree kernel in
plain torch (:func:`~hf_dynbsz.testing.async_grpo_on_cpu`).

Left out: ``args=None`` in ``test_init_minimal`` (stock's default config asks for bf16, which this CPU machine refuses:
it fails for stock here), the weight-metadata test that builds stock's own vLLM worker and weight client (with a PEFT
model stock then probes the vLLM server for adapter sync, which is not there), and the tests of stock's planner,
collator, reconciler and rollout loop (they call those classes directly: nothing of the trainer's class runs).

By default the ``representative`` tests run; ``python -m pytest -m trl_suite tests/test_async_grpo_trl_suite.py`` runs
all (see tests/conftest.py).
"""

from __future__ import annotations

import codecs
import itertools
import queue
import this
import zlib

import pytest
import torch
from datasets import Dataset
from test_rloo_trl_suite import TRL_CPU_FIELDS as CPU
from test_rloo_trl_suite import train_and_check, trl_test_settings
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from hf_dynbsz import DynamicBatchAsyncGRPOTrainer
from hf_dynbsz.testing import NoWeightTransfer, async_grpo_on_cpu, load_tokenizer, save_tiny_model

pytestmark = pytest.mark.trl_suite
representative = pytest.mark.representative


@pytest.fixture(params=[AsyncGRPOTrainer, DynamicBatchAsyncGRPOTrainer], ids=["stock", "dynamic"])
def trainer_class(request):
    return request.param


@pytest.fixture(autouse=True)
def on_cpu():
    with async_grpo_on_cpu():
        yield


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("qwen2")), chat=True)


def zen() -> Dataset:
    """The Zen of Python's lines, halved into a user prompt and an assistant completion (TRL's
    ``conversational_prompt_completion`` zen is built the same way), lowercased for the character tokenizer."""
    lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]
    halves = [(words[: max(1, len(words) // 2)], words[max(1, len(words) // 2) :]) for words in map(str.split, lines)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": " ".join(first).lower()}] for first, _ in halves],
            "completion": [[{"role": "assistant", "content": " ".join(rest).lower()}] for _, rest in halves],
        }
    )


def dummy_reward_func(completions, **kwargs):
    return [zlib.crc32(completion[0]["content"].encode()) % 100 / 100.0 for completion in completions]


class StubRolloutWorker:
    """A rollout worker with the behaviour of TRL's test stub (TRL's ``RolloutWorkerProtocol``)."""

    def __init__(self, tokenizer, dataset, num_generations: int = 8, samples_per_weight_sync: int = 10):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        self.samples_per_weight_sync, self.model_version = samples_per_weight_sync, 0
        self.samples = self.groups(tokenizer, dataset, num_generations)

    def groups(self, tokenizer, dataset, num_generations):
        import numpy as np
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        for group_id, row in enumerate(itertools.cycle(dataset)):
            completions = [
                [{"role": "assistant", "content": f"{row['completion'][0]['content']} {index}"}]
                for index in range(num_generations)
            ]
            prompt_ids = tokenizer.apply_chat_template(
                row["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False
            )
            rewards = np.array(dummy_reward_func(completions))
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            for index, completion in enumerate(completions):
                full = tokenizer.apply_chat_template(row["prompt"] + completion, tokenize=True, return_dict=False)
                completion_ids = list(full)[len(prompt_ids) :]
                yield RolloutSample(
                    prompt=row["prompt"],
                    completion=completion,
                    input_ids=np.asarray(list(prompt_ids) + completion_ids),
                    completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(completion_ids)),
                    old_log_probs=np.asarray([0.0] * len(prompt_ids) + [-0.5] * len(completion_ids), np.float32),
                    advantage=float(advantages[index]),
                    model_version=self.model_version,
                    group_id=group_id,
                    metrics={"reward": float(rewards[index]), "reward_std": float(rewards.std())},
                )

    def fill(self):
        for _ in range(self.samples_per_weight_sync):
            self.rollout_buffer.put(next(self.samples))

    def start(self):
        self.fill()

    def update_model_version(self, model_version):
        self.model_version = model_version
        self.fill()

    def stop(self):
        pass

    def check_health(self, stale_after_s):
        pass


def worker(model_id, num_generations):
    return StubRolloutWorker(load_tokenizer(model_id), zen(), num_generations=num_generations)


def trainer(trainer_class, model_id, args, num_generations: int = 8, **kwargs):
    """The trainer of TRL's tests: the model by path and its tokenizer, the dummy reward, the zen dataset, the stub
    worker of ``num_generations`` completions per prompt and the no-op weight transfer (without one, stock probes the
    vLLM server for adapter sync); ``kwargs``: more of the trainer's arguments."""
    return trainer_class(
        model=model_id,
        reward_funcs=dummy_reward_func,
        args=args,
        train_dataset=zen(),
        processing_class=load_tokenizer(model_id),
        rollout_worker=worker(model_id, num_generations),
        weight_transfer=NoWeightTransfer(),
        **kwargs,
    )


@representative
def test_model_init_kwargs(trainer_class, model_id, tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), model_init_kwargs={"dtype": "bfloat16"}, **CPU)
    for param in trainer(trainer_class, model_id, args).model.parameters():
        assert param.dtype == torch.bfloat16, f"Expected bfloat16 but got {param.dtype}"


@representative
def test_init_minimal(trainer_class, model_id, tmp_path):
    trainer(trainer_class, model_id, AsyncGRPOConfig(output_dir=str(tmp_path), **CPU), 3)  # (args=None: see the module)


@representative
def test_train(trainer_class, model_id, tmp_path):
    training_args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=8,  # reduce the completion length to reduce memory usage
        token_budget=256,  # set explicitly; the stub worker has no real vLLM server to query for max_model_len
        vllm_server_timeout=5.0,  # short timeout so test fails fast if queue runs dry
        max_steps=6,  # (TRL trains an epoch of the zen prompts)
        **CPU,
    )
    train_and_check(trainer(trainer_class, model_id, training_args, 3))  # a train loss, every parameter moved


def test_train_peft_config(trainer_class, model_id, tmp_path):
    from accelerate.utils import is_peft_model
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    generation = dict(num_generations=3, max_completion_length=8, token_budget=256)
    training_args = AsyncGRPOConfig(**trl_test_settings(tmp_path, **generation, max_steps=4))
    peft_trainer = trainer(trainer_class, model_id, training_args, 3, peft_config=LoraConfig())
    assert is_peft_model(peft_trainer.model)
    base_model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in base_model.named_parameters()]
    # A train loss; the base model's parameters stay, the adapter's move (the base layers are not checked).
    train_and_check(peft_trainer, unchanged=lambda n: n in base_param_names, unchecked=lambda n: "base_layer" in n)


def test_peft_streaming_iter_excludes_adapters_and_modules_to_save(trainer_class, model_id, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"])
    streaming = trainer(trainer_class, model_id, AsyncGRPOConfig(output_dir=str(tmp_path), **CPU), peft_config=lora)
    weight_names = [name for name, _ in streaming._streaming_iter()]
    for name in weight_names:
        assert "lora" not in name, f"Adapter weight {name} leaked into streaming weights"
        assert "original_module" not in name, f"Original module weight {name} leaked into streaming weights"
        assert "modules_to_save" not in name, f"Module-to-save prefix {name} leaked into streaming weights"
    assert "model.embed_tokens.weight" in weight_names
    assert "lm_head.weight" in weight_names
