"""tokenmill: queue-driven LLM batch jobs on a continuous-batching engine.

Kept light on purpose: `from tokenmill import Client` must not import torch, so the heavy names are
resolved lazily on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Client", "Job", "JobResult", "InvalidRequestError", "annotate", "__version__"]

_LAZY = {
    "LLM": "tokenmill.engine.llm",
    "Client": "tokenmill.client",
    "Job": "tokenmill.queue.schemas",
    "JobResult": "tokenmill.queue.schemas",
    "annotate": "tokenmill.apps.annotate",
}

if TYPE_CHECKING:
    from tokenmill.apps.annotate import annotate
    from tokenmill.client import Client
    from tokenmill.engine.llm import LLM
    from tokenmill.queue.schemas import Job, JobResult


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
