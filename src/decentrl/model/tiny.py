"""Tiny random Llama models with a character-level tokenizer: the same code paths as the real
model (Hugging Face folder, chat template, tied embeddings) at a size where a training step takes
milliseconds. Tests use these."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = string.digits + string.ascii_letters + " \n+-*/=?.,:<>()'"


def tiny_tokenizer(characters: str = CHARACTERS):
    """A character-level fast tokenizer: every character is one token. `characters` are the
    tokens besides the special ones (a tool call's JSON needs more than the default's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(characters))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(out_dir: Path, seed: int = 0, num_layers: int = 4, hidden_size: int = 32,
                    model_type: str = "llama", characters: str = CHARACTERS,
                    **config_fields: Any) -> Path:
    """Write a random model + tokenizer (of `characters`) as a Hugging Face folder and return
    its path. `config_fields` set or override fields of the family's config (its head_dim,
    biases, sliding window...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tiny_tokenizer(characters)
    fields = {
        "vocab_size": len(tokenizer), "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    }
    config = AutoConfig.for_model(model_type, **{**fields, **config_fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
