"""Native model implementations, chosen over transformers' modeling code where they cover a checkpoint exactly."""

from __future__ import annotations

import logging
import torch

from tokenmill.engine.models import llama

log = logging.getLogger(__name__)


def choose(model: torch.nn.Module, impl: str) -> torch.nn.Module:
    """`model` (transformers') or the native model holding its weights, as `impl` asks; the choice is logged."""
    name = type(model).__name__
    if impl == "transformers":
        log.info("model %s: transformers' modeling code (model_impl='transformers')", name)
        return model
    why_not = llama.unsupported(model)
    if why_not is not None:
        if impl == "native":
            raise ValueError(f"model_impl='native': {name} cannot run natively: {why_not}; use 'auto' or 'transformers'")
        log.info("model %s: transformers' modeling code (native: %s)", name, why_not)
        return model
    log.info("model %s: native implementation (model_impl=%r)", name, impl)
    return llama.from_transformers(model)


def is_native(model: torch.nn.Module) -> bool:
    return getattr(model, "native", False)
