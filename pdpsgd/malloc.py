"""CPU allocator settings for training loops (glibc's malloc): keep freed memory for the next step.

Why: glibc returns freed memory at the top of its heap to the OS once more than its trim threshold
(128 KiB, adapted up to 64 MiB) is free, and serves blocks above its mmap threshold (128 KiB,
adapted up to 32 MiB) by fresh ``mmap`` calls. A training step frees most of what it allocated
(activations, output gradients, parameter-sized gradients) and allocates it again in the next
step, so each step page-faults its working set back in: every fault is a kernel entry and a
zeroed 4 KiB page. A book-keeping step holds every layer's output gradient until the clip factors
are known (tens of MiB more than an ordinary backward holds at once), so it pays more of it.
Measured on this project's CPU benchmark machine (AMD EPYC, one thread, ``benchmarks/README.md``):
BERT-shaped ``bk`` steps took 7–19 k minor faults (25–60 ms of system time) per step, the
non-private step 1–8 k; with the thresholds below, none for either. Blocks of 32 MiB or more (the
most glibc lets the mmap threshold be), e.g. a logits tensor of B·T·V float32 (8 × 128 × 8192 is
32 MiB exactly) or a large vocabulary's embedding gradient, were still mmapped whenever the heap's
top had no room for them, and faulted in again in every step: on an Intel Xeon 2-core host
(round 29) a GPT-2-shaped T = 128 ``bk`` step took 8193 faults (one such block, 12–60 ms of system
time) in half its steps or more, and at T = 512 (128 MiB logits) both the ``bk`` and the
non-private step took 0.1–0.26 M faults in every step (150–550 ms of system time). ``mmap_max=0`` (glibc's ``M_MMAP_MAX``) serves those from the heap as well
(glibc still maps memory where the heap cannot grow: a thread's own arena, or a failed ``sbrk``;
no allocation fails for it), and they fault no more after the first steps.

This is a process-wide setting, so nothing in pdpsgd applies it on import or inside
``make_dp_step``: call :func:`tune_cpu_malloc` once at the start of a CPU training process (the
``pdpsgd train`` CLI does, on CPU). What it costs: memory freed by a step stays mapped (up to
``trim_threshold`` at the heap's top) instead of going back to the OS between steps, and blocks
that glibc used to mmap now share its heap, where fragmentation can raise the peak RSS (not
measurably at T = 128 in round 13's A/B, ``benchmarks/README.md``; torch's allocated bytes are the
same), and (``mmap_max=0``) a large block freed in the middle of the heap is reused, never
returned to the OS until the process ends. Another allocator interposed over glibc's ``malloc`` (jemalloc / tcmalloc through
``LD_PRELOAD``), musl, macOS and Windows are left alone, and so is a glibc that refuses the values:
it reports that it did nothing and why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import NamedTuple, Optional

__all__ = ["MallocSettings", "tune_cpu_malloc"]

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
# glibc refuses more (HEAP_MAX_SIZE / 2): 32 MiB where long is 64-bit, 512 KiB on 32-bit systems
MMAP_THRESHOLD_MAX = (32 << 20) if ctypes.sizeof(ctypes.c_long) == 8 else (512 << 10)


class MallocSettings(NamedTuple):
    applied: bool
    mmap_threshold: Optional[int]  # bytes; blocks this large or larger come from mmap
    trim_threshold: Optional[int]  # bytes of free heap top kept mapped
    reason: str  # what was done, or why nothing was
    mmap_max: Optional[int] = None  # glibc's M_MMAP_MAX as set (0: no block is mmapped), or None: untouched


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def _preloaded_allocator() -> Optional[str]:
    """The file of a ``malloc`` interposed over glibc's (``LD_PRELOAD``-ed jemalloc, tcmalloc, ...),
    or None: the process's ``malloc`` symbol resolves into libc itself."""
    try:
        dl = ctypes.CDLL(None)
        own = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        used = ctypes.cast(dl.malloc, ctypes.c_void_p).value
        if used == ctypes.cast(own.malloc, ctypes.c_void_p).value:
            return None
    except (OSError, AttributeError):
        return None

    class _Info(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:  # the interposer's file, for the message
        dl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Info)]
        info = _Info()
        if dl.dladdr(used, ctypes.byref(info)) and info.dli_fname:
            return os.path.basename(info.dli_fname.decode(errors="replace"))
    except (OSError, AttributeError):
        pass
    return "another allocator"


def tune_cpu_malloc(*, mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30,
                    mmap_max: Optional[int] = 0) -> MallocSettings:
    """Sets glibc's mmap threshold and trim threshold for this process (``mallopt``), so that the
    memory a training step frees is reused by the next one instead of being unmapped and faulted
    in again. Idempotent; returns what it did as :class:`MallocSettings`.

    ``mmap_threshold``: blocks at least this large are mmapped (at most 32 MiB, glibc's limit);
    ``trim_threshold``: free memory at the heap's top up to this is kept. Setting either turns off
    glibc's own adaptation of both (a documented glibc behaviour). ``mmap_max``: how many blocks
    glibc may hold mmapped at once (0, the default: none, blocks past the threshold come from the
    heap too; None: left as it is). Raises ``ValueError`` for
    values outside glibc's documented ranges (before changing anything); a glibc that refuses a
    value anyway is reported in the result (``applied=False``), not raised.
    """
    if not 0 < mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be in (0, {MMAP_THRESHOLD_MAX}] bytes (glibc's limit on this "
                         f"platform), got {mmap_threshold}")
    if not 0 < trim_threshold < 1 << 31:
        raise ValueError(f"trim_threshold must be in (0, 2**31) bytes (mallopt takes a C int), got {trim_threshold}")
    if mmap_max is not None and not 0 <= mmap_max < 1 << 31:
        raise ValueError(f"mmap_max must be None or in [0, 2**31) (mallopt takes a C int), got {mmap_max}")
    libc = _glibc()
    if libc is None:
        return MallocSettings(False, None, None, "not glibc's malloc (only glibc's is tuned)")
    other = _preloaded_allocator()
    if other is not None:
        return MallocSettings(False, None, None, f"malloc is {other}'s, not glibc's: glibc's settings would not apply")
    # one at a time: a refusal of the second leaves the first set, and the result says so
    if not libc.mallopt(M_TRIM_THRESHOLD, trim_threshold):
        return MallocSettings(False, None, None, f"glibc refused trim_threshold={trim_threshold}; nothing changed")
    if not libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold):
        return MallocSettings(False, None, trim_threshold, f"glibc refused mmap_threshold={mmap_threshold}; "
                                                           f"only the trim threshold is set")
    what = (f"glibc {libc.gnu_get_libc_version().decode()}: mmap threshold {mmap_threshold >> 20} MiB, "
            f"trim threshold {trim_threshold >> 20} MiB")
    if mmap_max is not None:
        if not libc.mallopt(M_MMAP_MAX, mmap_max):
            return MallocSettings(True, mmap_threshold, trim_threshold,
                                  f"{what}; glibc refused mmap_max={mmap_max}, left as it was")
        what += ", no mmapped blocks" if mmap_max == 0 else f", at most {mmap_max} mmapped blocks"
    return MallocSettings(True, mmap_threshold, trim_threshold, what, mmap_max)
