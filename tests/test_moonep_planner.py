"""MoonEP planner: invariants on random and pathological routings (hypothesis), exact agreement with an
independent pure-Python transcription of the greedy (K3_SPEC §9), the report's worked example, Theorem 2's
instance, and the optimum of an integer program on small cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.parallel.moonep import num_slots, phase_a, plan, plan_counts
from k3.parallel.moonep.milp import lognormal_counts, max_remote_experts, milp_cases, milp_min_max_remote


# ---- an independent, loop-by-loop reference of the greedy (lists, no tensors) ---------------------------
def ref_alloc(cnt: list[int], R: int, C: int) -> list[list[int]]:
    E = len(cnt)
    epn = E // R
    bal = [sum(cnt[h * epn:(h + 1) * epn]) - C for h in range(R)]
    z = [[0] * R for _ in range(R)]
    while True:
        h = max(range(R), key=lambda i: (bal[i], -i))
        u = min(range(R), key=lambda i: (bal[i], i))
        if bal[h] <= 0:
            break
        amt = -bal[u]
        z[h][u] += amt
        bal[h] -= amt
        bal[u] = 0
    alloc = [[0] * R for _ in range(E)]
    for h in range(R):
        rem = cnt[h * epn:(h + 1) * epn]
        q = list(z[h])
        for j in range(epn):
            alloc[h * epn + j][h] = rem[j]
        while True:
            d = max(range(R), key=lambda i: (q[i], -i))
            if q[d] <= 0:
                break
            j = max(range(epn), key=lambda i: (rem[i], -i))
            take = min(rem[j], q[d])
            rem[j] -= take
            q[d] -= take
            alloc[h * epn + j][h] -= take
            alloc[h * epn + j][d] += take
    return alloc


def ref_dst(topk: list[list[list[int]]], E: int, R: int, padding: int):
    """Per-rank slot addresses from the written-out rules (§2.4–2.5 of the notes)."""
    S, K = len(topk[0]), len(topk[0][0])
    epn, C = E // R, S * K
    nvs = math.ceil((C + (padding - 1) * 2 * epn) / padding) * padding
    cnt = [0] * E
    for r in range(R):
        for row in topk[r]:
            for e in row:
                cnt[e] += 1
    alloc = ref_alloc(cnt, R, C)
    etc = [[e for e in range(E) if alloc[e][d] > 0 and e // epn != d] for d in range(R)]
    off, cu = [dict() for _ in range(R)], []
    for d in range(R):
        groups = [d * epn + g for g in range(epn)] + etc[d] + [None] * (epn - len(etc[d]))
        pos, ends = 0, []
        for e in groups:
            n = alloc[e][d] if e is not None else 0
            if e is not None:
                off[d][e] = pos
            pos += -(-n // padding) * padding
            ends.append(pos)
        cu.append(ends)
    seen = [0] * E
    dst = []
    for r in range(R):
        out = []
        for row in topk[r]:
            for e in row:
                g, acc, d = seen[e], 0, 0
                while acc + alloc[e][d] <= g:
                    acc += alloc[e][d]
                    d += 1
                out.append(d * nvs + off[d][e] + g - acc)
                seen[e] += 1
        dst.append(out)
    return alloc, etc, cu, dst, nvs


# ---- routings --------------------------------------------------------------------------------------------
PATTERNS = ["uniform", "single_hot", "one_group_hot", "one_rank_hot", "empty_experts", "duplicates",
            "power_law", "all_remote", "balanced"]


def routing(pattern: str, R: int, S: int, K: int, E: int, seed: int) -> torch.Tensor:
    """[R, S, K] expert ids (duplicates within a token allowed unless the pattern says otherwise)."""
    g = torch.Generator().manual_seed(seed)
    epn = E // R
    if pattern == "uniform":
        return torch.randint(0, E, (R, S, K), generator=g)
    if pattern == "single_hot":
        return torch.zeros(R, S, K, dtype=torch.long)
    if pattern == "one_group_hot":
        return torch.randint(0, epn, (R, S, K), generator=g)
    if pattern == "one_rank_hot":  # rank 0 routes everything to a random group's experts; others uniform
        t = torch.randint(0, E, (R, S, K), generator=g)
        t[0] = torch.randint(0, epn, (S, K), generator=g) + epn * int(torch.randint(0, R, (1,), generator=g))
        return t
    if pattern == "empty_experts":  # only every third expert is used
        used = torch.arange(0, E, 3)
        return used[torch.randint(0, used.numel(), (R, S, K), generator=g)]
    if pattern == "duplicates":  # every token repeats one expert K times
        return torch.randint(0, E, (R, S, 1), generator=g).expand(R, S, K).clone()
    if pattern == "power_law":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        p = p[torch.randperm(E, generator=g)]
        return torch.multinomial(p, R * S * K, replacement=True, generator=g).view(R, S, K)
    if pattern == "all_remote":
        r = torch.arange(R).view(R, 1, 1)
        return ((r + 1) % R) * epn + (torch.arange(S).view(1, S, 1) + torch.arange(K)) % epn
    if pattern == "balanced":  # each expert gets the same count; every group fits at home
        return (torch.arange(R * S * K) % E)[torch.randperm(R * S * K, generator=g)].view(R, S, K)
    raise ValueError(pattern)


def all_plans(topk: torch.Tensor, E: int, padding: int):
    R = topk.shape[0]
    tpe = torch.stack([torch.bincount(t.reshape(-1), minlength=E) for t in topk])
    return [plan(topk[r], tpe, r, padding) for r in range(R)]


def check_invariants(topk: torch.Tensor, E: int, padding: int) -> None:
    R, S, K = topk.shape
    epn, C = E // R, S * K
    plans = all_plans(topk, E, padding)
    p0 = plans[0]
    cnt = torch.bincount(topk.reshape(-1), minlength=E)
    alloc = p0.alloc
    assert (alloc >= 0).all()
    assert torch.equal(alloc.sum(1), cnt), "work conserved per expert"
    assert (alloc.sum(0) == C).all(), "every rank executes exactly S·K entries"
    home = torch.arange(E) // epn
    for d in range(R):
        remote = [e for e in range(E) if alloc[e, d] > 0 and home[e] != d]
        assert len({int(home[e]) for e in remote}) <= 1, "remote entries from at most one home group"
        assert len(remote) <= epn, "Theorem 1"
        assert p0.experts_to_copy[d].tolist() == remote + [-1] * (epn - len(remote))
    fits = (cnt.view(R, epn).sum(1) == C).all()
    if fits:
        assert torch.equal(alloc, torch.where(home[:, None] == torch.arange(R), cnt[:, None], 0)), "no migration"
    assert p0.nvs == num_slots(S, K, E, R, padding) and p0.nvs % padding == 0
    assert (p0.cu_seqlens[:, -1] <= p0.nvs).all(), "NvS bound"
    assert (p0.cu_seqlens % padding == 0).all() and (p0.cu_seqlens.diff(dim=1) >= 0).all()
    # entry level: every slot used once, all entries of a rank land in their expert's segment
    dst = torch.cat([p.dst for p in plans])
    assert dst.unique().numel() == dst.numel()
    assert torch.equal(torch.bincount(dst // p0.nvs, minlength=R), torch.full((R,), C))
    ent = topk.reshape(-1)
    for d in range(R):
        mine = dst // p0.nvs == d
        loff, e = dst[mine] % p0.nvs, ent[mine]
        groups = [d * epn + g for g in range(epn)] + p0.experts_to_copy[d].tolist()
        cu = [0] + p0.cu_seqlens[d].tolist()
        for gi, ge in enumerate(groups):
            rows = loff[e == ge] if ge >= 0 else torch.empty(0, dtype=torch.long)
            n = int(alloc[ge, d]) if ge >= 0 else 0
            assert rows.numel() == n and (rows.numel() == 0 or (rows.min() >= cu[gi] and rows.max() < cu[gi] + n))
            zs, zn = p0.zero_fill_ranges[d, gi].tolist()
            assert (zs, zn) == ((cu[gi] + n, cu[gi + 1] - cu[gi] - n) if cu[gi + 1] - cu[gi] > n else (0, 0))
    # dedup: an entry is re-encoded iff an earlier k of its token reaches the same rank
    for p in plans:
        dest = (p.dst // p.nvs).view(S, K)
        for s in range(S):
            for k in range(K):
                dup = bool((dest[s, :k] == dest[s, k]).any())
                v = int(p.dst_encoded[s * K + k])
                assert v == (-int(p.dst[s * K + k]) - 1 if dup else int(p.dst[s * K + k]))
    # exact agreement with the loop reference
    r_alloc, r_etc, r_cu, r_dst, r_nvs = ref_dst(topk.tolist(), E, R, padding)
    assert alloc.tolist() == r_alloc and r_nvs == p0.nvs
    assert p0.cu_seqlens.tolist() == r_cu
    assert [p.dst.tolist() for p in plans] == r_dst


@settings(max_examples=60, deadline=None)
@given(R=st.sampled_from([1, 2, 3, 4, 8]), epn=st.integers(1, 5), S=st.integers(1, 9), K=st.integers(1, 5),
       pattern=st.sampled_from(PATTERNS), padding=st.sampled_from([1, 4, 8]), seed=st.integers(0, 10_000))
def test_planner_properties(R, epn, S, K, pattern, padding, seed):
    check_invariants(routing(pattern, R, S, K, R * epn, seed), R * epn, padding)


@settings(max_examples=80, deadline=None)
@given(R=st.sampled_from([2, 4, 8, 16]), epn=st.integers(1, 6), C=st.integers(1, 60), sigma=st.floats(0, 4),
       seed=st.integers(0, 10_000))
def test_plan_counts_lognormal(R, epn, C, sigma, seed):
    """Count level on lognormal loads (the benchmark's imbalance model), incl. one-hot extremes."""
    E = R * epn
    g = torch.Generator().manual_seed(seed)
    p = torch.exp(sigma * torch.randn(E, generator=g, dtype=torch.float64))
    cnt = torch.bincount(torch.multinomial(p, R * C, replacement=True, generator=g), minlength=E)
    alloc = plan_counts(cnt, R, C)
    assert alloc.tolist() == ref_alloc(cnt.tolist(), R, C)
    assert torch.equal(alloc.sum(1), cnt) and (alloc.sum(0) == C).all()
    home = torch.arange(E) // epn
    for d in range(R):
        donors = home[(alloc[:, d] > 0) & (home != d)].unique()
        assert donors.numel() <= 1


def test_worked_example():
    """R=4, E=8, C=10, group loads (18,12,6,4): b=(8,2,−4,−6); group0→rank3 6, group0→rank2 4, group1→rank0 2."""
    cnt = torch.tensor([10, 8, 7, 5, 3, 3, 2, 2])
    z = phase_a(cnt.view(4, 2).sum(1), 10)
    expect = torch.zeros(4, 4, dtype=torch.long)
    expect[0, 3], expect[0, 2], expect[1, 0] = 6, 4, 2
    assert torch.equal(z, expect)
    alloc = plan_counts(cnt, 4, 10)
    # phase B: in group 0 expert 0 (10) fills rank 3's quota 6, then expert 1 (8) fills rank 2's 4
    assert alloc.tolist() == [[4, 0, 0, 6], [4, 0, 4, 0], [2, 5, 0, 0], [0, 5, 0, 0],
                              [0, 0, 3, 0], [0, 0, 3, 0], [0, 0, 0, 2], [0, 0, 0, 2]]


@pytest.mark.parametrize("R,epn", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_theorem2_instance(R, epn):
    """Rank 0's home experts get nothing; the other E(R−1)/R experts share R·S·K entries evenly. Any plan
    needs ≥ ⌈E(R−1)/R²⌉ remote experts on rank 0 (each carries at most R·C/(E(R−1)/R) entries of C)."""
    E = R * epn
    n_hot = E - epn
    C = n_hot * 3  # R·C divisible by n_hot
    cnt = torch.zeros(E, dtype=torch.long)
    cnt[epn:] = R * C // n_hot
    alloc = plan_counts(cnt, R, C)
    m0 = int((alloc[epn:, 0] > 0).sum())
    bound = math.ceil(E * (R - 1) / R**2)
    assert m0 >= bound and m0 <= epn
    assert int(alloc[:, 0].sum()) == C


# ---- integer program: the optimum of min_P max_r m_r(P) (k3.parallel.moonep.milp) ----------------------------
def test_milp_lower_bound():
    """The planner never beats the integer optimum, stays ≤ E/R, and we record the ratio."""
    ratios = []
    for R, E, C, sigma, seed in milp_cases()[::3]:
        cnt = lognormal_counts(E, R * C, sigma, seed)
        greedy = max_remote_experts(plan_counts(cnt, R, C))
        opt = milp_min_max_remote(cnt.tolist(), R, C)
        assert opt <= greedy <= E // R
        ratios.append(greedy / max(opt, 1))
    assert len(ratios) == 6


TRITON_CHECK = """
import torch
from k3.parallel.moonep.planner import plan_counts
from k3.parallel.moonep.planner_triton import plan_counts_triton
cases = [(4, 2, 10, 0.0), (2, 4, 24, 1.0), (8, 3, 40, 3.0), (4, 5, 7, 2.0), (16, 2, 30, 1.5), (2, 1, 5, 0.0),
         (3, 4, 9, 6.0), (8, 1, 3, 8.0)]
n = 0
for i, (R, epn, C, s) in enumerate(cases):
    E = R * epn
    g = torch.Generator().manual_seed(i)
    p = torch.exp(s * torch.randn(E, generator=g, dtype=torch.float64))
    for cnt in (torch.bincount(torch.multinomial(p, R * C, replacement=True, generator=g), minlength=E),
                torch.zeros(E, dtype=torch.long).index_fill_(0, torch.tensor([E - 1]), R * C)):
        a, b = plan_counts_triton(cnt, R, C), plan_counts(cnt, R, C, backend="torch")
        assert torch.equal(a, b), (R, epn, C, s, cnt.tolist(), a.tolist(), b.tolist())
        n += 1
print("OK", n)
"""


def test_triton_kernel_matches_torch():
    """The single-program Triton planner (interpreted on CPU) makes exactly the torch path's decisions."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK 16" in r.stdout, r.stderr[-2000:]


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_experts=6"):
        plan_counts(torch.ones(6, dtype=torch.long), 4, 1)
    with pytest.raises(ValueError, match="sum to"):
        plan_counts(torch.ones(8, dtype=torch.long), 4, 3)
    with pytest.raises(ValueError, match="backend"):
        plan_counts(torch.ones(8, dtype=torch.long), 4, 2, backend="cuda")
    with pytest.raises(ValueError, match="rank=2"):
        plan(torch.zeros(2, 2, dtype=torch.long), torch.tensor([[4, 0], [0, 4]]), 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_plan_no_host_sync_matches_cpu():
    """The GPU plan (Triton greedy) runs under sync-debug 'error' and inside a CUDA graph, and equals the CPU plan."""
    R, S, K, E = 8, 256, 8, 64
    topk = routing("power_law", R, S, K, E, 5)
    tpe = torch.stack([torch.bincount(t.reshape(-1), minlength=E) for t in topk])
    ref = plan(topk[3], tpe, 3, 16)
    it, tt = topk[3].cuda(), tpe.cuda()
    plan(it, tt, 3, 16)  # compile / warm up
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = plan(it, tt, 3, 16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = plan(it, tt, 3, 16)
    g.replay()
    torch.cuda.synchronize()
    for p in (got, cap):
        for f in ("alloc", "experts_to_copy", "cu_seqlens", "zero_fill_ranges", "remote_stats", "dst", "dst_encoded"):
            assert torch.equal(getattr(p, f).cpu(), getattr(ref, f)), f
