"""MoonEP expert parallelism on CPU (gloo, 2 and 4 spawned processes) against the single-process LatentMoE
on the same inputs and weights: outputs, input / router / expert-weight / other gradients (fp32 relative
error ≤ 1e-5), at balanced routing and extreme imbalance, with and without duplicate experts per token;
one plan per forward reused by every backward op; replica-gradient slots zero after reduce_grad; the
gathered full checkpoint equals the original one."""

from __future__ import annotations

import copy
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-5


def _rel(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return ((ref - x).norm() / ref.norm().clamp_min(1e-30)).item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moe(seed: int):
    from k3 import K3Config
    from k3.model.moe import LatentMoE

    cfg = K3Config.preset("k3-tiny").text_config
    torch.manual_seed(seed)
    m = LatentMoE(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        m.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts, generator=g) * 0.05)
    return m


def _check_model(rank: int, R: int, imbalance: str, S: int = 6) -> dict:
    """EP LatentMoE on this rank's S tokens vs the full layer on all R·S tokens."""
    from k3.parallel.moonep import ExpertParallel, full_state_dict

    ref = _moe(0)
    E, K = ref.cfg.num_experts, ref.top_k
    if imbalance == "extreme":  # every token picks experts 0..K−1: home group 0 holds all R·S·K entries
        with torch.no_grad():
            ref.gate.e_score_correction_bias[:K] += 100.0
    full_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ep_moe = copy.deepcopy(ref)
    ep = ExpertParallel(None, padding=4)
    plans = []
    ep.on_plan = plans.append
    ep_moe.set_expert_parallel(ep)
    g = torch.Generator().manual_seed(100)
    x = torch.randn(R, S, ref.cfg.hidden_size, generator=g)
    go = torch.randn(R, S, ref.cfg.hidden_size, generator=g)
    xf = x.clone().requires_grad_()
    yf = ref(xf.view(R * S, -1)).view(R, S, -1)
    (yf * go).sum().backward()
    xr = x[rank].clone().requires_grad_()
    yr = ep_moe(xr)
    assert ep.runtime.num_plans == 1
    (yr * go[rank]).sum().backward()
    assert ep.runtime.num_plans == 1 and len(plans) == 1, "backward must reuse the forward plan"
    assert plans[0].backward_uses == 4, plans[0].backward_uses  # dispatch, weights, prefetch, combine
    errs = {"out": _rel(yf[rank], yr), "dx": _rel(xf.grad[rank], xr.grad)}
    epn = E // R
    lo = rank * epn
    for name, p in ep_moe.named_parameters():
        pref = dict(ref.named_parameters())[name]
        if name.startswith("experts."):
            errs[name] = _rel(pref.grad[lo:lo + epn], p.grad)
        else:  # data-parallel parameters: partial grads per rank, summed
            gsum = p.grad.clone()
            dist.all_reduce(gsum)
            errs[name] = _rel(pref.grad, gsum)
    for buf in ep.runtime._reduce_buffers.values():
        assert buf.abs().max().item() == 0.0, "replica slots must be zero after reduce_grad"
    stats = plans[0].plan.remote_stats
    sd = full_state_dict(ep_moe)
    assert all(torch.equal(sd[k], full_sd[k]) for k in full_sd) and sd.keys() == full_sd.keys()
    assert ep_moe.experts.w1.shape[0] == epn
    return {"errs": errs, "remote": int(stats[:, 0].sum())}


