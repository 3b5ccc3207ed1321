"""Instructions per program of the two KDA token-parallel backward kernels, counted from their sm_90a SASS, no GPU.

    python scripts/sass_count.py

Builds each kernel as `scripts/kda_regs.py` does (bf16, D = 128, the JIT's alignment specializations), disassembles
it (nvdisasm, shipped with Triton) and weights every instruction by the trip counts of the loops around it (backward
branches): an estimate of the instructions a program issues, per thread and times the warps. The column-block
kernel is evaluated only where its key and value blocks are equal and pass A's block is the same or the whole 128
columns, so that every loop left runs 128 / block times.
A static count, not a measurement: it says how much work each variant asks of the SM's schedulers, not how well
they hide latency.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kda_regs import ALIGNED_INTS, _sig, kernels  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def sass(fn, types, consts, warps, **opts) -> str:
    sig = _sig(fn, types, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in ALIGNED_INTS)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, **opts))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(k.asm["cubin"])
    return subprocess.run([NVDISASM, "-c", fh.name], capture_output=True, text=True, check=True).stdout


def count(text: str, trips: int) -> tuple[int, int, int]:
    """(static instructions, dynamic instructions per thread with every loop running `trips` times, dynamic
    local-memory (spill) instructions)."""
    labels, ins, pending = {}, [], []
    for line in text.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            ins.append((addr, m.group(2)))
    loops = [(labels[m.group(1)], a) for a, t in ins
             if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", t)) and labels.get(m.group(1), a + 1) < a]
    dyn = spill = 0
    for a, t in ins:
        w = trips ** sum(lo <= a <= hi for lo, hi in loops)
        dyn += w
        spill += w * bool(re.search(r"\b(LDL|STL)\b", t))
    return len(ins), dyn, spill


def main():
    ks = {k[0]: k for k in kernels()}
    _, fn, types, consts, _, _ = ks["kda_intra_bwd_kernel"]
    for warps in (4, 8):
        st, dyn, sp = count(sass(fn, types, consts, warps), 1)
        print(f"kda_intra_bwd_kernel       warps {warps}: {dyn:6d} per thread, {dyn * warps:7d} per program, "
              f"{sp} local-memory (LDL/STL)", flush=True)
    _, fn, types, consts, _, _ = ks["kda_intra_bwd_cols_kernel"]
    # (KB = VB, KA, warps, stages): KA = KB, or KA = 128 (pass A in one block: its loop over key blocks is gone)
    for kb, ka, warps, stages in ((16, 16, 4, 1), (16, 16, 2, 1), (32, 32, 4, 1), (32, 128, 4, 1), (32, 32, 8, 1),
                                  (64, 64, 8, 1)):
        st, dyn, sp = count(sass(fn, types, dict(consts, KB=kb, VB=kb, KA=ka), warps, num_stages=stages), 128 // kb)
        print(f"kda_intra_bwd_cols_kernel  KB=VB {kb:2d} KA {ka:3d} warps {warps} stages {stages}: {dyn:6d} per "
              f"thread, {dyn * warps:7d} per program, {sp} local-memory (LDL/STL)", flush=True)


if __name__ == "__main__":
    main()
