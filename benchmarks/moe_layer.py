"""LatentMoE layer and SiTU-GLU kernel: the previous implementation against the current one, in the same run.

- LatentMoE at k3-small sizes (D 1536, latent 768, I 512, 32 experts top-4, 2 shared experts), N tokens
  (default 32768 = 8 x 4096), bf16 autocast over fp32 master weights as in training: forward (autograd
  recording, as in training) and forward+backward. "old" = the code before the fused path, copied below (router
  GEMM on x.float(), x[token] gather, three grouped GEMMs, SiTU as torch ops, fp32 index_add combine, shared
  experts as two GEMMs), "new" = `LatentMoE.forward`; time and peak memory above what was allocated before.
- SiTU-GLU alone on [rows, I] bf16: the torch formula (autograd) vs the Triton kernels, forward and backward,
  in ms and GB/s of the minimal traffic (forward reads g, u and writes act; backward reads g, u, dact and
  writes dg, du).
- The token permutation alone: x[token] gather + index_add combine vs dispatch_rows + combine_rows.

CUDA events, median of --reps (20) after --warmup. Prints a table, writes JSON to --out.
    python benchmarks/moe_layer.py --out moe_layer.json
    python benchmarks/moe_layer.py --smoke          # tiny sizes, any device: checks that the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.model.moe import LatentMoE
from k3.ops import moe as moe_ops
from k3.ops.situ import situ_glu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402


# ---- the previous implementation (for the in-run baseline) ---------------------------------------------------
def old_situ(gate, up, beta=4.0, linear_beta=25.0):
    g, u = gate.float(), up.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def old_experts(x, topk_idx, topk_weight, w1, w2, w3, beta, linear_beta):
    N, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    if x.is_cuda and x.dtype == torch.bfloat16:
        dt = x.dtype
        ends = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0)
        offs = ends.to(torch.int32)
        xs = x[token]
        g = torch._grouped_mm(xs, w1.to(dt).transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, w3.to(dt).transpose(1, 2), offs=offs)
        ys = torch._grouped_mm(old_situ(g, u, beta, linear_beta), w2.to(dt).transpose(1, 2), offs=offs)
        y = torch.zeros(N, x.shape[-1], dtype=torch.float32, device=x.device).index_add(
            0, token, ys.float() * topk_weight.reshape(-1)[order].float().unsqueeze(-1))
        return y.to(dt)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    out = torch.zeros(N, x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = token[start:start + n]
            h = old_situ(F.linear(x[rows], w1[e]), F.linear(x[rows], w3[e]), beta, linear_beta)
            out = out.index_add(0, rows, F.linear(h, w2[e]).float()
                                * topk_weight.reshape(-1)[order[start:start + n]].unsqueeze(-1))
            start += n
    return out.to(x.dtype)


def old_forward(moe: LatentMoE, x):
    cfg, xf = moe.cfg, x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(F.linear(xf.float(), moe.gate.weight.float()))
    idx = torch.topk(scores + moe.gate.e_score_correction_bias.float(), moe.top_k, dim=-1, sorted=True).indices
    w = scores.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    y = old_experts(moe.routed_expert_down_proj(xf), idx, w, moe.experts.w1, moe.experts.w2, moe.experts.w3,
                    cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    if moe.routed_expert_norm is not None:
        y = moe.routed_expert_norm(y)
    out = moe.routed_expert_up_proj(y)
    sh = moe.shared_experts
    if sh is not None:
        out = out + sh.down_proj(old_situ(sh.gate_proj(xf), sh.up_proj(xf), sh.beta, sh.linear_beta))
    return out.reshape(x.shape)


# ---- measurements -----------------------------------------------------------------------------------------------
def make_moe(cfg, device):
    torch.manual_seed(0)
    moe = LatentMoE(cfg).to(device)
    D, L, I = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        moe.gate.weight.normal_(0, D ** -0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
        moe.experts.w1.normal_(0, L ** -0.5)
        moe.experts.w3.normal_(0, L ** -0.5)
        moe.experts.w2.normal_(0, I ** -0.5)
    return moe


def measure(fn, warmup, reps, cuda):
    """(median ms, peak MiB above the memory held before the first call)."""
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(fn, warmup, reps, cuda=cuda)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return ms, peak


def bench_layer(a, cuda, device, dtype):
    cfg = K3Config.preset("k3-tiny" if a.smoke else "k3-small").text_config
    moe = make_moe(cfg, device).train()
    x = torch.randn(a.tokens, cfg.hidden_size, device=device).to(dtype).requires_grad_()
    dout = torch.randn(a.tokens, cfg.hidden_size, device=device).to(dtype)
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        res = {}
        for name, fwd in (("old", old_forward), ("new", LatentMoE.forward)):
            def step():
                with ac:
                    out = fwd(moe, x)
                if mode != "fwd":
                    out.backward(dout)
            res[name] = measure(step, a.warmup, a.reps, cuda)
            moe.zero_grad(set_to_none=True)
            x.grad = None
        rows.append({"bench": "LatentMoE", "shape": f"N{a.tokens} D{cfg.hidden_size} L{cfg.routed_expert_hidden_size} "
                     f"I{cfg.moe_intermediate_size} E{cfg.num_experts} k{cfg.num_experts_per_token}", "mode": mode,
                     "old_ms": res["old"][0], "new_ms": res["new"][0], "speedup": res["old"][0] / res["new"][0],
                     "old_peak_mib": res["old"][1], "new_peak_mib": res["new"][1]})
    return rows


def bench_situ(a, cuda, device, dtype):
    rows = []
    for M, I in ((a.tokens * 4, 512), (a.tokens, 1024)) if not a.smoke else ((256, 64),):
        g = torch.randn(M, I, device=device, dtype=dtype) * 3
        u = torch.randn(M, I, device=device, dtype=dtype) * 10
        do = torch.randn(M, I, device=device, dtype=dtype)
        nbytes = g.element_size() * M * I
        for mode, traffic in (("fwd", 3), ("bwd", 5)):
            res = {}
            for name, backend in (("torch", "reference"), ("triton", "triton" if cuda else "torch")):
                if mode == "fwd":
                    def run():
                        with torch.no_grad():
                            situ_glu(g, u, backend=backend)
                else:
                    gl, ul = g.detach().requires_grad_(), u.detach().requires_grad_()
                    out = situ_glu(gl, ul, backend=backend)

                    def run():
                        torch.autograd.grad(out, (gl, ul), do, retain_graph=True)
                res[name] = median_ms(run, a.warmup, a.reps, cuda=cuda)
            gbs = {n: traffic * nbytes / (ms * 1e-3) / 1e9 for n, ms in res.items()}
            rows.append({"bench": "SiTU-GLU", "shape": f"[{M}, {I}] {str(dtype).split('.')[-1]}", "mode": mode,
                         "old_ms": res["torch"], "new_ms": res["triton"], "speedup": res["torch"] / res["triton"],
                         "old_gbs": gbs["torch"], "new_gbs": gbs["triton"]})
    return rows


def bench_permute(a, cuda, device, dtype):
    N, K, E, L = (a.tokens, 4, 32, 768) if not a.smoke else (64, 2, 8, 64)
    idx = torch.randint(0, E, (N, K), device=device)
    w = torch.rand(N, K, device=device, requires_grad=True)
    x = torch.randn(N, L, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(N, L, device=device, dtype=dtype)

    def old():
        order = torch.argsort(idx.reshape(-1), stable=True)
        token = order // K
        ys = x[token] * 2
        y = torch.zeros(N, L, dtype=torch.float32, device=device).index_add(
            0, token, ys.float() * w.reshape(-1)[order].unsqueeze(-1)).to(dtype)
        y.backward(dout)

    def new():
        pos, _ = moe_ops.sort_by_expert(idx, E)
        ys = moe_ops.dispatch_rows(x, pos) * 2
        moe_ops.combine_rows(ys, pos, w).backward(dout)

    res = {n: median_ms(f, a.warmup, a.reps, cuda=cuda) for n, f in (("old", old), ("new", new))}
    return [{"bench": "permute (dispatch+combine)", "shape": f"N{N} K{K} L{L}", "mode": "fwd+bwd",
             "old_ms": res["old"], "new_ms": res["new"], "speedup": res["old"] / res["new"]}]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="moe_layer.json")
    ap.add_argument("--smoke", action="store_true", help="k3-tiny sizes, 2 reps (CPU ok)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if a.smoke:
        a.tokens, a.warmup, a.reps = 64, 1, 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = bench_situ(a, cuda, device, dtype) + bench_permute(a, cuda, device, dtype)
    rows += bench_layer(a, cuda, device, dtype)
    for r in rows:
        extra = ""
        if "old_gbs" in r:
            extra = f"   {r['old_gbs']:7.0f} -> {r['new_gbs']:7.0f} GB/s"
        if "old_peak_mib" in r:
            extra = f"   peak {r['old_peak_mib']:8.0f} -> {r['new_peak_mib']:8.0f} MiB"
        print(f"{r['bench']:<27} {r['shape']:<36} {r['mode']:<8} old {r['old_ms']:8.3f} ms  new {r['new_ms']:8.3f} ms"
              f"  x{r['speedup']:5.2f}{extra}", flush=True)
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "tokens": a.tokens, "reps": a.reps, "warmup": a.warmup}
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