def _check_functional(rank: int, R: int, routing: str, S: int = 7, K: int = 4) -> dict:
    """ExpertParallel directly vs k3.ops.moe.experts_forward, routings with duplicate experts per token;
    "+sparse" uses the sparse prefetch / reduce_grad."""
    routing, _, prefetch = routing.partition("+")
    prefetch = prefetch or "static"
    from k3.parallel.moonep import ExpertParallel
    from k3.ops.moe import experts_forward

    E, L, I = 4 * R, 16, 8
    g = torch.Generator().manual_seed(7)
    W = [torch.randn(E, I, L, generator=g) / 4, torch.randn(E, L, I, generator=g) / 3, torch.randn(E, I, L, generator=g) / 4]
    x = torch.randn(R, S, L, generator=g)
    w = torch.rand(R, S, K, generator=g) + 0.1
    if routing == "dup_balanced":
        idx = torch.randint(0, E, (R, S, K), generator=g)
        idx[:, :, 1] = idx[:, :, 0]  # every token repeats its first expert
    else:  # dup_extreme: all entries of every token on expert 1 (rank 0's group), K times
        idx = torch.ones(R, S, K, dtype=torch.long)
    go = torch.randn(R, S, L, generator=g)
    Wf = [t.clone().requires_grad_() for t in W]
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    yf = experts_forward(xf.view(R * S, L), idx.view(R * S, K), wf.view(R * S, K), *Wf)
    (yf.view(R, S, L) * go).sum().backward()
    epn = E // R
    Wr = [t[rank * epn:(rank + 1) * epn].clone().requires_grad_() for t in W]
    xr, wr = x[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
    ep = ExpertParallel(None, padding=2, prefetch=prefetch)
    yr = ep(xr, idx[rank], wr, *Wr, E)
    (yr * go[rank]).sum().backward()
    errs = {"out": _rel(yf.view(R, S, L)[rank], yr), "dx": _rel(xf.grad[rank], xr.grad),
            "dw_route": _rel(wf.grad[rank], wr.grad)}
    for i, (a, b) in enumerate(zip(Wr, Wf)):
        errs[f"dW{i + 1}"] = _rel(b.grad[rank * epn:(rank + 1) * epn], a.grad)
    for buf in ep.runtime._reduce_buffers.values():
        assert buf.abs().max().item() == 0.0
    return {"errs": errs}


def _check_full_model(rank: int, R: int, _: str, T: int = 12) -> dict:
    """k3-tiny (text) converted with enable_expert_parallel: per-rank loss on its own sequence; the summed
    loss and all gradients (expert grads arrive summed over ranks; data-parallel grads all-reduced) match
    the single-process model on the whole batch."""
    from k3 import K3Config, K3ForConditionalGeneration
    from k3.parallel.moonep import clip_grad_norm_, enable_expert_parallel, full_state_dict, sync_data_parallel_grads

    cfg = K3Config.preset("k3-tiny")
    cfg.vision_config = None
    torch.manual_seed(3)
    ref = K3ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ep_model = enable_expert_parallel(copy.deepcopy(ref), None, padding=4)
    ids = torch.randint(0, 256, (R, T), generator=g)

    def objective(m, x):
        o = m(x, labels=x)
        return o.loss + 0.1 * o.mtp_loss

    (objective(ref, ids) * R).backward()  # = Σ_r per-rank losses (equal token counts)
    loss = objective(ep_model, ids[rank:rank + 1])
    loss.backward()
    sync_data_parallel_grads(ep_model, average=False)
    tot = loss.detach().clone()
    dist.all_reduce(tot)
    ref_loss = objective(ref, ids).detach() * R
    errs = {"loss": _rel(ref_loss, tot)}
    E, epn = cfg.text_config.num_experts, cfg.text_config.num_experts // R
    refp = dict(ref.named_parameters())
    n_expert = 0
    for name, p in ep_model.named_parameters():
        if p.grad is None:
            assert refp[name].grad is None, name
            continue
        if ".experts.w" in name:
            n_expert += 1
            errs[name] = _rel(refp[name].grad[rank * epn:(rank + 1) * epn], p.grad)
        else:
            errs[name] = _rel(refp[name].grad, p.grad)
    assert n_expert >= 3 and E % R == 0
    grads = [p.grad for p in ref.parameters() if p.grad is not None]
    ref_norm = torch.sqrt(sum(g.double().square().sum() for g in grads))  # fp64 (torch's fp32 norm is off by ~1e-5)
    for g in grads:
        g.mul_(min(1.0, 0.5 / (ref_norm.item() + 1e-6)))
    errs["grad_norm"] = _rel(ref_norm, clip_grad_norm_(ep_model, 0.5))
    assert ref_norm > 0.5  # clipping is active, so the clipped grads are checked too
    for name, p in ep_model.named_parameters():
        if p.grad is not None:
            ref_g = refp[name].grad[rank * epn:(rank + 1) * epn] if ".experts.w" in name else refp[name].grad
            errs[name + ".clipped"] = _rel(ref_g, p.grad)
    full = full_state_dict(ep_model)
    assert full.keys() == sd.keys() and all(torch.equal(full[k], sd[k]) for k in sd)
    return {"errs": errs}


def _check_autocast(rank: int, R: int, _: str, S: int = 16, K: int = 3) -> dict:
    """Under bf16 autocast the EP path computes (and prefetches) in bf16 like F.linear would, returns the
    input dtype, and stays within bf16 rounding of the autocast single-process result."""
    from k3.parallel.moonep import ExpertParallel
    from k3.ops.moe import experts_forward

    E, L, I = 4 * R, 32, 16
    g = torch.Generator().manual_seed(9)
    W = [torch.randn(E, I, L, generator=g) / 5, torch.randn(E, L, I, generator=g) / 4, torch.randn(E, I, L, generator=g) / 5]
    x, idx, w = torch.randn(R, S, L, generator=g), torch.randint(0, E, (R, S, K), generator=g), torch.rand(R, S, K, generator=g)
    epn = E // R
    Wr = [t[rank * epn:(rank + 1) * epn].clone().requires_grad_() for t in W]
    Wf = [t.clone().requires_grad_() for t in W]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ExpertParallel(None, padding=4)(x[rank], idx[rank], w[rank], *Wr, E)
        yf = experts_forward(x.view(R * S, L), idx.view(R * S, K), w.view(R * S, K), *Wf).view(R, S, L)
    assert yr.dtype == yf.dtype == torch.float32
    yr.sum().backward()
    yf.sum().backward()
    bf16 = {"out": _rel(yf[rank], yr)}
    for i, (a, b) in enumerate(zip(Wr, Wf)):
        bf16[f"dW{i + 1}"] = _rel(b.grad[rank * epn:(rank + 1) * epn], a.grad)
    return {"errs": {}, "bf16": bf16}


def _worker(rank: int, R: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=R)
    try:
        res = {}
        for kind, arg in cases:
            fn = {"model": _check_model, "functional": _check_functional, "full_model": _check_full_model,
                  "autocast": _check_autocast}[kind]
            res[(kind, arg)] = fn(rank, R, arg)
        torch.save(res, os.path.join(out_dir, f"r{rank}.pt"))
        # every rank is past its last collective, its results saved; then it leaves without gloo's teardown. Twice
        # in 2-core runs of the whole suite (sessions 13 and 25, the second with a barrier here already) a rank
        # aborted in that teardown with "terminate called without an active exception" (a gloo thread still
        # joinable at its destruction) after writing its results: a crash of the exit path, not of the collectives
        # this test checks. On an error the group is still destroyed (finally) and the error raised.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:
        dist.destroy_process_group()


CASES = [("model", "balanced"), ("model", "extreme"), ("functional", "dup_balanced"), ("functional", "dup_extreme"),
         ("functional", "dup_balanced+sparse"), ("functional", "dup_extreme+sparse")]


@pytest.mark.parametrize("R", [2, 4])
def test_ep_matches_single_process(R, tmp_path):
    cases = CASES + ([("full_model", "k3-tiny"), ("autocast", "bf16")] if R == 2 else [])
    mp.spawn(_worker, args=(R, _free_port(), cases, str(tmp_path)), nprocs=R)
    for r in range(R):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert set(res) == set(cases)
        for case, v in res.items():
            bad = {k: e for k, e in v["errs"].items() if not e <= TOL}
            bad.update({k: e for k, e in v.get("bf16", {}).items() if not e <= 1e-2})
            errs = v["errs"] or v["bf16"]
            worst = max(errs, key=errs.get)
            print(f"R={R} rank={r} {case}: max rel err {errs[worst]:.2e} ({worst})")
            assert not bad, (R, r, case, bad)
        assert res[("model", "extreme")]["remote"] > 0, "the extreme case must replicate experts"
