"""KDA context parallelism (K3_SPEC §9 "KCP"): the token stream is cut into contiguous per-rank segments.

Why it works: for fixed q, k, g, β the KDA recurrence S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ
is linear in (S_0, v) jointly. So a segment's final state is S̃ + P·S_in, where S̃ is the final state from a
zero start and P (K×K per head) is the segment's cumulative transition, and its outputs are
o_t = õ_t + (scale·P_tᵀ q_t)ᵀ S_in, with P_t the transition up to token t.

How we compute P and P_tᵀq without a special kernel: run the ordinary chunked op with K extra value
columns that are zero and an identity initial state in those columns ("[v | 0]" from "[S_0 | I]"). The
extra output columns are then exactly scale·P_tᵀ q_t and the extra final-state columns exactly P. So one
local chunk pass of value width V+K (or a width-V pass plus a width-K pass restricted to the first and
last local pieces, for kernels limited to V ≤ 128) yields õ, S̃, P_tᵀq and P, before any communication
(no second pass once the incoming state is known); then one all_gather of the fp32 [S̃ | P]
summaries, a sequential fp32 prefix fold S_in ← P_j S_in + S̃_j over the earlier ranks of the same
sequence, and a small matmul adds P_tᵀq · S_in to the outputs. Everything is built from differentiable
pieces (the chunk op, a custom all_gather whose backward is a reduce-scatter), so the backward mirrors the
forward with one collective. The short convolutions need the previous rank's last W−1 pre-conv inputs: a
differentiable one-hop send (`conv_halo`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.conv import short_conv
from ..ops.kda import chunk_kda, kda_gate

__all__ = ["KdaCPPlan", "plan_kda_cp", "chunk_kda_cp", "all_gather_cp", "conv_halo", "kda_layer_forward_cp"]


# ----------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class KdaCPPlan:
    """What one rank holds of the global stream (pure metadata, built by `plan_kda_cp`).

    seq_ids: the global sequence of each local piece (sequence fragment), in order; starts_here / ends_here:
    whether the piece holds its sequence's first / last token.
    local_cu: local cu_seqlens over the rank's tokens (None in batch mode, where pieces are batch rows).
    first_in: the first piece (every row in batch mode) continues a sequence from the previous rank.
    last_out: the last piece (every row in batch mode) continues on the next rank.
    chain_from: the rank holding the start of the first piece's sequence (== rank when not first_in).
    """
    rank: int
    world: int
    t_local: int
    num_seqs: int
    seq_ids: tuple[int, ...]
    starts_here: tuple[bool, ...]
    ends_here: tuple[bool, ...]
    local_cu: tuple[int, ...] | None
    first_in: bool
    last_out: bool
    chain_from: int

    @property
    def n_first(self) -> int:
        """How many local pieces receive the incoming state (and send a summary): all rows, or one piece."""
        return len(self.seq_ids) if self.local_cu is None else 1


def plan_kda_cp(cu_seqlens, t_local: int, rank: int, world: int, batch: int = 1) -> KdaCPPlan:
    """Split the global stream among `world` ranks of `t_local` tokens each and describe rank `rank`'s part.

    cu_seqlens: None (batch mode: each of the `batch` rows is one sequence cut into per-rank time
    segments) or the global packed stream's boundaries, int [N+1] from 0 to world·t_local (non-decreasing;
    an empty sequence belongs to the rank holding its position, the last rank at the very end).
    """
    if t_local < 1:
        raise ValueError(f"plan_kda_cp: every rank needs at least one token, got t_local={t_local}")
    if not 0 <= rank < world:
        raise ValueError(f"plan_kda_cp: rank {rank} outside [0, {world})")
    if cu_seqlens is None:
        return KdaCPPlan(rank, world, t_local, batch, tuple(range(batch)), (rank == 0,) * batch,
                         (rank == world - 1,) * batch, None, rank > 0, rank < world - 1, 0)
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    total = world * t_local
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"plan_kda_cp: cu_seqlens must be non-decreasing from 0 to world*t_local={total} "
                         f"({world} ranks x {t_local} tokens), got {cu}")
    if batch != 1:
        raise ValueError(f"plan_kda_cp: cu_seqlens needs one packed row (B == 1), got B={batch}")
    a, b = rank * t_local, (rank + 1) * t_local
    ids, local_cu = [], [0]
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if s == e:
            owned = min(s // t_local, world - 1) == rank
        else:
            owned = s < b and e > a
        if owned:
            ids.append(n)
            local_cu.append(min(e, b) - a)
    first, last = ids[0], ids[-1]
    first_in = cu[first] < a
    last_out = cu[last + 1] > b
    return KdaCPPlan(rank, world, t_local, len(cu) - 1, tuple(ids), tuple(cu[n] >= a for n in ids),
                     tuple(cu[n + 1] <= b for n in ids), tuple(local_cu), first_in, last_out,
                     cu[first] // t_local if first_in else rank)


# ------------------------------------------------------------------------------------- communication


class _AllGather(torch.autograd.Function):
    """[world, *x.shape] = every rank's x; backward: reduce-scatter (sum of every rank's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.numel(),))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.reshape(-1), group=group)
        return out.view((world,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        grad = grad.contiguous().clone()
        if dist.get_backend(group) == "nccl":
            gx = grad.new_empty(grad[0].numel())
            dist.reduce_scatter_tensor(gx, grad.reshape(-1), group=group)
            gx = gx.view(grad.shape[1:])
        else:  # gloo: reduce_scatter is not available on every torch version; the tensor is small
            dist.all_reduce(grad, group=group)
            gx = grad[dist.get_rank(group)]
        return gx, None


def all_gather_cp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all_gather: returns [world, *x.shape]; each rank's x gets the sum of all ranks' grads."""
    return _AllGather.apply(x, group)


def _p2p(send: torch.Tensor | None, send_to: int | None, recv: torch.Tensor | None, recv_from: int | None,
         group) -> None:
    group = dist.group.WORLD if group is None else group
    ops = []
    if send_to is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, send_to), group))
    if recv_from is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, recv_from), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _FromPrevious(torch.autograd.Function):
    """Rank r receives rank r−1's tensor (zeros on rank 0); backward sends the gradient back one hop."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        out = torch.zeros_like(x)
        _p2p(x, rank + 1 if rank + 1 < world else None, out, rank - 1 if rank > 0 else None, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        grad = grad.contiguous()
        gx = torch.zeros_like(grad)
        _p2p(grad, rank - 1 if rank > 0 else None, gx, rank + 1 if rank + 1 < world else None, group)
        return gx, None


def conv_halo(x_local: torch.Tensor, width: int, group=None) -> torch.Tensor:
    """The previous rank's last `width`−1 tokens of x [B, T_local, C] (zeros on the first rank), differentiable.

    Sequence starts inside the halo are the caller's business (`kda_layer_forward_cp` masks them).
    """
    n = width - 1
    if x_local.shape[1] < n:
        raise ValueError(f"conv_halo: each rank needs at least width-1={n} tokens, got {x_local.shape[1]}")
    return _FromPrevious.apply(x_local[:, x_local.shape[1] - n:], group)


# --------------------------------------------------------------------------------------------- op


def chunk_kda_cp(q, k, v, g, beta, group=None, *, scale=None, initial_state=None, output_final_state=False,
                 cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto", transition="auto"):
    """Context-parallel `chunk_kda`: this rank's outputs for its contiguous segment of the global stream.

    Every rank of `group` calls it with its own segment (same shapes on every rank); arguments follow
    `k3.ops.kda.chunk_kda` with local tensors:
        q, k, g [B, T_local, H, K]; v [B, T_local, H, V]; beta [B, T_local, H].
    cu_seqlens: None (each of the B rows is one sequence, cut into per-rank time segments), or the
        *global* packed stream's boundaries (int [N+1], identical on every rank, ending at world·T_local,
        B == 1). Sequences may be cut by, aligned with or span rank boundaries, and may be shorter than a chunk.
        It is only read on the host: pass a CPU tensor or a list to avoid a device sync.
    initial_state: [N, H, K, V] fp32, identical on every rank (N = B, or the number of sequences). Only the
        rank holding a sequence's first token uses its row, so that rank gets all of dh0 for it and the others
        get zeros: the sum over ranks (all_reduce) is the full gradient, as for any replicated input.
    output_final_state: return [N, H, K, V] with row n filled on the rank holding sequence n's last token and
        zeros elsewhere (all_reduce-sum gives every rank all final states).
    transition: "concat" runs one local pass with value width V+K (the intra-chunk work is shared);
        "separate" runs a width-V pass and a width-K pass over only the first and last local pieces (for
        kernels limited to V <= 128, like k3's Triton ones; cheaper when a rank holds many sequences);
        "auto" picks concat for the torch / fla / reference backends and for CPU tensors, else separate.
    Returns (o [B, T_local, H, V], final state or None). The incoming-state fold runs in fp32 (fp64 for fp64
    inputs). Every rank must run the backward when any does (the backward has one collective).
    """
    if transition not in ("auto", "concat", "separate"):
        raise ValueError(f"chunk_kda_cp: transition must be 'auto', 'concat' or 'separate', got {transition!r}")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"chunk_kda_cp: q and v must be [B, T, H, D], got {tuple(q.shape)} and {tuple(v.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan = plan_kda_cp(cu_seqlens, T, rank, world, B)
    N, n_loc, n1 = plan.num_seqs, len(plan.seq_ids), plan.n_first
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if transition == "auto":
        wide_ok = backend in ("torch", "fla", "reference") or (backend == "auto" and not q.is_cuda)
        transition = "concat" if wide_ok or V + K <= 128 else "separate"
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(f"chunk_kda_cp: initial_state must be [N,H,K,V]={(N, H, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, sdt):
            raise ValueError(f"chunk_kda_cp: initial_state must be torch.float32, got {initial_state.dtype}")

    dev = q.device
    varlen = plan.local_cu is not None
    L0 = plan.local_cu[1] if varlen else T                   # tokens of the first piece
    L1 = T - plan.local_cu[-2] if varlen else T              # tokens of the last piece
    seq = torch.tensor(plan.seq_ids, device=dev)
    # S_0 = initial_state for pieces that start their sequence here, else 0.
    if initial_state is not None:
        starts = torch.tensor(plan.starts_here, device=dev).view(n_loc, 1, 1, 1)
        init_v = torch.where(starts, initial_state.to(sdt)[seq], torch.zeros((), dtype=sdt, device=dev))
    else:
        init_v = torch.zeros(n_loc, H, K, V, dtype=sdt, device=dev)
    cu_loc = None if not varlen else torch.tensor(plan.local_cu, dtype=torch.int64, device=dev)
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              backend=backend)

    def eye(n):
        return torch.eye(K, dtype=sdt, device=dev).repeat(n, H, 1, 1)

    # The transition columns (value 0, state I) are needed on the first piece when it continues in
    # (they give P_t^T q and P) and on the last piece when it continues out (they give P for the summary).
    o_i_first = p_first = p_last = None
    if transition == "concat":  # one pass [v | 0] from [S_0 | I or 0]
        need = torch.zeros(n_loc, dtype=sdt)
        need[:n1] += plan.first_in
        need[n_loc - n1:] += plan.last_out
        init_i = eye(n_loc) * need.clamp(max=1).to(dev).view(n_loc, 1, 1, 1)
        o2, fin = chunk_kda(q, k, torch.cat([v, v.new_zeros(B, T, H, K)], -1), g, beta,
                           initial_state=torch.cat([init_v, init_i], -1), cu_seqlens=cu_loc, **kw)
        o_v, o_i = o2.split([V, K], -1)
        fin_v, fin_i = fin.to(sdt).split([V, K], -1)
        o_i_first, p_first, p_last = o_i[:, :L0], fin_i[:n1], fin_i[n_loc - n1:]
    else:  # a width-V pass over everything, a width-K pass over only the first and last pieces
        o_v, fin_v = chunk_kda(q, k, v, g, beta, initial_state=init_v, cu_seqlens=cu_loc, **kw)
        fin_v = fin_v.to(sdt)
        if not varlen or n_loc == 1:
            spans = [(0, T)] if plan.first_in or plan.last_out else []
        else:
            spans = ([(0, L0)] if plan.first_in else []) + ([(T - L1, T)] if plan.last_out else [])
        if spans:
            sub = (lambda t: t) if spans == [(0, T)] else (lambda t: torch.cat([t[:, a:b] for a, b in spans], 1))
            Ts = sum(b - a for a, b in spans)
            cu_sub = None if not varlen else torch.tensor([0] + [b - a for a, b in spans], device=dev).cumsum(0)
            o_i, p = chunk_kda(sub(q), sub(k), v.new_zeros(B, Ts, H, K), sub(g), sub(beta),
                               initial_state=eye(B if not varlen else len(spans)), cu_seqlens=cu_sub, **kw)
            p = p.to(sdt)
            if plan.first_in:
                o_i_first, p_first = o_i[:, :L0], p[:n1]
            if plan.last_out:
                p_last = p[p.shape[0] - n1:]

    # One all_gather of the outgoing summaries [S~ | P]; fold the earlier ranks of the same sequence(s).
    if p_last is None:  # nothing continues on the next rank: the P slot is never read
        p_last = fin_v.new_zeros(n1, H, K, K)
    gathered = all_gather_cp(torch.cat([fin_v[n_loc - n1:], p_last], -1), group)   # [world, n1, H, K, V+K]
    # Start from zeros that stay attached to `gathered`, so every rank runs the backward collective.
    s_in = gathered[rank, ..., :V] * 0
    for j in range(plan.chain_from, rank):
        s_in = gathered[j, ..., V:] @ s_in + gathered[j, ..., :V]           # fp32: S <- P_j S + S~_j

    # Add (P_t^T q) S_in on the first piece's tokens (all tokens in batch mode) and P S_in to its state.
    if plan.first_in:
        head = o_v[:, :L0].to(sdt) + torch.einsum("bthk,bhkv->bthv", o_i_first.to(sdt), s_in)
        o = torch.cat([head.to(o_v.dtype), o_v[:, L0:]], 1)
        fin_first = fin_v[:n1] + p_first @ s_in
    else:  # (exact zero; only keeps this rank's outputs attached to the all_gather)
        o = o_v + (s_in.sum() * 0).to(o_v.dtype)
        fin_first = fin_v[:n1]
    if not output_final_state:
        return o, None
    fin_local = torch.cat([fin_first, fin_v[n1:]], 0)
    ends = [i for i, e in enumerate(plan.ends_here) if e]
    final = fin_local.new_zeros(N, H, K, V).index_copy(
        0, seq[ends], fin_local[torch.tensor(ends, dtype=torch.long, device=dev)])
    return o, final


# ------------------------------------------------------------------------------------------- layer


def _halo_cu(cu_seqlens, rank: int, t_local: int, n: int, device) -> torch.Tensor:
    """cu_seqlens over [halo (n tokens) | local tokens]: global boundaries inside that window, shifted."""
    lo, hi = rank * t_local - n, (rank + 1) * t_local
    cu = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens
    cu = sorted({0, t_local + n} | {int(c) - lo for c in cu if lo < int(c) < hi})
    return torch.tensor(cu, dtype=torch.int64, device=device)


def kda_layer_forward_cp(layer, x_local: torch.Tensor, group=None, cu_seqlens=None) -> torch.Tensor:
    """`KimiDeltaAttention.forward` for this rank's segment x_local [B, T_local, D] of the global stream.

    Uses the layer's own weights and pieces (short_conv, kda_gate, o_norm, ...); equals the single-process
    layer on the whole stream (with the same global `cu_seqlens`, B == 1) sliced to this rank's tokens.
    The three short convs get their W−1-token halo from the previous rank in one exchange; with cu_seqlens
    the halo is cut at sequence starts. Parameter gradients are per-rank shares (all_reduce-sum them).
    No cache or attention_mask (training / prefill only).
    """
    B, T, _ = x_local.shape
    x = x_local
    H, K = layer.num_heads, layer.head_dim
    W = layer.q_conv1d.weight.shape[-1]
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    rank = dist.get_rank(group)
    if cu_seqlens is not None:
        plan_kda_cp(cu_seqlens, T, rank, dist.get_world_size(group), B)   # validates before any exchange
        cu_ext = _halo_cu(cu_seqlens, rank, T, W - 1, x.device) if W > 1 else None
    pre = [lin(x) for lin in (layer.q_proj, layer.k_proj, layer.v_proj)]
    if W > 1:
        halos = conv_halo(torch.cat(pre, -1), W, group).split([p.shape[-1] for p in pre], -1)
    outs = []
    for i, (y, conv) in enumerate(zip(pre, convs)):
        if W == 1:
            y, _ = short_conv(y, conv.weight, cu_seqlens=None)
        elif cu_seqlens is None:
            y, _ = short_conv(y, conv.weight, halos[i].transpose(1, 2))
        else:
            y, _ = short_conv(torch.cat([halos[i], y], 1), conv.weight, cu_seqlens=cu_ext)
            y = y[:, W - 1:]
        outs.append(y.reshape(B, T, H, -1))
    q, k, v = outs
    g = kda_gate(layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K), layer.A_log[:H], layer.dt_bias,
                 layer.lower_bound)
    beta = torch.sigmoid(layer.b_proj(x).float())
    o, _ = chunk_kda_cp(q, k, v, g, beta, group, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
                        backend=layer.backend)
    o = layer.o_norm(o.float()) * torch.sigmoid(layer.g_proj(x).float()).view(B, T, H, K)
    return layer.o_proj(o.reshape(B, T, H * K).to(x.dtype))
