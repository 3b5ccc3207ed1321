"""Kimi Delta Attention layer with K3's lower-bounded gate and full-rank output gate (K3_SPEC §2).

Names and shapes follow the release (`self_attn.{q,k,v}_proj`, `{q,k,v}_conv1d`, `f_a_proj`, `f_b_proj`,
`dt_bias`, `A_log` [padded to 128], `b_proj`, `g_proj`, `o_norm`, `o_proj`).

Training / prefill without cache or mask takes the fused path (`fast`, see `_forward_fast`); the masked and
cached (`K3Cache`, generate) paths, and `fast = False`, run the step-by-step code (the fused path's test
oracle). With a `PagedLayerCache` (the serving engine's pool) the packed documents run the fused path's ops
with each document's conv window and state from its slot (`_forward_paged`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K3TextConfig
from ..ops import joined_linear as joined_linear_ops
from ..ops.gemv import linear
from ..ops.conv import short_conv, short_conv_split, short_conv_step
from ..ops.kda import (chunk_kda, chunk_kda_gated, fused_recurrent_kda, kda_decode_step, kda_decode_step_gated,
                      kda_gate)
from ..ops.norm import rms_norm, rms_norm_gated
from .layers import RMSNorm, joined_weight
from .paged_cache import PagedLayerCache

A_LOG_PAD = 128  # the release stores A_log padded to a multiple of 128 entries (only the first H are used)


def _step_backend(backend: str) -> str:
    """The decode step's backend for a layer backend: the PyTorch step for "torch" / "reference", the Triton kernel
    for "triton" (also on the CPU under Triton's interpreter), else "auto"."""
    return {"torch": "torch", "reference": "torch", "triton": "triton"}.get(backend, "auto")


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3TextConfig, layer_idx: int):
        super().__init__()
        la = cfg.linear_attn_config
        D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = la.gate_lower_bound
        self.backend = "auto"  # KDA kernels (`chunk_kda` backends)
        self.fast = True  # fused path without cache / mask; False: the step-by-step path (benchmarks, tests)
        # short conv and output RMSNorm of both paths: "auto" | "reference" (today's PyTorch ops) | "triton"
        self.elementwise_backend = "auto"
        # context parallelism, applied from outside (`k3.parallel.cp.enable_context_parallel`): an executor whose
        # `kda(layer, x, cu_seqlens)` runs this layer on this rank's share of the sequences (training only)
        self.context_parallel = None
        W = la.short_conv_kernel_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(math.ceil(H / A_LOG_PAD) * A_LOG_PAD, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A_log = 0 and dt_bias so that the initial per-channel decay rate −g is log-uniform in [1e-3, 0.1]."""
        self.A_log.zero_()
        rate = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)))
        p = rate / -self.lower_bound
        self.dt_bias.copy_(torch.log(p) - torch.log1p(-p))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: dict | None = None, cu_seqlens: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, residual_inplace: bool = False) -> torch.Tensor:
        """x [B, T, D]; attention_mask [B, ≥T] (1 = token, 0 = padding; the last T columns are used); cache: this
        layer's dict (updated). cu_seqlens: packed documents over the flattened B·T tokens (training; no cache, no
        mask). `residual` [B, T, D]: returned as residual + output (the engine folds it into o_proj's epilogue;
        `residual_inplace`: the caller's own tensor, which that GEMM may accumulate into, see `linear`)."""
        if isinstance(cache, PagedLayerCache):
            if attention_mask is not None or cu_seqlens is not None:
                raise ValueError("KimiDeltaAttention: a paged cache carries its own packing; pass no "
                                 "attention_mask or cu_seqlens with it")
            return self._forward_paged(x, cache, residual, residual_inplace)
        return self._forward(x, attention_mask, cache, cu_seqlens, residual)

    def _forward(self, x: torch.Tensor, attention_mask, cache, cu_seqlens,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output (+ residual: in o_proj's epilogue, `linear`'s addmm)."""
        if self.context_parallel is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError("KimiDeltaAttention: context parallelism takes no cache or attention_mask")
            out = self.context_parallel.kda(self, x, cu_seqlens)
            return out if residual is None else residual + out
        B, T, _ = x.shape
        if cu_seqlens is not None and (cache is not None or attention_mask is not None):
            raise ValueError("KimiDeltaAttention: cu_seqlens cannot be combined with a cache or an attention_mask")
        if self.fast and cache is None and attention_mask is None:
            return self._forward_fast(x, cu_seqlens, residual)
        H, K = self.num_heads, self.head_dim
        m = None if attention_mask is None else attention_mask[:, -T:].to(x.dtype).unsqueeze(-1)  # [B, T, 1]

        def proj_conv(lin: nn.Linear, conv: nn.Conv1d, name: str) -> torch.Tensor:
            y = lin(x)
            if m is not None:  # padding contributes nothing to the conv window
                y = y * m
            state = None if cache is None else cache.get(name)
            y, new_state = short_conv(y, conv.weight, state, output_final_state=cache is not None,
                                      cu_seqlens=cu_seqlens, backend=self.elementwise_backend)
            if cache is not None:
                cache[name] = new_state
            return y.view(B, T, H, -1)

        q = proj_conv(self.q_proj, self.q_conv1d, "conv_q")
        k = proj_conv(self.k_proj, self.k_conv1d, "conv_k")
        v = proj_conv(self.v_proj, self.v_conv1d, "conv_v")
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log[:H], self.dt_bias,
                     self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if m is not None:  # padded positions: identity transition (no decay, no write)
            g = g * m.float().unsqueeze(-1)
            beta = beta * m.float()
        state = None if cache is None else cache.get("state")
        kw = dict(initial_state=state, output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
        if cu_seqlens is not None:  # one packed row, fla's varlen convention
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            o, new_state = chunk_kda(*flat, cu_seqlens=cu_seqlens, backend=self.backend,
                                     g_lower_bound=self.lower_bound, **kw)
            o = o.view(B, T, H, -1)
        elif cache is not None and T <= 16 and not torch.is_grad_enabled():
            o, new_state = fused_recurrent_kda(q, k, v, g, beta, **kw)
        else:
            o, new_state = chunk_kda(q, k, v, g, beta, backend=self.backend, g_lower_bound=self.lower_bound, **kw)
        if cache is not None:
            cache["state"] = new_state
        o = rms_norm(o.float(), self.o_norm.weight, self.o_norm.eps, backend=self.elementwise_backend)  # = o_norm
        o = o * torch.sigmoid(self.g_proj(x).float()).view(B, T, H, K)
        return linear(o.reshape(B, T, H * K).to(x.dtype), self.o_proj.weight, add=residual)

    def _forward_fast(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """The same function as the step-by-step path without cache / mask, in fewer passes over memory: one GEMM
        for q, k, v (their weights concatenated at run time; the checkpoint keeps the three), one short conv
        (+ SiLU) over the 3·H·K channels writing q, k, v as separate contiguous tensors, `chunk_kda_gated` on the
        raw gate pre-activation and β logits (the Triton backend fuses gate, β sigmoid and q/k l2norm; the
        others apply them in PyTorch), and the output gate as one `rms_norm_gated` (fp32 math, one rounding)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        HK = H * K
        w_qkv = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        if joined_linear_ops.ENABLED:  # the four projections of x as one GEMM (`k3.ops.joined_linear`)
            y, fa, b, gate = joined_linear_ops.joined_linear(
                x, [w_qkv, self.f_a_proj.weight, self.b_proj.weight, self.g_proj.weight])
        else:
            y, fa, b, gate = F.linear(x, torch.cat(w_qkv)), self.f_a_proj(x), self.b_proj(x), None
        w_conv = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        q, k, v = short_conv_split(y, w_conv, (HK, HK, HK), cu_seqlens=cu_seqlens, backend=self.elementwise_backend)
        f = self.f_b_proj(fa)
        rows = (1, B * T) if cu_seqlens is not None else (B, T)  # packed documents: one row (fla's convention)
        o, _ = chunk_kda_gated(q.view(*rows, H, K), k.view(*rows, H, K), v.view(*rows, H, K), f.view(*rows, H, K),
                               b.view(*rows, H), self.A_log[:H], self.dt_bias, cu_seqlens=cu_seqlens,
                               use_qk_l2norm_in_kernel=True, lower_bound=self.lower_bound, backend=self.backend)
        gate = self.g_proj(x) if gate is None else gate
        o = rms_norm_gated(o.reshape(B, T, H, K), self.o_norm.weight, gate.view(B, T, H, K), self.o_norm.eps,
                           backend=self.elementwise_backend)
        return linear(o.reshape(B, T, HK), self.o_proj.weight, add=residual)

    def _forward_paged(self, x: torch.Tensor, cache: PagedLayerCache, residual: torch.Tensor | None = None,
                       residual_inplace: bool = False) -> torch.Tensor:
        """x [1, N, D]: packed documents continuing cached sequences (`PackedBatch`), the fused path's ops.

        Short conv: `short_conv_step` reads each document's W-1 cached inputs from its pool slot, convolves its
        tokens (one program per `CONV_TILE`-token tile) and advances the window in place; checkpoint windows are
        the token rows before each checkpoint. KDA: `kda_decode_step` on the gathered states for the leading
        single-token documents, `chunk_kda_gated` (the training kernel) over the others with their states as
        initial states.
        A pure decode batch (every document one token) or an extend batch (`PackedBatch.for_extend`: a few tokens
        per sequence, stepped through recurrently) instead updates each slot's conv window and state in place
        (`short_conv_step`, `kda_decode_step_gated`): no gather / scatter of the states, no data-dependent shape
        (the engine captures it in a CUDA graph)."""
        b = cache.batch
        N, H, K = x.shape[1], self.num_heads, self.head_dim
        HK = H * K
        convs = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        # the taps in the step kernels' fp32 (or wider), cached: no cast kernel per step
        w_conv = joined_weight(self, "conv_wide", convs, torch.promote_types(convs[0].dtype, torch.float32))
        # the six projections of x as one GEMM over their joined weights (cached for inference), padded to an
        # aligned width (4·H·K + K + H = 6,284 in k3-small: cuBLAS took an unaligned sm80 kernel, 0.63 ms at 8K)
        w = joined_weight(self, "in_proj", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                            self.f_a_proj.weight, self.b_proj.weight, self.g_proj.weight], x.dtype,
                          multiple=64)
        y, fa, beta_logit, gate, _ = linear(x[0], w).split([3 * HK, K, H, HK, w.shape[0] - 4 * HK - K - H], dim=-1)
        f = linear(fa, self.f_b_proj.weight).view(N, H, K)
        backend = cache.pc.kda_backend or self.backend
        if b.decode or b.graph_prefill:  # decode / extend / graph prefill: slots' conv windows and states in place
            if b.step_states_at is not None:  # the checkpoints' conv windows: the inputs before each
                windows = y[b.ckpt_win_rows].transpose(1, 2)
            q, k, v = short_conv_step(y, w_conv, cache.conv_pool(), b.slots, cu_seqlens=b.step_cu,
                                      tiles=b.conv_tiles).split(HK, dim=-1)
            o = kda_decode_step_gated(q.reshape(N, H, K), k.reshape(N, H, K), v.reshape(N, H, K), f, beta_logit,
                                      self.A_log[:H], self.dt_bias, cache.state_pool(), b.slots, self.lower_bound,
                                      backend=_step_backend(backend), cu_seqlens=b.step_cu, chunks=b.step_chunks,
                                      states_at=b.step_states_at, state_slots=b.step_state_slots)
            if b.step_states_at is not None:
                o, states = o
                cache.write_checkpoints(windows, states)
            return self._output(o, gate, residual, residual_inplace)
        # each document's tokens against its window in the pool (advanced in place), one program per token tile
        q, k, v = (t.reshape(N, H, K) for t in short_conv_step(
            y, w_conv, cache.conv_pool(), b.slots, cu_seqlens=b.cu_seqlens, tiles=b.conv_tiles).split(HK, dim=-1))
        nd, s0 = b.num_decode, cache.states()
        o, s = [], []
        if nd:  # the leading single-token documents: one recurrent step each
            g = kda_gate(f[None, :nd], self.A_log[:H], self.dt_bias, self.lower_bound)[0]
            od, sd = kda_decode_step(q[:nd], k[:nd], v[:nd], g, torch.sigmoid(beta_logit[:nd].float()), s0[:nd],
                                     use_qk_l2norm_in_kernel=True,
                                     backend=_step_backend(backend))
            o.append(od)
            s.append(sd)
        if nd < b.num_docs:  # the others: chunked, from their states (and the states at checkpoints inside)
            out = chunk_kda_gated(q[None, nd:], k[None, nd:], v[None, nd:], f[None, nd:], beta_logit[None, nd:],
                                  self.A_log[:H], self.dt_bias, initial_state=s0[nd:], output_final_state=True,
                                  cu_seqlens=b.chunk_cu_seqlens, use_qk_l2norm_in_kernel=True,
                                  lower_bound=self.lower_bound, backend=backend, states_at=b.ckpt_pos)
            if b.ckpt_pos is not None:
                cache.write_checkpoints(y[b.ckpt_win_rows].transpose(1, 2), out[2])
            o.append(out[0][0])
            s.append(out[1])
        o, s = (o[0], s[0]) if len(o) == 1 else (torch.cat(o), torch.cat(s))
        cache.set_states(s)
        return self._output(o, gate, residual, residual_inplace)

    def _output(self, o: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor | None = None,
                residual_inplace: bool = False) -> torch.Tensor:
        """o [N, H, V], gate = g_proj(x) [N, H·V] → o_norm, output gate (`rms_norm_gated`, or the GEMV's prologue
        in a decode step), o_proj (+ residual in its epilogue) → [1, N, D]."""
        N, H, K = o.shape
        return linear(o.reshape(1, N, H * K), self.o_proj.weight, add=residual, gate=gate.reshape(1, N, H * K),
                      norm=(self.o_norm.weight, self.o_norm.eps, K),  # a GEMV's prologue in a decode step
                      add_inplace=residual_inplace)
