"""MoonEP planner (K3_SPEC §9): strictly balanced token–expert allocation and the per-entry slot layout.

Every EP rank executes exactly C = S·K real entries whatever the routing. Overloaded home groups (rank h's
home experts are [h·E/R, (h+1)·E/R)) hand entries to underloaded ranks:

- phase A (between groups): the most overloaded group fills the emptiest destination exactly to C (lowest
  index wins ties); a filled destination is never picked again, so its remote entries all come from one home
  group and it hosts ≤ E/R remote experts (Theorem 1);
- phase B (inside a group): the expert with most remaining entries goes to the destination with the largest
  remaining quota, moving the smaller of the two.

Both phases run a fixed number of masked steps (R−1, then E/R + R − 1), so the torch path needs no host
synchronisation and is CUDA-graph capturable. `plan` turns the count-level `alloc` into slots: entries of
expert e are numbered source-rank-major (rank 0's entries in flat (s, k) order, then rank 1's, …); entry g
of e goes to the first rank d with Σ_{r≤d} alloc[e, r] > g. Each rank's NvS slot rows hold 2·E/R groups
(its home experts, then its prefetch slots), each padded to a multiple of `padding`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def align_up(x: int, p: int) -> int:
    return (x + p - 1) // p * p


def num_slots(S: int, K: int, num_experts: int, num_ranks: int, padding: int) -> int:
    """NvS = align_up(S·K + (p−1)·2·E/R, p): ≤ 2·E/R non-empty groups per rank, each wasting < p rows."""
    return align_up(S * K + (padding - 1) * 2 * (num_experts // num_ranks), padding)


def _check_geometry(num_experts: int, num_ranks: int, capacity: int | None = None) -> None:
    if num_ranks < 1 or num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ranks={num_ranks}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity={capacity} must be ≥ 1")


def phase_a(group_tokens: torch.Tensor, capacity: int) -> torch.Tensor:
    """Between home groups: z[h, u] = entries home group h sends to rank u. group_tokens [R] sums to R·C."""
    R = group_tokens.numel()
    bal = group_tokens.long() - capacity
    z = torch.zeros(R, R, dtype=torch.long, device=bal.device)
    for _ in range(R - 1):  # ≤ R−1 moves: each fills one receiver for good
        h, u = torch.argmax(bal), torch.argmin(bal)  # first index on ties
        amt = torch.where(bal[h] > 0, -bal[u], 0)
        z.index_put_((h, u), amt, accumulate=True)
        bal = bal.index_put((h,), -amt, accumulate=True).index_put((u,), amt, accumulate=True)
    return z


def phase_b(counts: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Inside every group at once: counts [R, epn], quotas z [R, R] → moved [R, epn, R] (to other ranks)."""
    R, epn = counts.shape
    rem, q = counts.long().clone(), z.clone()
    moved = torch.zeros(R, epn, R, dtype=torch.long, device=counts.device)
    rows = torch.arange(R, device=counts.device)
    for _ in range(epn + R - 1):  # each step empties an expert or a quota
        ei, di = rem.argmax(1), q.argmax(1)
        take = torch.minimum(rem[rows, ei], q[rows, di]).clamp_min(0)
        rem[rows, ei] -= take
        q[rows, di] -= take
        moved[rows, ei, di] += take
    return moved


_TRITON = {"status": "untried"}  # "ok" after the first successful GPU launch, or the error that disabled it


