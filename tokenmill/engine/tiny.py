"""`builtin:tiny`: a small random-weight Llama and a byte-level tokenizer built in code, so that the whole
system runs offline on a fresh machine with nothing to download."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

TINY_NAME = "builtin:tiny"
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Token id = byte value for the 256 bytes, then the special tokens."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab.update({token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The same weights in every process for a given seed, so workers and tests agree."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="tokenmill", dtype=dtype)
    return model.to(device)
