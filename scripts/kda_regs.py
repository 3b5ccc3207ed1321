"""Register / spill report of the Triton KDA kernels compiled for sm_90a, without a GPU (ptxas -v).

    python scripts/kda_regs.py            # every kernel at D = 128, bf16 inputs
    python scripts/kda_regs.py --barriers # and where each kernel's CTA-wide barriers come from (source lines)
Numbers come from the local Triton's code generation: to match the GPU machine, run it with that Triton
(`pip download triton==3.6.0`, `pip install --no-deps --target /tmp/t36 ...`, `PYTHONPATH=/tmp/t36:.`).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sig(fn, types, consts):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
    return sig


def _ptxas() -> str:
    """The ptxas this Triton runs for sm_90 (its bundled 12.8 `ptxas` in 3.6, `ptxas-blackwell` in 3.9)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


PTXAS = _ptxas()


# integer arguments that are multiples of 16 at k3's shapes (head dims 128, strides of [T, H, 128] rows, state
# slots): the JIT specializes such values (tt.divisibility 16), as it does every 16-byte-aligned pointer, and the
# compiled code depends on it (vector loads, address arithmetic; the whole-row KDA backward: 5.9k instructions and
# 62 bytes of spills per thread with these hints, 12.4k and 3.2 KB without)
ALIGNED_INTS = frozenset({"K", "V", "sx", "sg", "sv", "sq", "sk", "slot_stride"})


