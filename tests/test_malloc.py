"""fedsim keeps a round's freed memory for the next round (glibc's malloc thresholds, ``fedsim.config``)."""

import pytest


def test_keep_freed_memory_serves_a_40_mb_tensor_from_the_heap_not_a_fresh_mapping():
    """``fedsim.config.keep_freed_memory`` as glibc itself counts it (``mallinfo2().hblkhd``: bytes in mmapped
    blocks): a 40 MB tensor is a fresh mapping by default (above glibc's largest dynamic threshold, 32 MB), and
    comes from the heap, whose freed memory is reused, once fedsim has set the thresholds."""
    import os
    import subprocess
    import sys

    code = """if True:
        import ctypes, sys
        import torch
        from fedsim.config import keep_freed_memory
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = Info
        except (OSError, AttributeError):
            print("no glibc"); raise SystemExit
        if sys.argv[1] == "keep" and not keep_freed_memory():
            print("unset"); raise SystemExit
        before = libc.mallinfo2().hblkhd
        t = torch.empty(10 * 2**20)  # 40 MB
        print((libc.mallinfo2().hblkhd - before) // 2**20)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    got = {}
    for mode in ("default", "keep"):
        out = subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, check=True
        )
        got[mode] = out.stdout.strip()
    if "no glibc" in got.values() or "unset" in got.values():
        pytest.skip(f"glibc's malloc (mallinfo2, mallopt) is not there: {got}")
    assert got == {"default": "40", "keep": "0"}
