"""Register / spill report of the persistent decode-block kernel (`k3.ops.moe_block`) at k3-small's width, bf16,
compiled for sm_90a without a GPU (the local Triton and ptxas, `kda_regs.report`), for each launch setting its probe
sweeps.

    python scripts/block_regs.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kda_regs import report  # noqa: E402

from k3.ops.moe_block_triton import moe_block_kernel  # noqa: E402

BF = "*bf16"
FLOATS = dict(scale="fp32", beta="fp32", linear_beta="fp32", eps="fp32")


def main() -> None:
    t = {n: BF for n in ("x_ptr", "res_ptr", "out_ptr", "win_ptr", "w1_ptr", "w3_ptr", "w2_ptr", "wsd_ptr", "wup_ptr",
                         "nw_ptr", "lat_ptr", "gu_ptr", "h_ptr", "y_ptr", "sh_ptr")}
    t.update(FLOATS, bias_ptr="*fp32", z_ptr="*fp32", idx_ptr="*i64", wt_ptr="*fp32", sc_ptr="*fp32", cnt_ptr="*i32")
    for bn, bi, bl in ((8, 4, 4), (16, 8, 8), (4, 4, 4), (8, 8, 4)):
        c = dict(D=1536, L=768, I=512, IS=1024, E=32, K=4, BE=32, HAS_BIAS=True, RENORM=True, HAS_NORM=True,
                 HAS_RES=True, BN=bn, BI=bi, BL=bl, CH=256, BLN=1024, PDL=True)
        print(f"moe_block bn {bn} bi {bi} bl {bl}: {report(moe_block_kernel, t, c)}", flush=True)


if __name__ == "__main__":
    main()
