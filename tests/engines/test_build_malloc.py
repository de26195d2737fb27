"""engines/malloc.return_large_blocks: after it, freed activation-sized blocks leave the process
instead of staying in glibc's heap (the build's verification peak, docs/performance.md)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import numpy as np
from tandem.engines.malloc import return_large_blocks
if sys.argv[1] == "fixed":
    assert return_large_blocks()
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) >> 10
big = np.ones(24 << 18, np.float32); del big        # a 24 MiB free: glibc raises its threshold to it
before = anon()
blocks, pins = [], []
for i in range(40):
    blocks.append(np.ones(2 << 18, np.float32))     # 2 MiB each: served from the heap now
    pins.append(np.ones(16, np.float32))            # a small live object after each keeps the heap's top
del blocks
print(anon() - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_large_blocks_leave_the_process():
    def retained(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                  check=True).stdout)
    assert retained("dynamic") >= 16        # the case this guards against: 40 freed 2 MiB blocks stay
    assert retained("fixed") <= 4
