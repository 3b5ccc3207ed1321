"""Context parallelism of the whole K3 model: the ranks of a cp group share each sequence (K3_SPEC §9).

    enable_context_parallel(model, mesh.cp.get_group())          # once, after EP / before or after FSDP
    local = shard_batch(batch, cp_rank, cp_size, num_mtp=1)     # batch: input_ids [B, T], labels, cu_seqlens
    out = model(**local)                                         # this rank's share of the loss
    (out.loss + 0.3 * out.mtp_loss).backward()                   # then sum the gradients over the cp group

Layout (`k3.parallel.mla_cp`): every row of T tokens is cut into 2·P segments of s = T / (2·P) tokens; rank r
holds segments r and 2P−1−r as its local row of 2s tokens (causal load balance: one early and one late
segment each). Per-token parts (embedding, norms, AttnRes, MoE, heads) run unchanged on the local tokens;
`cu_seqlens` keeps describing the whole sequences (packed documents over the flattened B·T tokens).

Loss convention (as `k3.parallel.fsdp`): `shard_batch` computes every target (the next token, and token
t + 1 + k for MTP layer k) from the whole sequence before splitting, with the documents' masks, and the number
of valid targets of the whole batch; each rank's `loss` / `mtp_loss` is Σ over its positions of the
cross-entropy divided by that number, so the cp ranks' losses SUM to the single-process loss, and summing the
gradients over the cp group gives the single-process gradients (FSDP does so over its mesh, which holds cp).

The attention layers get an executor (`ContextParallel`) through their `context_parallel` attribute:
- MLA (`mla_cp.mla_forward_cp`): one all-gather of the latent [c | k_pe], attention in global positions.
- KDA (`kda_forward_zigzag`, from the pieces of `kda_cp`): every local piece (a segment, or its part inside one
  document) runs the ordinary chunked op from a zero state with K extra zero value columns started from the
  identity ("[v | 0] from [0 | I]", see `kda_cp`), which gives its zero-start state S̃, its transition P and
  P_tᵀq; one all-gather of the fp32 summaries [S̃ | P] of both local segments; then every rank folds them in
  GLOBAL segment order, S_in(j) = S̃_{j−1} + P_{j−1}·S_in(j−1) while a document continues across segment
  starts (a scan over the 2P segments, all rows at once), and adds P_tᵀq·S_in(j) to the outputs of the first
  piece of each of its segments. The short convolutions get their W−1-token halo (the previous global segment's
  last pre-conv inputs, cut at document starts) from one small all-gather of every segment's tail.
- MTP's input shift (embedding of token t + k) takes the first k tokens of the next global segment from one
  small all-gather (`shift_tokens`).

What the caller reduces: parameter gradients over the cp group (FSDP: automatic); MoE balance statistics
(`k3.train.balance.BalanceController`) are per-rank loads of the local tokens, summed by its step's all_reduce
over its `group`, which must contain the cp ranks (the default world group does); QK-clip's per-head max logit
is already the whole sequence's on every cp rank (all-reduced with MAX inside the layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.k3 import shifted_targets
from ..ops.conv import short_conv_split
from ..ops.kda import chunk_kda, kda_gate
from ..ops.norm import rms_norm_gated
from ..ops.varlen import doc_ids
from .kda_cp import all_gather_cp, plan_kda_cp
from .mla_cp import local_positions, mla_forward_cp, row_bounds, segment_owner, zigzag_segments

__all__ = ["shard_batch", "ContextParallel", "enable_context_parallel", "kda_forward_zigzag",
           "chunk_kda_zigzag"]

IGNORE = -100


# ------------------------------------------------------------------------------------------------ batch


def shard_batch(batch: dict, cp_rank: int, cp_size: int, num_mtp: int = 0) -> dict:
    """This cp rank's inputs from a whole batch {input_ids [B, T], labels [B, T] (optional, HF convention),
    cu_seqlens (optional, packed documents over the flattened B·T tokens)}.

    Returns {input_ids [B, 2s], cu_seqlens (unchanged: the whole sequences)} and, with labels, targets
    [1 + num_mtp, B, 2s] (row i: the label of position t + 1 + i of the whole sequence, -100 past the row's end
    or in another document) and num_targets [1 + num_mtp] (valid targets of the whole batch, the loss
    normaliser). num_mtp: the model's MTP layers (`text_config.num_nextn_predict_layers`).
    T must be a multiple of 2·cp_size."""
    extra = set(batch) - {"input_ids", "labels", "cu_seqlens"}
    if extra:
        raise ValueError(f"shard_batch: unsupported keys {sorted(extra)}; expected input_ids, labels, cu_seqlens")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"shard_batch: cp_rank {cp_rank} outside [0, {cp_size})")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [B, T], got {tuple(ids.shape)}")
    B, T = ids.shape
    if T % (2 * cp_size):
        raise ValueError(f"shard_batch: sequence length T={T} must be divisible by 2·cp={2 * cp_size} (each cp "
                         f"rank takes two equal segments)")
    cu = batch.get("cu_seqlens")
    if cu is not None:
        row_bounds(cu, B, T)  # validates: whole sequences, row boundaries are document boundaries
    pos = local_positions(cp_rank, cp_size, T // (2 * cp_size), ids.device)
    out = {"input_ids": ids[:, pos]}
    if cu is not None:
        out["cu_seqlens"] = cu
    labels = batch.get("labels")
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(f"shard_batch: labels must match input_ids {tuple(ids.shape)}, got {tuple(labels.shape)}")
        docs = None if cu is None else doc_ids(cu.to(labels.device), B, T)
        rows = 1 + (num_mtp if T > 2 else 0)  # the model skips MTP for T <= 2
        tg = torch.stack([shifted_targets(labels, 1 + i, IGNORE, docs) for i in range(rows)])
        out["targets"] = tg[:, :, pos]
        out["num_targets"] = (tg != IGNORE).sum((1, 2))
    return out


# --------------------------------------------------------------------------------------------- KDA


def chunk_kda_zigzag(q, k, v, g, beta, group, bounds: list[list[int]], *, transition: str = "auto",
                     backend: str = "auto", g_lower_bound=None) -> torch.Tensor:
    """KDA (`chunk_kda` with q/k L2-normalised in the kernel) of this rank's two segments, in the layout above.

    q, k, g [B, 2s, H, K]; v [B, 2s, H, V]; beta [B, 2s, H]; bounds: per-row document boundaries of the whole
    rows (`row_bounds`). Zero initial state at every document start. Returns o [B, 2s, H, V].
    transition: "concat" (one local pass of value width V + K), "separate" (a width-V pass, plus a width-K pass
    over only the pieces that continue in or out: for kernels limited to V ≤ 128) or "auto" (concat on CPU, for
    the torch / fla / reference backends or when V + K ≤ 128)."""
    if transition not in ("auto", "concat", "separate"):
        raise ValueError(f"chunk_kda_zigzag: transition must be 'auto', 'concat' or 'separate', got {transition!r}")
    B, L, H, K = q.shape
    V = v.shape[-1]
    s = L // 2
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    mine = zigzag_segments(rank, P)
    plans = [[plan_kda_cp(bd, s, j, 2 * P) for j in range(2 * P)] for bd in bounds]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    if transition == "auto":
        wide_ok = backend in ("torch", "fla", "reference") or (backend == "auto" and not q.is_cuda)
        transition = "concat" if wide_ok or V + K <= 128 else "separate"

    # local pieces over the flattened [B·2s] tokens; per slot (row, local segment): its pieces and flags
    cu_loc, slots = [0], []
    for b in range(B):
        for li, j in enumerate(mine):
            p, base = plans[b][j], (b * 2 + li) * s
            first = len(cu_loc) - 1
            cu_loc += [base + c for c in p.local_cu[1:]]
            slots.append(dict(b=b, j=j, tok0=base, first=first, last=len(cu_loc) - 2, len0=p.local_cu[1],
                              first_in=p.first_in, last_out=p.last_out))
    npc = len(cu_loc) - 1
    cu_t = torch.tensor(cu_loc, dtype=torch.int64, device=dev)
    flat = [t.reshape(1, B * L, *t.shape[2:]) for t in (q, k, v, g, beta)]
    qf, kf, vf, gf, bf = flat
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend, g_lower_bound=g_lower_bound)
    eye = torch.eye(K, dtype=sdt, device=dev)
    heads, p_last = {}, {}  # slot index -> P_t^T q over its first piece's tokens; -> P of its last piece
    if transition == "concat":
        init = torch.cat([torch.zeros(npc, H, K, V, dtype=sdt, device=dev), eye.expand(npc, H, K, K)], -1)
        o2, fin = chunk_kda(qf, kf, torch.cat([vf, vf.new_zeros(1, B * L, H, K)], -1), gf, bf, initial_state=init,
                            cu_seqlens=cu_t, **kw)
        o_v, o_i = o2[0].split([V, K], -1)
        fin_v, fin_i = fin.to(sdt).split([V, K], -1)
        for i, sl in enumerate(slots):
            if sl["first_in"]:
                heads[i] = o_i[sl["tok0"]:sl["tok0"] + sl["len0"]]
            if sl["last_out"]:
                p_last[i] = fin_i[sl["last"]]
    else:
        o_v, fin_v = chunk_kda(qf, kf, vf, gf, bf, initial_state=torch.zeros(npc, H, K, V, dtype=sdt, device=dev),
                               cu_seqlens=cu_t, **kw)
        o_v, fin_v = o_v[0], fin_v.to(sdt)
        spans, where = [], []  # token ranges of the transition pass; (slot, "first"/"last", span index)
        for i, sl in enumerate(slots):
            if sl["first_in"]:
                spans.append((sl["tok0"], sl["tok0"] + sl["len0"]))
                where.append((i, "first", len(spans) - 1))
            if sl["last_out"]:
                if sl["first_in"] and sl["first"] == sl["last"]:
                    where.append((i, "last", len(spans) - 1))
                else:
                    spans.append((cu_loc[sl["last"]], cu_loc[sl["last"] + 1]))
                    where.append((i, "last", len(spans) - 1))
        if spans:
            idx = torch.cat([torch.arange(a, e, device=dev) for a, e in spans])
            cu_sub = torch.tensor([0] + [e - a for a, e in spans], device=dev).cumsum(0)
            o_i, p = chunk_kda(qf[:, idx], kf[:, idx], vf.new_zeros(1, idx.numel(), H, K), gf[:, idx], bf[:, idx],
                               initial_state=eye.expand(len(spans), H, K, K).contiguous(), cu_seqlens=cu_sub, **kw)
            o_i, p = o_i[0], p.to(sdt)
            for i, kind, n in where:
                if kind == "first":
                    heads[i] = o_i[int(cu_sub[n]):int(cu_sub[n + 1])]
                else:
                    p_last[i] = p[n]

    # one all-gather of both segments' summaries [S~ | P] (P = 0 where nothing continues: never read)
    zero_p = fin_v.new_zeros(H, K, K)
    summ = torch.stack([torch.cat([fin_v[sl["last"]], p_last.get(i, zero_p)], -1) for i, sl in enumerate(slots)])
    G = all_gather_cp(summ.view(B, 2, H, K, V + K), group)  # [P, B, 2, H, K, V + K]

    # fold in global segment order, all rows at once: S_in(j) = [first piece continues] · S_out(j−1),
    # S_out(j) = S~_j + [the segment is one continuing piece] · P_j S_in(j)
    def flag(fn, j):
        return torch.tensor([float(fn(plans[b][j])) for b in range(B)], dtype=sdt, device=dev).view(B, 1, 1, 1)

    s_in_of, s_out = {}, None
    for j in range(max(mine) + 1):
        r, li = segment_owner(j, P)
        st, pj = G[r, :, li, ..., :V], G[r, :, li, ..., V:]
        s_in = st * 0 if j == 0 else flag(lambda p: p.first_in, j) * s_out
        s_in_of[j] = s_in
        s_out = st + flag(lambda p: p.first_in and len(p.seq_ids) == 1, j) * (pj @ s_in)

    parts = []
    for i, sl in enumerate(slots):
        a, n0 = sl["tok0"], sl["len0"]
        if i in heads:
            corr = torch.einsum("thk,hkv->thv", heads[i].to(sdt), s_in_of[sl["j"]][sl["b"]])
            parts += [(o_v[a:a + n0].to(sdt) + corr).to(o_v.dtype), o_v[a + n0:a + s]]
        else:
            parts.append(o_v[a:a + s])
    o = torch.cat(parts).view(B, L, H, V)
    attach = sum(t.sum() for t in s_in_of.values()) * 0  # every rank's output depends on the gather (backward)
    return o + attach.to(o.dtype)


def kda_forward_zigzag(layer, x: torch.Tensor, group, bounds: list[list[int]] | None = None,
                       transition: str = "auto") -> torch.Tensor:
    """`KimiDeltaAttention.forward` (no cache, no mask) for this rank's two segments x [B, 2s, D] of the whole
    rows, from the layer's own weights and pieces; bounds: per-row document boundaries (None: one per row).
    Equals the single-process layer on the whole rows sliced to this rank's tokens; parameter gradients are
    this rank's share."""
    B, L, _ = x.shape
    P = dist.get_world_size(group)
    s, T = L // 2, L * P
    H, K = layer.num_heads, layer.head_dim
    HK = H * K
    W = layer.q_conv1d.weight.shape[-1]
    if L % 2:
        raise ValueError(f"context parallelism: the local row holds two equal segments, got {L} tokens")
    if bounds is None:
        bounds = [[0, T] for _ in range(B)]
    y = F.linear(x, torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))  # [B, 2s, 3HK]
    w_conv = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight])
    n = W - 1
    if n == 0:
        q, k, v = short_conv_split(y, w_conv, (HK, HK, HK), backend=layer.elementwise_backend)
    else:
        if s < n:
            raise ValueError(f"context parallelism: each segment needs at least conv width-1={n} tokens, got {s}")
        C = 3 * HK
        segs = y.view(B, 2, s, C)
        tails = all_gather_cp(segs[:, :, s - n:], group)  # [P, B, 2, n, C]: every segment's last n inputs
        halos, cu_ext = [], [0]
        for li, j in enumerate(zigzag_segments(dist.get_rank(group), P)):
            if j == 0:
                halos.append(y.new_zeros(B, n, C))
            else:
                r, lj = segment_owner(j - 1, P)
                halos.append(tails[r, :, lj])
        ext = torch.cat([torch.stack(halos, 1), segs], 2)  # [B, 2, n + s, C]
        for b in range(B):  # windows [j·s − n, (j+1)·s) of the row, cut at document starts
            for li, j in enumerate(zigzag_segments(dist.get_rank(group), P)):
                base, lo = (b * 2 + li) * (n + s), j * s - n
                cu_ext += sorted({base + c - lo for c in bounds[b] if lo < c < (j + 1) * s} - {base})
                cu_ext.append(base + n + s)
        cu_ext = torch.tensor(cu_ext, dtype=torch.int64, device=x.device)
        q, k, v = (t.view(B, 2, n + s, HK)[:, :, n:].reshape(B, L, HK) for t in short_conv_split(
            ext.reshape(1, B * 2 * (n + s), C), w_conv, (HK, HK, HK), cu_seqlens=cu_ext,
            backend=layer.elementwise_backend))
    g = kda_gate(layer.f_b_proj(layer.f_a_proj(x)).view(B, L, H, K), layer.A_log[:H], layer.dt_bias,
                 layer.lower_bound)
    beta = torch.sigmoid(layer.b_proj(x).float())
    o = chunk_kda_zigzag(q.view(B, L, H, K), k.view(B, L, H, K), v.view(B, L, H, K), g, beta, group, bounds,
                         transition=transition, backend=layer.backend, g_lower_bound=layer.lower_bound)
    o = rms_norm_gated(o, layer.o_norm.weight, layer.g_proj(x).view(B, L, H, K), layer.o_norm.eps,
                       backend=layer.elementwise_backend)
    return layer.o_proj(o.reshape(B, L, HK).to(x.dtype))


