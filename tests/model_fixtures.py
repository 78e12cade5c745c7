"""Tiny random-weight Hugging Face models written to disk as `save_pretrained` would.

Nothing here touches the network. Weights are drawn with a larger init range than usual so that greedy
argmax has clear winners, which keeps float32 parity with transformers free of near-ties.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tokenmill.engine.tiny import tiny_tokenizer

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    initializer_range=0.2, tie_word_embeddings=False,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, head_dim=16),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, use_sliding_window=False),
}


def build_model_dir(arch: str, root: Path, seed: int = 0) -> Path:
    """Write a random-weight model and the byte tokenizer to `root/arch`; return the directory."""
    path = root / arch
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def random_prompts(count: int, low: int, high: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]
