"""The engine's one config dataclass: every knob in one place, checked once.

Each field's `metadata["help"]` is its description wherever a user meets it: `tokenmill worker` builds one flag and
one `TOKENMILL_<NAME>` variable per field from `ENGINE_OPTIONS`, and `annotate`/`batch` one flag each for their
embedded engine, so an option added here reaches every door with its help and default.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple

#: The grammar backends, and "auto" (the default): per request, the first of `structured.AUTO_ORDER` that enforces it.
CONSTRAINT_BACKENDS = ("auto", "xgrammar", "llguidance")
#: The model code (`engine/models`): "auto" (native where it covers the checkpoint, else transformers'), or either one.
MODEL_IMPLS = ("auto", "native", "transformers")
LOAD_FORMATS = ("auto", "dummy")


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    """Engine options. Sizes left at None are derived from the model and the device at load time.

    KV pool size: `num_kv_blocks` if given; else `kv_cache_memory` bytes if given; else on CUDA
    `gpu_memory_utilization` of the device's total memory less what is in use after a profiled worst-case
    step (weights, activations and sampler of `max_num_batched_tokens` tokens and `max_num_seqs` rows,
    memory outside torch); on CPU, enough for `max_num_seqs` full-length sequences capped at
    `cpu_kv_cache_cap` bytes.
    """

    model: str = _option("builtin:tiny", "Model: a local directory, a Hugging Face hub id, or builtin:tiny (random "
                         "weights, for tests).")
    tokenizer: str | None = _option(None, "Tokenizer directory or hub id; default: the model's.")
    dtype: str = _option("auto", "Weights and activations dtype: auto (float32 on CPU; on a GPU the checkpoint's half "
                         "dtype, else bfloat16), float32, bfloat16 or float16.")
    device: str = _option("auto", "Device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
    load_format: str = _option("auto", "auto: read the checkpoint's weights; dummy: random weights of its shape "
                               "(benchmarks without a download).", LOAD_FORMATS)
    trust_remote_code: bool = _option(False, "Run the checkpoint's own Python code (configs, tokenizers): only for "
                                      "checkpoints you trust.")
    max_num_seqs: int = _option(256, "Most sequences the engine runs at once.")
    max_num_batched_tokens: int = _option(2048, "Token budget of one engine step (decode tokens plus prefill chunks).")
    max_model_len: int | None = _option(None, "Longest prompt + completion in tokens; default: the model's.")
    block_size: int = _option(16, "Tokens per KV cache block.")
    num_kv_blocks: int | None = _option(None, "KV cache blocks; default: sized from --kv-cache-memory, else from "
                                        "--gpu-memory-utilization (CUDA) or --cpu-kv-cache-cap (CPU).")
    kv_cache_memory: int | None = _option(None, "Bytes of KV cache; default: sized from the device's memory.")
    gpu_memory_utilization: float = _option(0.9, "Share of the GPU's memory the engine may use in all (weights, "
                                            "activations, KV cache); lower it to share the GPU.")
    cpu_kv_cache_cap: int = _option(2 << 30, "Most bytes of KV cache on CPU.")
    enable_prefix_caching: bool = _option(True, "Reuse the KV cache of prompt prefixes shared between requests.")
    attention_backend: str | None = _option(None, "Attention backend (torch or triton); default: "
                                            "$TOKENMILL_ATTENTION_BACKEND, else triton on CUDA and torch on CPU.")
    model_impl: str = _option("auto", "Model code: auto (tokenmill's native implementation where one covers the "
                              "checkpoint: Llama, Mistral, Qwen2, Qwen3; else transformers'), native, or transformers. "
                              "The choice is logged.", MODEL_IMPLS)
    enforce_eager: bool = _option(True, "Run every step eagerly. False: decode steps of native models on CUDA replay "
                                  "CUDA graphs captured at start, one per batch-size bucket (not yet verified on a "
                                  "GPU, hence off by default).")
    async_scheduling: bool = _option(False, "Plan and launch each step before the last one's tokens are read back, "
                                     "so the host's work overlaps the device's, while every sampled request is greedy "
                                     "with no logprobs, penalty, stop string, grammar or min_tokens (others run step "
                                     "by step). For GPUs; not yet timed on one, hence off by default.")
    seed: int = _option(0, "Engine seed (sampling of requests without a seed of their own).")
    grammar_compile_timeout: float = _option(60.0, "Seconds a new grammar may take to compile (off the engine loop) "
                                             "before its request fails naming the field.")
    grammar_cache_bytes: int = _option(512 << 20, "Bytes of compiled grammars kept (least recently used dropped).")
    constraint_backend: str = _option("auto", "Structured-output grammar backend: auto (per request, the one that "
                                      "enforces the constraint in full, recorded in each result's constraint_backend), "
                                      "or xgrammar / llguidance to force one.", CONSTRAINT_BACKENDS)

    def __post_init__(self) -> None:
        for option in ENGINE_OPTIONS:
            if option.choices and getattr(self, option.name) not in option.choices:
                raise ValueError(f"{option.name}: must be one of {', '.join(option.choices)}, "
                                 f"got {getattr(self, option.name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "cpu_kv_cache_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not self.grammar_compile_timeout > 0 or self.grammar_cache_bytes < 1:
            raise ValueError("grammar_compile_timeout and grammar_cache_bytes: must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]


class EngineOption(NamedTuple):
    """One `EngineConfig` field as a command line shows it: `kind` is bool, int, float or str; `optional` when None
    is a value (left to the engine to derive)."""

    name: str
    kind: type
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None


def _engine_options() -> tuple[EngineOption, ...]:
    hints = typing.get_type_hints(EngineConfig)
    options = []
    for spec in fields(EngineConfig):
        args = typing.get_args(hints[spec.name])
        kind = next((a for a in args if a is not type(None)), hints[spec.name])
        assert spec.default is not MISSING and kind in (bool, int, float, str), spec.name
        options.append(EngineOption(spec.name, kind, type(None) in args, spec.default, spec.metadata["help"],
                                    spec.metadata["choices"]))
    return tuple(options)


#: Every `EngineConfig` field but `model` (which each command takes in its own way), in declaration order.
ENGINE_OPTIONS: tuple[EngineOption, ...] = tuple(o for o in _engine_options() if o.name != "model")