def report(fn, types, consts, num_warps=4, aligned=ALIGNED_INTS, **opts):
    """registers, spill bytes and shared memory of `fn` compiled for sm_90a; pointers and the int arguments named in
    `aligned` are taken as multiples of 16, as the JIT specializes them. The JIT also turns an int argument equal to
    1 at launch into the constant 1 (a unit stride): give such arguments in `consts` (e.g. the row stride of a
    transposed view), or the build assumes the wrong contiguous dimension (uncoalesced loads, no layout change)."""
    sig = _sig(fn, types, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in aligned)}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **opts))
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as fh:
            fh.write(k.asm["ptx"])
        txt = subprocess.run([PTXAS, "-v", "-lineinfo", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                             capture_output=True, text=True).stderr
        sass = _sass(cubin)
        bars = barrier_lines(cubin)
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    smem = k.metadata.shared
    out = dict(regs=int(regs.group(1)) if regs else None,
               spill_st=int(spill.group(1)) if spill else None, spill_ld=int(spill.group(2)) if spill else None,
               smem=smem)
    if sass is not None:  # static SASS counts: all instructions, and the local-memory (spill) loads and stores
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
        base = [o.split(".")[0] for o in ops]
        out.update(instrs=len(ops), local=sum(o in ("LDL", "STL") for o in base),
                   shared=sum(o in ("STS", "STSM", "LDS", "LDSM") for o in base),
                   global_loads=sum(o in ("LDG", "LDGSTS") for o in base))
    if bars is not None:  # CTA-wide barriers: each a round trip through shared memory (a layout conversion, a
        out.update(bars=sum(bars.values()), bar_lines=bars)  # cross-warp reduction), by source line
    return out


def barrier_lines(cubin: str) -> dict[str, int] | None:
    """{"file:line": count} of the BAR instructions in a cubin built with `-lineinfo` (`nvdisasm -g`), or None where
    the bundled nvdisasm is missing or fails. In Triton kernels most barriers are layout conversions through shared
    memory: where tiles of two layouts meet, a dot's operands, a reduction over warps."""
    tool = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
    if not (os.path.exists(cubin) and os.path.exists(tool)):
        return None
    r = subprocess.run([tool, "-g", "-c", cubin], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    cur, out = "?", {}
    for line in r.stdout.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif re.search(r"\bBAR(\.SYNC)?\b", line):
            out[cur] = out.get(cur, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _sass(cubin: str) -> str | None:
    """`cuobjdump -sass` of a cubin with the Triton-bundled cuobjdump, or None where it is missing or fails."""
    tool = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
    if not (os.path.exists(cubin) and os.path.exists(tool)):
        return None
    r = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def kernels():
    """(name, kernel, pointer/float argument types, constexprs, warps, compile options) at D = 128 with bf16
    inputs."""
    from k3.ops.kda.triton import decode, intra, recur
    from k3.ops.kda.triton.chunk import CFG
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    flags = dict(GATE=True, BETA_SIG=True, L2=True)
    t = {n: bf for n in ("q_ptr", "k_ptr", "v_ptr", "ke_ptr", "g_ptr", "b_ptr", "w_ptr", "u_ptr", "qe_ptr", "kg_ptr",
                         "hall_ptr", "vnew_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dg_ptr", "db_ptr",
                         "o_ptr", "dsall_ptr")}
    t.update({n: f32 for n in ("alog_ptr", "dtb_ptr", "aqk_ptr", "tb_ptr", "gc_ptr", "h0_ptr", "ht_ptr", "hsel_ptr",
                               "dht_ptr", "dh0_ptr", "du_ptr", "ddtb_ptr", "dalog_ptr", "dqe_ptr", "dw_ptr",
                               "dkg_ptr", "daqk_ptr", "dgc_ptr", "da_ptr", "dd_ptr")})
    t.update({n: i32 for n in ("chunks_ptr", "cu_ptr", "coff_ptr", "slot_ptr", "idx_ptr")})
    t["s_ptr"] = f32
    t.update(scale="fp32", lower_bound="fp32")
    out = []
    mods = (intra, recur, decode)
    for name in sorted({n for m in mods for n in dir(m) if n.endswith("_kernel")}):
        fn = next(getattr(m, name) for m in mods if hasattr(m, name))
        consts = {c: v for c, v in dict(BK=128, BV=128, DOT_PREC="tf32", BF16=True, PREFETCH=True, HAS_H0=False,
                                         HAS_DHT=True, STORE_HT=True, STORE_H=True, STORE_SEL=False, HAS_IDX=True,
                                         HAS_CU=False, HAS_DTB=True, SUMMARY=False, NV=1,
                                         VB=CFG["intra_bwd_vb"], KB=32, BT=16, PRE=False, STORE_O=False,
                                         **flags).items() if c in fn.arg_names}
        if "recur" in name:
            consts["BV"] = CFG["fwd_bv"] if "fwd" in name else CFG["bwd_bv"]
        if "decode" in name:
            consts["BV"] = 64  # kda_decode_triton's default block
        warps = CFG.get({"kda_intra_fwd_kernel": "intra_warps", "kda_intra_bwd_kernel": "intra_bwd_warps",
                         "kda_recur_fwd_kernel": "fwd_warps", "kda_recur_bwd_kernel": "bwd_warps"}.get(name, ""), 4)
        out.append((name, fn, t, consts, warps, {}))
        if name == "kda_recur_fwd_kernel":  # the segment-summary specialisations (sequence splitting)
            out.append((name + "[SUMMARY]", fn, t, dict(consts, SUMMARY=True, STORE_H=False, HAS_H0=False), warps, {}))
            out.append((name + "[PRE]", fn, t, dict(consts, PRE=True, STORE_H=False, STORE_O=True), warps, {}))
        if name == "kda_intra_fwd_kernel":
            out.append((name + "[PRE]", fn, t, dict(consts, PRE=True), warps, {}))
        if name == "kda_recur_bwd_kernel":
            out.append((name + "[SUMMARY]", fn, t, dict(consts, SUMMARY=True, HAS_DHT=False, HAS_H0=True), warps,
                        {}))
    return out


def main():
    lines = "--barriers" in sys.argv[1:]  # also each kernel's barriers by source line
    for name, fn, types, consts, warps, opts in kernels():
        r = report(fn, types, consts, warps, **opts)
        where = r.pop("bar_lines", None)
        print(f"{name:34s} warps={warps} {r}", flush=True)
        if lines and where:
            print("    barriers by line: " + ", ".join(f"{k} {v}" for k, v in where.items()), flush=True)


if __name__ == "__main__":
    main()