def plan_counts(tokens_per_expert: torch.Tensor, num_ranks: int, capacity: int, backend: str = "auto") -> torch.Tensor:
    """Count-level plan: tokens_per_expert [E] global counts summing to num_ranks·capacity → alloc [E, R].

    alloc[e, r] = entries of expert e executed on rank r; Σ_r alloc[e] = counts[e], Σ_e alloc[:, r] = capacity.
    Sizes are checked; the sum is checked only on CPU (on GPU that would be a host sync). backend: "torch",
    "triton" (one single-program kernel), or "auto" (Triton on CUDA when it works, else torch; a failed
    Triton launch is reported once with a warning and the torch path is used from then on).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and tokens_per_expert.is_cuda
                                         and _TRITON["status"] in ("untried", "ok"))
    if use_triton:
        _check_geometry(tokens_per_expert.numel(), num_ranks, capacity)
        try:
            from .planner_triton import plan_counts_triton
            out = plan_counts_triton(tokens_per_expert, num_ranks, capacity)
            _TRITON["status"] = "ok"
            return out
        except Exception as e:  # noqa: BLE001
            if backend == "triton":
                raise
            import warnings
            _TRITON["status"] = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"MoonEP Triton planner unavailable ({_TRITON['status']}); using the torch path")
    return _plan_counts_torch(tokens_per_expert, num_ranks, capacity)


def _plan_counts_torch(tokens_per_expert: torch.Tensor, num_ranks: int, capacity: int) -> torch.Tensor:
    E = tokens_per_expert.numel()
    _check_geometry(E, num_ranks, capacity)
    cnt = tokens_per_expert.reshape(num_ranks, E // num_ranks).long()
    if cnt.device.type == "cpu":
        if int(cnt.min()) < 0 or int(cnt.sum()) != num_ranks * capacity:
            raise ValueError(f"tokens_per_expert must be ≥ 0 and sum to num_ranks·capacity = "
                             f"{num_ranks * capacity}, got sum {int(cnt.sum())}, min {int(cnt.min())}")
    z = phase_a(cnt.sum(1), capacity)
    moved = phase_b(cnt, z)  # [R(home), epn, R(dest)]
    home = cnt - moved.sum(2)
    moved[torch.arange(num_ranks), :, torch.arange(num_ranks)] += home
    return moved.reshape(E, num_ranks)


@dataclass(frozen=True)
class MoonEPPlan:
    """One rank's plan. Layout tables are global ([R, …], identical on every rank); dst is this rank's.

    dst [S·K]: global slot d·NvS + row of each own entry (flat (s, k)); dst_encoded: the same with a token's
    later entries on an already-used destination rank re-encoded as −dst−1 (they share the primary's row).
    experts_to_copy [R, E/R]: remote experts each rank hosts, ascending, −1 padded. cu_seqlens [R, 2·E/R]:
    padded inclusive ends of the groups (home experts, then slots); zero_fill_ranges [R, 2·E/R, 2]:
    (pad start, pad rows) or (0, 0); remote_stats [R, 2]: (#remote experts hosted, #replicas of own experts).
    """
    S: int
    K: int
    E: int
    R: int
    rank: int
    padding: int
    nvs: int
    tokens_per_expert: torch.Tensor  # [R, E] per source rank
    alloc: torch.Tensor              # [E, R]
    experts_to_copy: torch.Tensor    # [R, epn]
    cu_seqlens: torch.Tensor         # [R, 2·epn]
    zero_fill_ranges: torch.Tensor   # [R, 2·epn, 2]
    remote_stats: torch.Tensor       # [R, 2]
    dst: torch.Tensor                # [S·K]
    dst_encoded: torch.Tensor        # [S·K]

    @property
    def epn(self) -> int:
        return self.E // self.R

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[self.rank]


def plan(topk_idx: torch.Tensor, tokens_per_expert: torch.Tensor, rank: int, padding: int = 1,
         backend: str = "auto") -> MoonEPPlan:
    """Full plan for this rank: topk_idx [S, K] (own routing; a token may repeat an expert), tokens_per_expert
    [R, E] (every rank's bincount, e.g. all-gathered) → MoonEPPlan. Pure tensor code, no collectives."""
    if topk_idx.dim() != 2 or tokens_per_expert.dim() != 2:
        raise ValueError(f"expected topk_idx [S, K] and tokens_per_expert [R, E], got "
                         f"{tuple(topk_idx.shape)} and {tuple(tokens_per_expert.shape)}")
    S, K = topk_idx.shape
    R, E = tokens_per_expert.shape
    _check_geometry(E, R, S * K)
    if not 0 <= rank < R or padding < 1:
        raise ValueError(f"rank={rank} must be in [0, {R}) and padding={padding} ≥ 1")
    dev, epn, C = topk_idx.device, E // R, S * K
    nvs = num_slots(S, K, E, R, padding)
    tpe = tokens_per_expert.long()
    alloc = plan_counts(tpe.sum(0), R, C, backend)  # [E, R]
    ranks, experts = torch.arange(R, device=dev), torch.arange(E, device=dev)
    home = experts // epn

    # experts_to_copy: remote experts with alloc > 0 per destination, ascending id (≤ epn by Theorem 1).
    remote = (alloc.T > 0) & (home[None, :] != ranks[:, None])  # [R, E]
    pos = torch.where(remote, remote.cumsum(1) - 1, epn)  # overflow column epn is dropped
    etc = torch.full((R, epn + 1), -1, dtype=torch.long, device=dev)
    etc.scatter_(1, pos, torch.where(remote, experts[None, :], -1))
    etc = etc[:, :epn].contiguous()

    # Group sizes per destination: home experts then slots; padded segments and inclusive ends.
    local_cnt = alloc.reshape(R, epn, R)[ranks, :, ranks]  # [R, epn]: alloc[d·epn + g, d]
    slot_cnt = torch.where(etc >= 0, alloc[etc.clamp_min(0), ranks[:, None]], 0)
    cnt = torch.cat([local_cnt, slot_cnt], 1)  # [R, 2·epn]
    padded = (cnt + padding - 1) // padding * padding
    cu = padded.cumsum(1)
    start = cu - padded
    zero_fill = torch.stack([torch.where(padded > cnt, start + cnt, 0), padded - cnt], -1)
    valid = etc >= 0
    replicas = torch.zeros(R, dtype=torch.long, device=dev).index_add_(
        0, torch.where(valid, etc // epn, 0).reshape(-1), valid.long().reshape(-1))
    remote_stats = torch.stack([valid.sum(1), replicas], 1)
    # expert_off[d, e]: start of e's segment on d (local groups, then slots; junk where e has no group there).
    expert_off = torch.zeros(R, E + 1, dtype=torch.long, device=dev)
    expert_off[ranks[:, None], ranks[:, None] * epn + torch.arange(epn, device=dev)] = start[:, :epn]
    expert_off.scatter_(1, torch.where(etc >= 0, etc, E), start[:, epn:])
    expert_off = expert_off[:, :E]

    # Per-entry global index g within its expert (source-rank-major), destination, slot.
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    own = tpe[rank]
    run_start = own.cumsum(0) - own
    occ = torch.empty_like(flat)
    occ[order] = torch.arange(C, device=dev) - run_start[flat[order]]
    g = (tpe.cumsum(0) - tpe)[rank][flat] + occ
    acum = alloc.cumsum(1)[flat]  # [C, R]
    dest = (acum <= g[:, None]).sum(1)
    before = torch.where(dest > 0, acum.gather(1, (dest - 1).clamp_min(0)[:, None]).squeeze(1), 0)
    dst = dest * nvs + expert_off[dest, flat] + (g - before)

    # Dedup: a token's later entries on a rank it already reaches share the primary's row.
    d2 = dest.reshape(S, K)
    earlier = torch.ones(K, K, dtype=torch.bool, device=dev).tril(-1)  # [k, k'] with k' < k
    dup = ((d2[:, :, None] == d2[:, None, :]) & earlier).any(-1).reshape(-1)
    return MoonEPPlan(S, K, E, R, rank, padding, nvs, tpe, alloc, etc, cu, zero_fill, remote_stats,
                      dst, torch.where(dup, -dst - 1, dst))
