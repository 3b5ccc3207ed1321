"""The Triton KDA kernels compile for sm_90a (H100/H200) on any machine, GPU-only code paths included.

The CPU interpreter runs the kernels with fp32 operands only; the bf16-operand branches, the launch
settings used on the GPU and the whole Triton-to-PTX-to-SASS pipeline are exercised only here (without a
GPU) and on the GPU machine. Runs `scripts/kda_regs.py` in a fresh process (other tests bind the kernels to
the interpreter) and prints its register / spill table.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {"kda_intra_fwd_kernel", "kda_intra_bwd_kernel", "kda_recur_fwd_kernel", "kda_recur_bwd_kernel",
           "kda_decode_kernel"}


def test_kernels_compile_for_sm90():
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if not os.path.exists(ptxas):
        pytest.skip(f"{ptxas} not shipped with this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kda_regs.py")], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    print("\n" + r.stdout)
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s.*'regs': (\d+)", r.stdout, re.M)}
    assert KERNELS <= set(regs), r.stdout
    assert all(0 < n <= 255 for n in regs.values()), regs
