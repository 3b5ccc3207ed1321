"""Gated Multi-head Latent Attention with NoPE (K3_SPEC §3).

q = q_b(RMSNorm(q_a(x))); [c | k_pe] = kv_a(x) with c the 512-d latent (RMSNorm'd) and k_pe a 64-d key
slice shared by all heads and never rotated (NoPE); k_nope, v = kv_b(c); scale = (nope + rope)^-0.5;
output = o_proj(attn · σ(g_proj(x))).

Two attention paths that give the same result: `naive` expands the latent into per-head keys and values
(training, prefill); `absorbed` folds kv_b into the query and the output (decode), so the cache holds only
the latent c and k_pe per token.

Without a cache or an attention_mask (training, packed prefill) the naive path runs through
`k3.ops.attention.doc_causal_attention` (no [T, T] mask; `attn_backend` picks its backend, "reference"
restores the dense masked path), which also returns the QK-clip max logit. Paths with a cache or an
attention_mask (generate) build the dense mask. With a `PagedLayerCache` (the serving engine's pool) the
packed documents write their latents to the pages and attend their histories read back from them
(`_forward_paged`): absorbed for single-token documents (decode), expanded for prefill chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K3TextConfig
from ..ops import joined_linear as joined_linear_ops, mla_decode as mla_ops
from ..ops.attention import chunk_attention, doc_causal_attention
from ..ops.gemv import linear
from ..ops.mla_decode import paged_mla_decode, triton_reason
from ..ops.varlen import doc_ids
from .layers import RMSNorm, joined_weight
from .paged_cache import PagedLayerCache


class MLAttention(nn.Module):
    def __init__(self, cfg: K3TextConfig, layer_idx: int):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.rope, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (self.nope + self.rope), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.vdim), bias=False)
        self.g_proj = nn.Linear(D, H * self.vdim, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)
        self.attn_impl = "auto"  # "naive" | "absorbed" | "auto" (absorbed when decoding from a cache)
        # no cache, no attention_mask: doc_causal_attention's backend ("auto" | "flex" | "sdpa"), or "reference"
        # for the dense [B, 1, T, T] mask path (the baseline for before/after benchmarks)
        self.attn_backend = "auto"
        # engine decodes over the paged pool: "auto" (the Triton paged kernel `k3.ops.mla_decode` on CUDA, else the
        # gathered-history path below), "triton" / "reference" (that op's backends), "gather" (always the
        # gathered history + `attend_absorbed`)
        self.decode_backend = "auto"
        self.record_max_logit = False  # QK-clip: keep each head's max pre-softmax logit of the last training forward
        self.max_logit: torch.Tensor | None = None  # fp32 [H], detached
        # context parallelism, applied from outside (`k3.parallel.cp.enable_context_parallel`): an executor whose
        # `mla(layer, x, cu_seqlens)` runs this layer on this rank's share of the sequences (training only)
        self.context_parallel = None

    def project_q(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] → q [B, T, H, nope + rope]. `first`: x's q_proj (or q_a_proj) output, when already formed."""
        lora = not hasattr(self, "q_proj")
        if first is None:
            first = linear(x, self.q_a_proj.weight if lora else self.q_proj.weight)
        q = linear(self.q_a_layernorm(first), self.q_b_proj.weight) if lora else first
        return q.view(*x.shape[:2], self.num_heads, self.nope + self.rope)

    def project_latent(self, x: torch.Tensor, ckv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] → (c [B, T, kv_lora_rank] normalised latent, k_pe [B, T, rope]). `ckv`: x's
        kv_a_proj_with_mqa output, when already formed."""
        ckv = linear(x, self.kv_a_proj_with_mqa.weight) if ckv is None else ckv
        c, k_pe = ckv.split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    def _project_joined(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor | None]:
        """`project_q`, `project_latent` and the output gate's logits (None without a gate), with the projections
        of x (q or q_a, the latent, the gate) as one GEMM (`k3.ops.joined_linear`)."""
        first = self.q_proj.weight if hasattr(self, "q_proj") else self.q_a_proj.weight
        gate = [self.g_proj.weight] if self.g_proj is not None else []
        outs = joined_linear_ops.joined_linear(x, [first, self.kv_a_proj_with_mqa.weight] + gate)
        return (self.project_q(x, outs[0]), *self.project_latent(x, outs[1]), outs[2] if gate else None)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.vdim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]  # W_uk [H, nope, C], W_uv [H, v, C]

    def expand_kv(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [B, S, C], k_pe [B, S, R] → per-head k [B, S, H, nope + rope] (k_pe shared), v [B, S, H, V]."""
        B, S, _ = c.shape
        kv = self.kv_b_proj(c).view(B, S, self.num_heads, self.nope + self.vdim)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)
        if torch.is_grad_enabled():
            return torch.cat([k_nope, k_pe], dim=-1), v
        # without autograd two copies into the keys (cat's kernel reads the broadcast k_pe at < 1 TB/s: 82 us per
        # 8K-token prefill chunk on the H200)
        k = kv.new_empty(B, S, self.num_heads, self.nope + self.rope)
        k[..., :self.nope].copy_(k_nope)
        k[..., self.nope:].copy_(k_pe)
        return k, v

    def attend_naive(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Expanded per-head keys/values. q [B,T,H,Dq], c [B,S,C], k_pe [B,S,R], allowed [B,1,T,S] → [B,T,H,V]."""
        k, v = self.expand_kv(c, k_pe)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias, scale=self.scale)
        return o.transpose(1, 2)

    def attend_absorbed(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Weight absorption: scores and values in the latent space; same result as `attend_naive`."""
        w_uk, w_uv = self._kv_b()
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        scores = torch.einsum("bthc,bsc->bhts", q_lat, c) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
        acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 softmax (fp64 for fp64 inputs)
        scores = (scores.to(acc) * self.scale).masked_fill(~allowed, torch.finfo(acc).min)
        p = torch.softmax(scores, dim=-1).to(c.dtype)
        o_lat = torch.einsum("bhts,bsc->bthc", p, c)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)

    @torch.no_grad()
    def _record_max_logit(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, allowed: torch.Tensor,
                          block: int = 512) -> None:
        """Max over batch and allowed (query, key) pairs of the scaled logits, per head, in query blocks.
        In q's dtype (under autocast the einsums run in bf16 anyway); operands converted once, not per block."""
        w_uk, _ = self._kv_b()
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        w_uk, c, k_pe = w_uk.to(q.dtype), c.to(q.dtype), k_pe.to(q.dtype)
        best = torch.full((self.num_heads,), float("-inf"), device=q.device)
        for s in range(0, q.shape[1], block):
            q_lat = torch.einsum("bthd,hdc->bthc", q_nope[:, s:s + block], w_uk)
            sc = (torch.einsum("bthc,bsc->bhts", q_lat, c)
                  + torch.einsum("bthr,bsr->bhts", q_pe[:, s:s + block], k_pe)).float() * self.scale
            sc = sc.masked_fill(~allowed[:, :, s:s + block], float("-inf"))
            best = torch.maximum(best, sc.amax(dim=(0, 2, 3)))
        self.max_logit = best

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: dict | None = None, cu_seqlens: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, residual_inplace: bool = False) -> torch.Tensor:
        """x [B, T, D]; attention_mask [B, S_total] over past + new tokens; cache holds `c` and `k_pe`;
        cu_seqlens: packed documents over the flattened B·T tokens (attention stays inside a document).
        `residual` [B, T, D]: returned as residual + output (inference folds it into o_proj's epilogue;
        `residual_inplace`: the caller's own tensor, which that GEMM may accumulate into, see `linear`)."""
        if isinstance(cache, PagedLayerCache):
            if attention_mask is not None or cu_seqlens is not None:
                raise ValueError("MLAttention: a paged cache carries its own packing; pass no attention_mask or "
                                 "cu_seqlens with it")
            return self._forward_paged(x, cache, residual, residual_inplace)
        if self.context_parallel is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError("MLAttention: context parallelism takes no cache or attention_mask")
            out = self.context_parallel.mla(self, x, cu_seqlens)
            return out if residual is None else residual + out
        B, T, _ = x.shape
        if cache is None and attention_mask is None and self.attn_impl in ("auto", "naive") \
                and self.attn_backend != "reference":
            q, c, k_pe, gate = self._project_joined(x) if joined_linear_ops.ENABLED else (
                self.project_q(x), *self.project_latent(x), None)
            return self._finish(x, self._attend_docs(q, c, k_pe, cu_seqlens), gate=gate, residual=residual,
                                residual_inplace=residual_inplace)
        q = self.project_q(x)
        c, k_pe = self.project_latent(x)
        past = 0
        if cache is not None:
            if "c" in cache:
                past = cache["c"].shape[1]
                c = torch.cat([cache["c"], c], dim=1)
                k_pe = torch.cat([cache["k_pe"], k_pe], dim=1)
            cache["c"], cache["k_pe"] = c, k_pe
        allowed = causal_mask(B, T, past, attention_mask, x.device)
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("MLAttention: cu_seqlens cannot be combined with a cache")
            d = doc_ids(cu_seqlens, B, T)
            allowed = allowed & (d.unsqueeze(2) == d.unsqueeze(1)).unsqueeze(1)
        if self.record_max_logit and self.training:
            self._record_max_logit(q, c, k_pe, allowed)
        impl = self.attn_impl
        if impl == "auto":
            impl = "absorbed" if past > 0 else "naive"
        o = (self.attend_absorbed if impl == "absorbed" else self.attend_naive)(q, c, k_pe, allowed)
        return self._finish(x, o, residual=residual, residual_inplace=residual_inplace)

    def _attend_docs(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                     cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """Causal attention inside each document with no dense mask; records the QK-clip max logit from the
        same call in training forwards when asked."""
        k, v = self.expand_kv(c, k_pe)
        record = self.record_max_logit and self.training
        out = doc_causal_attention(q, k, v, self.scale, cu_seqlens, return_max_logit=record,
                                   backend=self.attn_backend)
        if not record:
            return out
        o, max_logit = out
        self.max_logit = max_logit.float()
        return o

    def _forward_paged(self, x: torch.Tensor, cache: PagedLayerCache, residual: torch.Tensor | None = None,
                       residual_inplace: bool = False) -> torch.Tensor:
        """x [1, N, D]: packed documents continuing cached sequences (`PackedBatch`). The new latents go to
        their pages first; the leading single-token documents then attend their padded histories in the
        absorbed form (one batched call), every other document its history [0, start + T) with expanded keys,
        causal aligned to the last key (query t sits at position start + t)."""
        b = cache.batch
        nd = b.num_decode
        # the latent norm inside the page write (K3_MLA_FUSED_WRITE=1): c is then used by nothing else, but a
        # prefill graph attends its chunk from c itself
        fused = mla_ops.FUSED_WRITE and not b.graph_prefill
        q, c, k_pe, gate = self._project_paged(x, norm_latent=not fused)
        q = q[0]  # [N, H, Dq]
        kn = self.kv_a_layernorm
        cache.write_latents(c[0], k_pe[0], norm=(kn.weight, kn.eps) if fused else None)
        if b.graph_prefill:  # one sequence's chunk padded at its end (a prefill graph)
            return self._finish(x, self._attend_chunk(q, c, k_pe, cache)[None], gate, residual, residual_inplace)
        parts = []
        if nd:
            parts.append(self._decode_paged(q[:nd], cache))
        if nd < b.num_docs:
            hist = cache.history(c.dtype)
            off = nd
            for j in range(nd, b.num_docs):
                T, (h0, h1) = b.lens[j], b.hist_cu[j - nd:j - nd + 2]
                k, v = self.expand_kv(*hist[None, h0:h1].split([self.kv_lora_rank, self.rope], dim=-1))
                if h1 - h0 == T:  # nothing cached before the chunk
                    parts.append(self._causal(q[off:off + T], k[0], v[0]))
                else:  # after history
                    n_keys = torch.full((1,), h1 - h0, dtype=torch.int32, device=q.device)
                    parts.append(chunk_attention(q[off:off + T], k[0], v[0], n_keys, self.scale))
                off += T
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._finish(x, o[None], gate, residual, residual_inplace)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One chunk with nothing before it, q, k [T, H, Dq], v [T, H, V] → [T, H, V]: plain causal SDPA (cuDNN's
        fused kernel on the H200; a lower-right causal mask would take the slower memory-efficient one)."""
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=self.scale)
        return o[0].transpose(0, 1)

    def _attend_chunk(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, cache: PagedLayerCache
                      ) -> torch.Tensor:
        """A prefill graph's chunk (`PackedBatch.for_prefill`), q [N, H, Dq] → [N, H, V]: causal within the new
        tokens when nothing precedes them; else over the key rows read from the pages, positions from 0, of which
        the first `key_len` (a device tensor: static shapes) are attended, causal aligned to the last of them."""
        b = cache.batch
        if b.hist_page is None:
            dt = cache.mla_pool().dtype  # the values a read from the pages would give
            k, v = self.expand_kv(c.to(dt).to(c.dtype), k_pe.to(dt).to(k_pe.dtype))
            return self._causal(q, k[0], v[0])
        rows = cache.mla_pool()[b.hist_page, b.hist_off].to(c.dtype)  # [S, C + R]
        k, v = self.expand_kv(*rows[None].split([self.kv_lora_rank, self.rope], dim=-1))
        return chunk_attention(q, k[0], v[0], b.key_len, self.scale)

    def _project_paged(self, x: torch.Tensor, norm_latent: bool = True):
        """x [1, N, D] → (q [1, N, H, Dq], c, k_pe, output-gate logits or None). Without autograd the projections
        of x (q_a or q, kv_a, g) run as one GEMM over their joined weights (cached, `joined_weight`): one
        kernel instead of three in a decode step; with it, `project_q` / `project_latent` as in training.
        norm_latent False: c before `kv_a_layernorm` (the page write applies it)."""
        if torch.is_grad_enabled() and norm_latent:
            return (self.project_q(x), *self.project_latent(x), None)
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        parts = [first.weight, self.kv_a_proj_with_mqa.weight] + ([self.g_proj.weight] if self.g_proj is not None
                                                                 else [])
        w = joined_weight(self, "in_proj", parts, x.dtype, multiple=64)
        n_q, n_kv = first.weight.shape[0], self.kv_lora_rank + self.rope
        n_g = 0 if self.g_proj is None else self.g_proj.weight.shape[0]
        widths = [n_q, self.kv_lora_rank, self.rope, n_g, w.shape[0] - n_q - n_kv - n_g]
        q, c, k_pe, gate, _ = linear(x, w).split(widths, dim=-1)
        if not hasattr(self, "q_proj"):
            qn = self.q_a_layernorm
            q = linear(q, self.q_b_proj.weight, norm=(qn.weight, qn.eps, None))  # q_a_layernorm: its prologue
        return (q.reshape(*x.shape[:2], self.num_heads, self.nope + self.rope),
                self.kv_a_layernorm(c) if norm_latent else c, k_pe, gate if self.g_proj is not None else None)

    def _decode_paged(self, q: torch.Tensor, cache: PagedLayerCache) -> torch.Tensor:
        """The leading single-token documents (decodes), q [nd, H, Dq] → [nd, H, V], absorbed: the paged kernel
        reads the latents from the pool in place; the fallback gathers each padded history first."""
        pool = cache.mla_pool()
        backend = self.decode_backend
        if backend == "auto":
            backend = "triton" if pool.is_cuda and triton_reason(pool) is None else "gather"
        if backend == "gather":
            kv, valid = cache.decode_latents(q.dtype)  # [nd, S, C + R]
            cc, kp = kv.split([self.kv_lora_rank, self.rope], dim=-1)
            return self.attend_absorbed(q[:, None], cc, kp, valid[:, None, None, :])[:, 0]
        w_uk, w_uv = self._kv_b()
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        # head-major [H, nd, C] around the kernel: both absorbed GEMMs are plain batched GEMMs (no permute copies)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q.dtype))
        o_lat = torch.empty_like(q_lat)
        b = cache.batch
        paged_mla_decode(q_lat.transpose(0, 1), q_pe, pool, b.dec_page, b.dec_len, self.scale, backend=backend,
                         out=o_lat.transpose(0, 1), groups=b.dec_groups, table_history=b.dec_history)
        return torch.bmm(o_lat, w_uv.transpose(1, 2).to(o_lat.dtype)).transpose(0, 1)

    def _finish(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, residual_inplace: bool = False) -> torch.Tensor:
        """o [B, T, H, V] → output gate (σ(g_proj(x)); `gate`: its logits, already computed) and o_proj
        (+ residual: in its epilogue without autograd, else residual + o_proj(·)) → [B, T, D]."""
        o = o.reshape(*x.shape[:2], self.num_heads * self.vdim)
        if self.g_proj is not None and gate is None:
            gate = linear(x, self.g_proj.weight)
        # (o ⊙ σ(gate)) W_o^T (+ residual)
        return linear(o, self.o_proj.weight, add=residual, gate=gate, add_inplace=residual_inplace)


def causal_mask(B: int, T: int, past: int, attention_mask: torch.Tensor | None, device) -> torch.Tensor:
    """Boolean [B, 1, T, past + T]: causal and not a padded key. Masked scores get the dtype's finite
    minimum (not −inf), so a fully padded query row gives finite values instead of NaN."""
    S = past + T
    qpos = torch.arange(past, S, device=device).unsqueeze(1)
    allowed = (torch.arange(S, device=device).unsqueeze(0) <= qpos).unsqueeze(0)  # [1, T, S]
    if attention_mask is not None:
        if attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask must be [B, past + T] = [{B}, {S}], got {tuple(attention_mask.shape)}")
        allowed = allowed & attention_mask.bool().unsqueeze(1)
    return allowed.expand(B, T, S).unsqueeze(1)
