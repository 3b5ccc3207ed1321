"""The Triton KDA kernels compile for sm_90a (H100/H200) on any machine, GPU-only code paths included.

The CPU interpreter runs the kernels with fp32 operands only; the bf16-operand branches, the launch
settings used on the GPU and the whole Triton-to-PTX-to-SASS pipeline are exercised only here (without a
GPU) and on the GPU machine. Registers and spills are printed (`python scripts/kda_regs.py` for the table).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("kda_regs", os.path.join(ROOT, "scripts", "kda_regs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_compile_for_sm90(capsys):
    tool = _tool()
    if not os.path.exists(tool.PTXAS):
        pytest.skip(f"{tool.PTXAS} not shipped with this Triton")
    names = []
    for name, fn, types, consts, warps in tool.kernels():
        r = tool.report(fn, types, consts, warps)
        assert r["regs"] is not None and 0 < r["regs"] <= 255, (name, r)
        names.append(name)
        with capsys.disabled():
            print(f"\n{name}: {r}", end="")
    assert {"kda_intra_fwd_kernel", "kda_intra_bwd_kernel", "kda_recur_fwd_kernel", "kda_recur_bwd_kernel",
            "kda_decode_kernel"} <= set(names)
