"""Worker of the exit soak (`-m exits`): `accelerate launch --config_file cpu_ddp.yaml tests/exit_lopsided.py OUT`.

The plain 2-process CPU DDP script of the report of the abort at exit (issue 43), as a new user writes it: a Qwen2
of hidden size 256 and 4 layers, one thread per process, a rollout that gives process 0 every long completion
(median ~270 tokens, log-normal) and process 1 every short one (median ~25), so cross-rank balancing moves samples
every step; dapo, 3 optimizer steps. It returns after ``train()`` (no ``trainer.end()``) while process 0 still saves
its parameters. Each process writes ``OUT.rank<N>.json`` (the samples balancing moved) before it returns.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer  # noqa: E402

MAX_COMPLETION = 768


def tokenizer() -> PreTrainedTokenizerFast:
    characters = list("abcdefghijklmnopqrstuvwxyz .?")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(characters)}}
    for i in range(2000 - len(vocab)):
        vocab[f"<t{i}>"] = len(vocab)
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    model.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


class LopsidedRollout:
    """Each call draws a pool of long and a pool of short completion lengths; process 0 gets the long ones."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.calls = tok, 0

    def __call__(self, prompts, trainer):
        rng = random.Random(1000 + self.calls)
        self.calls += 1
        long_pool = [max(2, min(MAX_COMPLETION, int(rng.lognormvariate(5.6, 0.4)))) for _ in prompts]
        short_pool = [max(2, min(MAX_COMPLETION, int(rng.lognormvariate(3.2, 0.5)))) for _ in prompts]
        lengths = long_pool if trainer.accelerator.process_index == 0 else short_pool
        prompt_ids, completion_ids, logprobs = [], [], []
        for prompt, length in zip(prompts, lengths):
            draw = random.Random(f"{prompt}#{length}#{self.calls}")
            prompt_ids.append(self.tok(prompt)["input_ids"])
            completion_ids.append([draw.randrange(3, 1990) for _ in range(length - 1)] + [1])
            logprobs.append([0.0] * length)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def reward(completion_ids, **kwargs):
    return [float(sum(completion) % 11) for completion in completion_ids]


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    tok = tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok.get_vocab()), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(5)
    args = DynamicBatchGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="exit-lopsided-"), per_device_train_batch_size=8,
        gradient_accumulation_steps=2, num_generations=8, max_completion_length=MAX_COMPLETION, max_steps=3,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=7, loss_type="dapo", disable_tqdm=True,
        logging_steps=1000, gradient_checkpointing=False,
    )  # fmt: skip
    prompts = [f"p{i} " + "ab" * (3 + i % 7) + "?" for i in range(64)]
    trainer = DynamicBatchGRPOTrainer(
        model=Qwen2ForCausalLM(config), reward_funcs=reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok, rollout_func=LopsidedRollout(tok),
    )  # fmt: skip
    trainer.train()
    moved = [entry["dynbsz/samples_moved"] for entry in trainer.state.log_history if "dynbsz/samples_moved" in entry]
    rank = trainer.accelerator.process_index
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump({"rank": rank, "samples_moved": moved}, handle)
    if trainer.accelerator.is_main_process:  # still saving while process 1 returns and exits
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({name: p.detach().clone() for name, p in unwrapped.named_parameters()}, f"{out}.params.pt")


if __name__ == "__main__":
    main()
