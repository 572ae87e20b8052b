"""Freed tensors go back to the OS: a fixed glibc mmap threshold for every service process.

glibc serves a large allocation with its own mmap and, when it is freed, raises the mmap threshold to that
size, so the next allocations of that size come from the heap, where a freed block stays mapped unless it is at
the heap's top. A service that allocates activations and KV of varying sizes request after request (the device
agent, the verifier) then grows without leaking: the 30-minute soak (`make soak MODEL=smollm2 SOAK_S=1800`)
measured the device agent at +105 MiB after its warm-up, the same soak for 10 minutes with the threshold fixed
at 64 KiB at +16 MiB, and `tests/shared/processes/test_process_memory.py` shows the mechanism on two 20 MB
tensors. Fixing the threshold (`mallopt(M_MMAP_THRESHOLD)`, which also stops the dynamic adjustment) costs a
page-fault per large allocation; small ones (a decode step's rows) still come from the heap.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 64 * 1024


def return_freed_memory_to_os(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process; False (logged) where there is no glibc mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        log.info("no glibc mallopt here: the allocator's own policy stays")
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1)
