"""Peak resident memory of this process, the way the memory benchmarks and tests measure it.

Linux only: the peak resident set (``VmHWM`` of ``/proc/self/status``) is reset to the current
resident size by writing ``5`` to ``/proc/self/clear_refs``; what a piece of code adds is then
the peak after it less the resident size before. This sees every allocation (torch's CPU
allocator, Python objects, memory-mapped pages read) at page granularity, which is what a
CPU worker's memory costs, and needs no hook into the allocator.

    before = reset_peak()
    run_something()
    added = peak_since(before)
"""

from __future__ import annotations

import contextlib
import ctypes
import gc


def status_bytes(field: str) -> int:
    """A memory figure of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} is not in /proc/self/status")


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): memory that
    earlier code freed but the heap kept would otherwise stay resident and be reused unseen,
    hiding what the measured code allocates."""
    # Not glibc (no malloc_trim): nothing to trim, the measurement is only less sharp.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak() -> int:
    """Reset the peak to the resident size now (after a garbage collection and handing free
    heap pages back) and return it."""
    gc.collect()
    _release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak_since(before: int) -> int:
    """Bytes the peak resident set grew by over ``before`` (what ``reset_peak`` returned)."""
    return status_bytes("VmHWM") - before