# ------------------------------------------------------------------------------------------- model


class ContextParallel:
    """The executor the attention layers and the LM call under context parallelism (see the module docstring).
    One instance serves every layer; it caches the per-row document boundaries of the current cu_seqlens
    (read to the host once per forward, not once per layer: do not modify a cu_seqlens tensor in place
    between forwards)."""

    def __init__(self, group=None, transition: str = "auto"):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.transition = transition
        self._cached = None  # (cu_seqlens object, B, T, bounds)

    def bounds(self, cu_seqlens, B: int, T_local: int) -> list[list[int]] | None:
        """Per-row document boundaries of the whole rows (None without cu_seqlens)."""
        if cu_seqlens is None:
            return None
        c = self._cached
        if c is None or c[0] is not cu_seqlens or c[1:3] != (B, T_local):
            self._cached = c = (cu_seqlens, B, T_local, row_bounds(cu_seqlens, B, T_local * self.size))
        return c[3]

    def mla(self, layer, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        return mla_forward_cp(layer, x, self.group, bounds=self.bounds(cu_seqlens, *x.shape[:2]))

    def kda(self, layer, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        return kda_forward_zigzag(layer, x, self.group, self.bounds(cu_seqlens, *x.shape[:2]), self.transition)

    def shift_tokens(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """x [B, 2s, D] at position t + k of the whole row (zeros past its end), for this rank's tokens."""
        B, L, D = x.shape
        s = L // 2
        if not 1 <= k <= s:
            raise ValueError(f"shift_tokens: shift k={k} must be in [1, segment length {s}]")
        nxt = all_gather_cp(x.view(B, 2, s, D)[:, :, :k], group=self.group)  # [P, B, 2, k, D]
        out = []
        for li, j in enumerate(zigzag_segments(self.rank, self.size)):
            if j + 1 < 2 * self.size:
                r, lj = segment_owner(j + 1, self.size)
                tail = nxt[r, :, lj]
            else:
                tail = x.new_zeros(B, k, D) + nxt.sum() * 0  # keeps the gather in this rank's graph
            out += [x[:, li * s + k:(li + 1) * s], tail]
        return torch.cat(out, 1)


def enable_context_parallel(model, group=None, transition: str = "auto"):
    """Make `model` (a `K3ForConditionalGeneration` or `KimiLinearForCausalLM`) run context parallel over `group`
    in place: every MLA / KDA layer and the LM get one `ContextParallel` executor. Afterwards each rank calls
    model(**shard_batch(batch, rank, size, num_mtp)) on the same batch. Returns model."""
    from ..model.kda import KimiDeltaAttention
    from ..model.mla import MLAttention

    lm = getattr(model, "language_model", model)
    if not hasattr(lm, "context_parallel"):
        raise ValueError(f"enable_context_parallel: expected a K3 model, got {type(model).__name__}")
    if lm.context_parallel is not None:
        raise ValueError("enable_context_parallel: the model already runs context parallel")
    cp = ContextParallel(group, transition)
    for m in lm.modules():
        if isinstance(m, (MLAttention, KimiDeltaAttention)):
            m.context_parallel = cp
    lm.context_parallel = cp
    return model
