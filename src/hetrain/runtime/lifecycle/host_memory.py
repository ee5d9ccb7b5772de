"""The host allocator kept from handing memory back to the kernel between steps (glibc's malloc).

A CPU tensor's memory comes from ``malloc``. glibc gives an allocation above its mmap
threshold pages of its own, and returns the free top of its heap to the kernel once it
exceeds the trim threshold; the next allocation of that size then takes fresh pages, and
each first touch of a page is a minor page fault (kernel time, on the thread that touches
it). Both thresholds move with what the process frees, so whether a step faults its activations in
again depends on the order it allocates and frees in:

    DDP step        zero_grad frees last step's gradients ──► forward reuses them      (no faults)
    hetrain step    gradients added into persistent flat buffers, the fresh ones freed
                    inside the backward ──► freed heap handed back ──► forward faults again

Measured on gpt-tiny, one rank, 8 samples (``benchmarks/host_allocator.py``; RESULTS.md, "Host
allocator: page faults per step"): with glibc's thresholds hetrain's step took 1177 minor faults and
1.9 ms of kernel time per step, DistributedDataParallel's 41 and 0.2 ms; with both raised, 13 and
0.02 ms, and hetrain's step 1.6% cheaper in CPU than DDP's instead of 4% dearer. A process's first
steps fault while its heap grows to its working size, thresholds raised or not (2 ranks of gpt-tiny,
counted per block of 5 steps: about 12,600 faults in the first block of whichever runtime runs first,
hetrain's or DDP's, then a few hundred to 2,000 in each of hetrain's next 2-4 blocks, then none); that is
not this module's doing, and a side-by-side benchmark warms both runtimes up past it. Caching allocators
do the same for device memory (CUDA's keeps freed blocks); this does it for the host's. The cost: freed host
memory stays with the process, up to ``TRIM_THRESHOLD_BYTES`` above its peak.

``tune_host_allocator`` sets both thresholds through ``mallopt`` once per process; anything other than
glibc (musl, macOS) is left alone. ``HETRAIN_HOST_MALLOC=default`` in the environment leaves glibc's
own behaviour too.

Example:
    >>> tune_host_allocator()                     # doctest: +SKIP
    'glibc mallopt: mmap threshold 1 GiB, trim threshold 1 GiB'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: allocations below this come from the heap, whose freed chunks are reused (glibc's dynamic default starts
#: at 128 KiB and follows what is freed, up to 32 MiB)
MMAP_THRESHOLD_BYTES = 1 << 30
#: free memory at the top of the heap kept instead of returned to the kernel
TRIM_THRESHOLD_BYTES = 1 << 30
#: ``HETRAIN_HOST_MALLOC=default`` leaves the allocator as it is
ENV = "HETRAIN_HOST_MALLOC"

_done: str | None = None


def tune_host_allocator() -> str:
    """Raise glibc's mmap and trim thresholds for this process (once); what was done, in words.

    Returns the same text on later calls without calling ``mallopt`` again. Never raises: where there
    is no glibc, or ``mallopt`` refuses a value, the text says so and the allocator stays as it was.
    """
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> str:
    if os.environ.get(ENV, "").strip().lower() == "default":
        return f"left as it is ({ENV}=default)"
    libc = _glibc()
    if libc is None:
        return "left as it is (not glibc)"
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = []
    for name, param, value in (("mmap", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                               ("trim", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        if mallopt(param, value) == 1:
            done.append(f"{name} threshold {_size(value)}")
        else:
            done.append(f"{name} threshold refused ({_size(value)})")
    return "glibc mallopt: " + ", ".join(done)


def _glibc() -> ctypes.CDLL | None:
    """The C library of this process, when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n % (1 << 30) == 0 else f"{n >> 20} MiB"
