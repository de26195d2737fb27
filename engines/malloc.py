"""Large freed blocks go back to the OS at once (glibc), for the build's verification.

glibc serves a request above its mmap threshold (128 KiB at start) with its own mapping, and
unmaps it on free. But each such free raises the threshold to the freed size (up to 32 MiB), so
after a graph's first run its tens-of-MB activations come from the heap instead, where freed
blocks stay resident and fragment. The build's verification runs a different graph (reference,
then engine) per engine file, each with other activation sizes, and the process kept hundreds
of MB of freed heap: on a 150M model the peak anonymous memory of a unified round's file was
851 MiB with the dynamic threshold and 550 MiB with it fixed (and ONNX Runtime's arena off).

Fixing the threshold costs a page-fault pass per large buffer per run: the verification runs
each graph a few times; serving processes do not call this."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3          # glibc's malloc.h
_THRESHOLD = 1 << 20            # blocks of 1 MiB and more are mapped, and unmapped when freed


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; False where the C library is not
    glibc (the setting is then left as it is)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError) as e:
        log.debug("mallopt unavailable: %s", e)
        return False
