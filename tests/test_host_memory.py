"""Freed host memory kept for the next step (stages/host_memory.py): with the thresholds set, a 20 MiB block
comes from the heap instead of its own mapping and stays with the process once freed; without them, glibc maps
it and unmaps it on free. Each case runs in a fresh interpreter (the setting is process-wide and for good)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import ctypes, sys
from stages.host_memory import retain_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
applied = retain_freed_memory(int(sys.argv[1]))
before = libc.mallinfo2().hblks  # blocks with a mapping of their own (the interpreter has some)
block = libc.malloc(20 << 20)
ctypes.memset(block, 1, 20 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(applied, mapped, libc.mallinfo2().fordblks >> 20)  # free MiB the heap keeps
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")


def probe(keep_mb: int) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(keep_mb)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@glibc
def test_a_freed_block_stays_with_the_process():
    applied, mapped, kept_mb = probe(256)
    assert applied and mapped == 0 and kept_mb >= 20


@glibc
def test_zero_leaves_the_allocator_as_it_is():
    applied, mapped, kept_mb = probe(0)
    assert not applied and mapped == 1 and kept_mb < 20


@pytest.mark.parametrize("bad", [-1, 2048, 1.5, True, "256"])
def test_the_engine_setting_is_checked(bad):
    with pytest.raises(ValueError, match="engine.host_memory_keep_mb must be a whole number of MiB from 0"):
        EngineConfig(models=(), host_memory_keep_mb=bad)
