"""Offline building blocks: a character-level tokenizer and tiny causal LMs built from a config.

Nothing here downloads anything. Tests, the example and the benchmarks use these to run GRPO on
machines without network access (CI), with real transformers models (random weights).
"""

from __future__ import annotations

import string

DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-*/=()"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level `PreTrainedTokenizerFast` (one token per character, left padding).

    Special tokens: ``<pad>`` (id 0), ``<eos>`` (id 1), ``<unk>`` (id 2); characters follow in
    ``alphabet`` order. Plain-string prompts need no chat template.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in alphabet:
        if char not in vocab:
            vocab[char] = len(vocab)
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()  # decode "abc", not "a b c"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    return tokenizer


def build_tiny_causal_lm(
    tokenizer,
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype=None,
):
    """A Qwen2-style causal LM with random weights (fp32 unless ``dtype`` is given).

    ``vocab_size`` defaults to the tokenizer's size; a larger value (e.g. 151,936) gives a realistic
    vocabulary-sized LM head for memory measurements while the tokenizer only uses the first ids.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
