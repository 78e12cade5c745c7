"""Model and tokenizer loading through transformers' Auto classes, with tokenmill's attention plugged in."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tokenmill.engine import attention, models
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.tiny import TINY_NAME, tiny_config, tiny_model, tiny_tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (where half precision is slow), else the checkpoint's dtype or bfloat16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype: must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def load(config: EngineConfig) -> LoadedModel:
    attention.register()
    device = resolve_device(config.device)
    if config.model == TINY_NAME:
        hf_config = tiny_config()
        dtype = resolve_dtype(config.dtype, hf_config, device)
        model = tiny_model(dtype, device, config.seed)
        return LoadedModel(models.choose(model.eval(), config.model_impl), tiny_tokenizer(), model.config, device, dtype)
    hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    if config.load_format == "dummy":
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=attention.NAME, dtype=dtype,
                trust_remote_code=config.trust_remote_code,
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            config.model, attn_implementation=attention.NAME, dtype=dtype,
            trust_remote_code=config.trust_remote_code,
        ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(
        config.tokenizer or config.model, trust_remote_code=config.trust_remote_code
    )
    return LoadedModel(models.choose(model.eval(), config.model_impl), tokenizer, model.config, device, dtype)
