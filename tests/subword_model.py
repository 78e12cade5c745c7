"""A tiny random-weight Llama with a real subword (byte-level BPE) tokenizer, trained in code on a few KB of
generated text and written with `save_pretrained`: no network, and a vocabulary whose tokens span several
characters (`{"`, `":"`, words, digit runs), unlike builtin:tiny's one-byte tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

WORDS = ("alpha beta gamma delta cat dog bird label name tags owner verified true false null score items sku "
         "qty the mill grinds tokens into text yes no maybe positive negative neutral").split()


def _corpus(rng: random.Random, count: int = 150) -> list[str]:
    lines = []
    for _ in range(count):
        record = {rng.choice(WORDS): rng.choice([rng.randint(-999, 999), rng.choice(WORDS), rng.random() < 0.5,
                                                 [rng.choice(WORDS) for _ in range(rng.randint(0, 3))]])
                  for _ in range(rng.randint(1, 4))}
        lines.append(json.dumps(record, separators=(",", ":")))
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return lines


def subword_tokenizer(vocab_size: int = 480, seed: int = 0) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_corpus(random.Random(seed)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_subword_model_dir(root: Path, seed: int = 0) -> Path:
    """The model's vocabulary is padded to a multiple of 64, beyond the tokenizer's, as real checkpoints do."""
    path = root / "subword-llama"
    tokenizer = subword_tokenizer(seed=seed)
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
