"""Keep a CPU engine's freed activations in the heap, for the next step to reuse.

A step's large tensors (a prefill chunk's MLP activations, the logits of a decode step: tens of MB) are above glibc's
mmap threshold (at most 32 MiB, adjusted as chunks are freed), and what is freed at the heap's top is trimmed back to
the kernel: every step maps them afresh and page-faults every page of them again. `keep_freed_memory` raises both
thresholds for the process (`mallopt`), as the engine process and an `LLM` on a CPU want: allocations up to
`HEAP_BYTES` come from the heap, and it keeps up to `KEEP_BYTES` of freed memory at its top. The cost, for the whole
process: memory freed stays resident (the main heap's top up to `KEEP_BYTES`; a thread's heap, at most 64 MiB, is not
trimmed at all). Left alone where the process is not on glibc, or its user set glibc's malloc (any `MALLOC_*_`
variable, e.g. `MALLOC_TRIM_THRESHOLD_=131072` to keep glibc's behaviour; `GLIBC_TUNABLES`) or preloaded another
allocator. A glibc that refuses an mmap threshold above 32 MiB gets 32 MiB.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

#: Largest allocation served from the heap: a step's activations and logits (and a layer's K or V cache up to it).
HEAP_BYTES = 256 << 20
#: The largest mmap threshold some glibc versions accept (HEAP_MAX_SIZE / 2 on 64-bit).
_OLD_GLIBC_MAX = 32 << 20
#: Free memory the heap's top keeps before returning it to the kernel.
KEEP_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_kept: bool | None = None  # process-wide, as the thresholds are: decided once


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to `HEAP_BYTES` and its trim threshold to `KEEP_BYTES` (once a process); whether
    they are set."""
    global _kept
    if _kept is None:
        reason = _users_choice()
        _kept = reason is None and _set_thresholds()
        if _kept:
            log.info("CPU: allocations up to %d MiB come from the heap and up to %d MiB freed stays there (glibc "
                     "mallopt)", HEAP_BYTES >> 20, KEEP_BYTES >> 20)
        else:
            log.info("CPU: the allocator's thresholds left as they are (%s)", reason or "mallopt refused")
    return _kept


def _users_choice() -> str | None:
    """What says the allocator is not glibc's as it comes, if anything."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return "MALLOC_* set"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES set"
    if os.environ.get("LD_PRELOAD", ""):
        return "LD_PRELOAD set"
    return None


def _set_thresholds() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, HEAP_BYTES) or mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MAX)
    return bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
