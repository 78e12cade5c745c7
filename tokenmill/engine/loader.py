"""Model and tokenizer loading through transformers' Auto classes, with tokenmill's attention plugged in."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tokenmill.engine import attention, models
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.tiny import TINY_NAME, tiny_config, tiny_model, tiny_tokenizer
from tokenmill.errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype


def _names_a_path(model: str) -> bool:
    """A hub id is `name` or `namespace/name`; anything else (absolute, relative, home, deeper) is a path."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: must be auto, cpu, cuda or cuda:N; got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but this torch sees no CUDA device (torch {torch.__version__}"
                         f"{', a CPU-only build' if torch.version.cuda is None else ''}): use cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device: {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA devices")
    return device


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


def refuse_encoder(model: str, hf_config: PretrainedConfig) -> None:
    """`ModelLoadError` for an encoder (BERT, RoBERTa, XLM-R and the other masked-LM families) or encoder-decoder
    checkpoint: the engine runs decoder-only causal LMs, for generation and embeddings alike."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", "")
    both = getattr(hf_config, "is_encoder_decoder", False)
    if both or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(hf_config, "is_decoder", False):
        raise ModelLoadError(
            f"model {model!r} is an {'encoder-decoder' if both else 'encoder-only'} ({model_type}) checkpoint: "
            "tokenmill runs decoder-only causal LMs (natively Llama, Mistral, Qwen2, Qwen3; others through "
            "transformers), for embeddings too (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral)")


def load(config: EngineConfig) -> LoadedModel:
    """The model and tokenizer `config` names; `ModelLoadError` (one line: what and how to fix it) if they cannot be
    loaded as configured."""
    try:
        return _load(config)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:  # transformers' errors for a missing or unreadable checkpoint
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"model {config.model!r} cannot be loaded: {first}") from exc


def _load(config: EngineConfig) -> LoadedModel:
    if config.model != TINY_NAME and _names_a_path(config.model) and not os.path.isdir(config.model):
        raise ModelLoadError(f"model: no directory {config.model!r}: give a local directory written by save_pretrained, "
                             f"a Hugging Face hub id, or {TINY_NAME}")
    attention.register()
    device = resolve_device(config.device)
    if config.model == TINY_NAME:
        hf_config = tiny_config()
        dtype = resolve_dtype(config.dtype, hf_config, device)
        model = tiny_model(dtype, device, config.seed)
        return LoadedModel(models.choose(model.eval(), config.model_impl), tiny_tokenizer(), model.config, device, dtype)
    hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    refuse_encoder(config.model, hf_config)
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
