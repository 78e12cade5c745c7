"""The engine's one config dataclass: every knob in one place, checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields

#: The grammar backends, and "auto" (the default): per request, the first of `structured.AUTO_ORDER` that enforces it.
CONSTRAINT_BACKENDS = ("auto", "xgrammar", "llguidance")
#: The model code (`engine/models`): "auto" (native where it covers the checkpoint, else transformers'), or either one.
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass
class EngineConfig:
    """Engine options. Sizes left at None are derived from the model and the device at load time.

    KV pool size: `num_kv_blocks` if given; else `kv_cache_memory` bytes if given; else on CUDA
    `gpu_memory_utilization` of the device's total memory less what is in use after a profiled worst-case
    step (weights, activations and sampler of `max_num_batched_tokens` tokens and `max_num_seqs` rows,
    memory outside torch); on CPU, enough for `max_num_seqs` full-length sequences capped at
    `cpu_kv_cache_cap` bytes.
    """

    model: str = "builtin:tiny"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    trust_remote_code: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_cap: int = 2 << 30
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    # "auto": the native implementation where one covers the checkpoint (`engine/models`), else transformers' modeling
    # code; "native" or "transformers" to force one (the choice is logged).
    model_impl: str = "auto"
    seed: int = 0
    # Structured outputs: seconds a new grammar may take to compile (off the engine loop) before its request
    # fails naming the field, and the bytes of compiled grammars kept (LRU).
    grammar_compile_timeout: float = 60.0
    grammar_cache_bytes: int = 512 << 20
    # The grammar backend: "auto" (per request, the one that enforces it in full; see engine/structured.py),
    # "xgrammar" or "llguidance" to force one (what it cannot enforce is refused naming the field).
    constraint_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not self.grammar_compile_timeout > 0 or self.grammar_cache_bytes < 1:
            raise ValueError("grammar_compile_timeout and grammar_cache_bytes: must be > 0")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.constraint_backend not in CONSTRAINT_BACKENDS:
            raise ValueError(f"constraint_backend: must be one of {', '.join(CONSTRAINT_BACKENDS)}, "
                             f"got {self.constraint_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]
