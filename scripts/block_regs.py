"""Register / spill report of the decode MoE block's kernel (`k3.ops.moe_block`) at k3-small's width, bf16,
compiled for sm_90a without a GPU (the local Triton and ptxas, `kda_regs.report`, with its barrier count): the one
launch (PHASE 0) at the tiles its probe sweeps, and each phase of the split form at its default tiles, with the
inputs read as vectors; and the one-row GEMV (`k3.ops.gemv.triton.gemv_row_kernel`) at K = 1,536.

    python scripts/block_regs.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kda_regs import report  # noqa: E402

from k3.ops.gemv.triton import gemv_row_kernel  # noqa: E402
from k3.ops.moe_block_triton import moe_block_kernel  # noqa: E402

BF = "*bf16"
FLOATS = dict(scale="fp32", beta="fp32", linear_beta="fp32", eps="fp32")


def main() -> None:
    t = {n: BF for n in ("x_ptr", "res_ptr", "out_ptr", "win_ptr", "w1_ptr", "w3_ptr", "w2_ptr", "wsd_ptr", "wup_ptr",
                         "nw_ptr", "lat_ptr", "gu_ptr", "h_ptr", "y_ptr", "sh_ptr")}
    t.update(FLOATS, bias_ptr="*fp32", z_ptr="*fp32", idx_ptr="*i64", wt_ptr="*fp32", sc_ptr="*fp32", cnt_ptr="*i32")
    t.update({n: "i32" for n in ("s1_e", "s1_r", "s3_e", "s3_r", "s2_e", "s2_r")})
    strides = frozenset(("s1_e", "s1_r", "s3_e", "s3_r", "s2_e", "s2_r"))
    runs = [(0, bn, bi, bl) for bn, bi, bl in ((8, 4, 4), (16, 8, 8), (4, 4, 4), (8, 8, 4))]
    runs += [(p, 4, 4, 4) for p in (1, 2, 3, 4)]
    for phase, bn, bi, bl in runs:
        c = dict(D=1536, L=768, I=512, IS=1024, E=32, K=4, BE=32, HAS_BIAS=True, RENORM=True, HAS_NORM=True,
                 HAS_RES=True, BN=bn, BI=bi, BL=bl, CH=256, BLN=1024, PDL=True, PHASE=phase)
        r = report(moe_block_kernel, t, c, aligned=strides)
        r.pop("bar_lines", None)
        print(f"moe_block phase {phase} bn {bn} bi {bi} bl {bl}: {r}", flush=True)
    g = dict(x_ptr=BF, w_ptr=BF, y_ptr=BF, a_ptr=BF, t_ptr="*fp32", N="i32", sw="i32")
    r = report(gemv_row_kernel, g, dict(K=1536, BN=4, CH=256, HAS_ADD=False, NT=0, PDL=True), aligned={"sw"})
    r.pop("bar_lines", None)
    print(f"gemv_row K 1536 bn 4 ch 256: {r}", flush=True)


if __name__ == "__main__":
    main()
