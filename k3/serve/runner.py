"""Model execution over the paged pool.

One forward processes a packed batch: first the decode sequences (one token each), then the prefill
chunks. Token-wise parts (embedding, AttnRes mixing, norms, projections, MoE/MLP, LM head) run on all packed
tokens at once using the model's own modules; only the token mixers are re-implemented here over the pool:

- KDA: short-conv windows and fp32 states live in each sequence's KDA slot; decode uses `kda_decode_step`
  on the state pool (indices = slots), prefill chunks use `chunk_kda` with cu_seqlens and initial states.
- MLA: the chunk's latents `c ‖ k_pe` are written into the sequence's MLA pages, then attention reads the
  sequence's rows back from its page table (absorbed form for decode, expanded keys for prefill).

The layer bookkeeping replicates `KimiDecoderLayer.forward_attn_res`; tests check the result against the
model's own forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.decoder import _mix
from ..ops.kda import chunk_kda, kda_decode_step, kda_gate
from ..ops.moe import experts_forward, route
from .pool import PagePool


def grouped_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """LatentMoE forward without a host sync in any dtype torch's grouped GEMM takes: `experts_forward` with
    the grouped path forced (the model's own forward takes it only for bf16 CUDA activations and otherwise
    loops over experts with host-side counts). Same math as `LatentMoE.forward`. x [N, D] → [N, D]."""
    cfg = moe.cfg
    idx, w, _ = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.top_k, cfg.moe_renormalize,
                      cfg.routed_scaling_factor)
    e = moe.experts
    y = experts_forward(moe.routed_expert_down_proj(x), idx, w, e.w1, e.w2, e.w3, cfg.activation_situ_beta,
                        cfg.activation_situ_linear_beta, grouped=True)
    if moe.routed_expert_norm is not None:
        y = moe.routed_expert_norm(y)
    out = moe.routed_expert_up_proj(y)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


@dataclass
class SeqInput:
    """One sequence's share of a forward: `tokens` at positions [start, start + len)."""
    tokens: list[int]
    start: int
    state_page: int
    mla_pages: list[int]
    want_logits: bool


def text_model(model):
    """The `KimiLinearForCausalLM` inside a K3ForConditionalGeneration (or the model itself)."""
    return model.language_model if hasattr(model, "language_model") else model


class ModelRunner:
    def __init__(self, model, pool: PagePool, kda_backend: str = "auto"):
        self.lm = text_model(model)
        self.cfg = self.lm.config
        self.pool = pool
        self.B = pool.layout.block_size
        self.kda_backend = kda_backend
        # the decode dispatch takes a backend once the Triton kernel is in (older versions: torch only)
        self.decode_kw = ({"backend": "torch" if kda_backend in ("torch", "reference") else "auto"}
                          if "backend" in inspect.signature(kda_decode_step).parameters else {})
        self.layers = self.lm.model.decoder_layers
        self.slot = {}  # layer index -> index among KDA (resp. MLA) layers in the pool
        nk = nm = 0
        for layer in self.layers:
            if layer.is_kda:
                self.slot[layer.layer_idx], nk = nk, nk + 1
            else:
                self.slot[layer.layer_idx], nm = nm, nm + 1
        self.device = self.lm.lm_head.weight.device
        self.dtype = self.lm.model.embed_tokens.weight.dtype
        self.grouped_moe = self._check_grouped_moe()

    @torch.no_grad()
    def _check_grouped_moe(self) -> bool:
        """Use `grouped_moe` only where torch has it and it agrees with the model's MoE on random input."""
        moe = next((l.block_sparse_moe for l in self.layers if hasattr(l, "block_sparse_moe")), None)
        if moe is None or not hasattr(torch, "_grouped_mm") or moe.record_routing:
            return False
        g = torch.Generator(device=self.device).manual_seed(0)
        x = torch.randn(13, self.cfg.hidden_size, generator=g, device=self.device).to(self.dtype)
        try:
            a, b = grouped_moe(moe, x).float(), moe(x).float()
        except (RuntimeError, NotImplementedError):
            return False
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        return bool(((a - b).norm() / b.norm().clamp_min(1e-30)) <= tol)

    # ---- batch metadata -----------------------------------------------------------------------
    def _meta(self, seqs: list[SeqInput], nd: int) -> dict:
        dev, B = self.device, self.B
        # (page, row) of every packed token: decodes one by one, prefill chunks vectorised on the host
        pos = [torch.tensor([s.start for s in seqs[:nd]], dtype=torch.long)]
        page = [torch.tensor([s.mla_pages[s.start // B] for s in seqs[:nd]], dtype=torch.long)]
        for s in seqs[nd:]:
            p = torch.arange(s.start, s.start + len(s.tokens))
            pos.append(p)
            page.append(torch.tensor(s.mla_pages, dtype=torch.long)[p // B])
        pos = torch.cat(pos)
        m = dict(
            ids=torch.tensor([t for s in seqs for t in s.tokens], device=dev),
            tok_page=torch.cat(page).to(dev), tok_off=(pos % B).to(dev),
            slots=torch.tensor([s.state_page for s in seqs], device=dev),
        )
        if nd:  # decode: gather index [nd, S] over each sequence's rows [0, start + 1)
            lens = [s.start + 1 for s in seqs[:nd]]
            S = max(lens)
            npg = -(-S // B)
            table = torch.tensor([s.mla_pages[:npg] + [0] * (npg - len(s.mla_pages[:npg])) for s in seqs[:nd]],
                                 device=dev)
            pos = torch.arange(S, device=dev)
            m["dec_page"] = table[:, pos // B]
            m["dec_off"] = (pos % B).expand(nd, S)
            m["dec_valid"] = pos[None, :] < torch.tensor(lens, device=dev)[:, None]
        if nd < len(seqs):  # packed conv layout for prefill: per sequence W-1 window rows, then its tokens
            Wm1 = self.pool.layout.conv_width
            st_rows, tok_rows, last_rows, r = [], [], [], 0
            for s in seqs[nd:]:
                T = len(s.tokens)
                st_rows.extend(range(r, r + Wm1))
                tok_rows.extend(range(r + Wm1, r + Wm1 + T))
                last_rows.append(list(range(r + T, r + T + Wm1)))
                r += Wm1 + T
            m["ext_len"] = r
            m["ext_state_rows"] = torch.tensor(st_rows, device=dev, dtype=torch.long)
            m["ext_tok_rows"] = torch.tensor(tok_rows, device=dev, dtype=torch.long)
            m["ext_last_rows"] = torch.tensor(last_rows, device=dev, dtype=torch.long)  # [np, W-1]
        rows, n = [], 0
        for s in seqs:
            n += len(s.tokens)
            if s.want_logits:
                rows.append(n - 1)
        m["rows"] = torch.tensor(rows, device=dev, dtype=torch.long)
        return m

    # ---- forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run one packed forward; returns fp32 logits [n, V] for the sequences with `want_logits`, in order.
        Decode sequences (exactly one token, start > 0 or not) must come first."""
        nd = 0
        while nd < len(seqs) and len(seqs[nd].tokens) == 1:
            nd += 1
        if any(len(s.tokens) == 0 for s in seqs):
            raise ValueError("empty SeqInput")
        meta = self._meta(seqs, nd)
        meta["nd"] = nd
        meta["seqs"] = seqs
        x = self.lm.model.embed_tokens(meta["ids"])[None]  # [1, N, D]
        bs = self.cfg.attn_res_block_size
        blocks, partial = [x], None
        for layer in self.layers:
            h = blocks[0] if partial is None else _mix(blocks + [partial], layer.self_attention_res_norm,
                                                       layer.self_attention_res_proj)
            if layer.layer_idx % bs == 0 and partial is not None:
                blocks = blocks + [partial]
                partial = None
            hn = layer.input_layernorm(h)
            a = (self._kda if layer.is_kda else self._mla)(layer.self_attn, self.slot[layer.layer_idx], hn[0], meta)
            a = a[None]
            partial = a if partial is None else partial + a
            h = _mix(blocks + [partial], layer.mlp_res_norm, layer.mlp_res_proj)
            if self.grouped_moe and hasattr(layer, "block_sparse_moe"):
                f = grouped_moe(layer.block_sparse_moe, layer.post_attention_layernorm(h[0]))[None]
            else:
                f = layer.ffn(h)
            partial = partial + f
        rows = meta["rows"]
        if rows.numel() == 0:
            return torch.empty(0, self.cfg.vocab_size, device=self.device)
        sel = [b[:, rows] for b in blocks] + [partial[:, rows]]
        m = self.lm.model
        h = _mix(sel, m.output_attn_res_norm, m.output_attn_res_proj)
        return self.lm.lm_head(m.norm(h))[0].float()

    # ---- KDA over KDA slots -------------------------------------------------------------------------
    def _kda(self, attn, k: int, x: torch.Tensor, meta: dict) -> torch.Tensor:
        """x [N, D] (normed) → [N, D]; reads and updates the sequences' KDA slots for KDA layer k."""
        N = x.shape[0]
        H, K = attn.num_heads, attn.head_dim
        nd, seqs, slots = meta["nd"], meta["seqs"], meta["slots"]
        conv_pool = self.pool.conv[:, k]  # [P, 3, C, W-1]: q, k, v windows
        win_d = conv_pool[slots[:nd]] if nd else None  # one gather for all three windows
        win_p = conv_pool[slots[nd:]] if nd < len(seqs) else None
        new_d, new_p, qkv = [], [], []
        for j, (lin, conv) in enumerate(((attn.q_proj, attn.q_conv1d), (attn.k_proj, attn.k_conv1d),
                                         (attn.v_proj, attn.v_conv1d))):
            y = lin(x)  # [N, C]
            C = y.shape[-1]
            w = conv.weight.to(y.dtype)
            out = torch.empty_like(y)
            if nd:
                xp = torch.cat([win_d[:, j].to(y.dtype), y[:nd, :, None]], dim=-1)  # [nd, C, W]
                out[:nd] = (xp.float() * w[:, 0].float()).sum(-1).to(y.dtype)  # one output per window
                new_d.append(xp[..., 1:])
            if win_p is not None:  # prefill chunks: [window ‖ chunk] per sequence, packed; W taps gathered
                ext = y.new_empty(meta["ext_len"], C)
                ext[meta["ext_state_rows"]] = win_p[:, j].to(y.dtype).transpose(1, 2).reshape(-1, C)
                ext[meta["ext_tok_rows"]] = y[nd:]
                W = w.shape[-1]
                acc = torch.zeros(y.shape[0] - nd, C, dtype=torch.float32, device=y.device)
                for t in range(W):  # fp32 accumulation, like conv1d's
                    acc += ext[meta["ext_tok_rows"] - (W - 1) + t].float() * w[:, 0, t].float()
                out[nd:] = acc.to(y.dtype)
                new_p.append(ext[meta["ext_last_rows"]].transpose(1, 2))
            qkv.append(F.silu(out).view(N, H, -1))
        if nd:
            conv_pool[slots[:nd]] = torch.stack(new_d, 1).to(conv_pool.dtype)
        if win_p is not None:
            conv_pool[slots[nd:]] = torch.stack(new_p, 1).to(conv_pool.dtype)
        q, kk, v = qkv
        g = kda_gate(attn.f_b_proj(attn.f_a_proj(x)).view(1, N, H, K), attn.A_log[:H], attn.dt_bias,
                     attn.lower_bound)[0]
        beta = torch.sigmoid(attn.b_proj(x).float())
        state_pool = self.pool.state[:, k]  # [P, H, K, V] fp32
        o = torch.empty(N, H, v.shape[-1], dtype=v.dtype, device=x.device)
        if nd:  # gather the slots into a contiguous batch (the Triton decode kernel wants one), scatter back
            st = state_pool[slots[:nd]]
            o[:nd], st = kda_decode_step(q[:nd], kk[:nd], v[:nd], g[:nd], beta[:nd], st,
                                         use_qk_l2norm_in_kernel=True, **self.decode_kw)
            state_pool[slots[:nd]] = st
        if nd < len(seqs):
            lens = [len(s.tokens) for s in seqs[nd:]]
            cu = torch.tensor([0] + lens, device=x.device).cumsum(0)
            pslots = slots[nd:]
            op, S = chunk_kda(q[None, nd:], kk[None, nd:], v[None, nd:], g[None, nd:], beta[None, nd:],
                              initial_state=state_pool[pslots].contiguous(), output_final_state=True,
                              cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend=self.kda_backend)
            o[nd:] = op[0]
            state_pool[pslots] = S.to(state_pool.dtype)
        o = attn.o_norm(o.float()) * torch.sigmoid(attn.g_proj(x).float()).view(N, H, K)
        return attn.o_proj(o.reshape(N, H * K).to(x.dtype))

    # ---- MLA over MLA pages ---------------------------------------------------------------------------
    def _mla(self, attn, m: int, x: torch.Tensor, meta: dict) -> torch.Tensor:
        N = x.shape[0]
        nd, seqs = meta["nd"], meta["seqs"]
        q = attn.project_q(x[None])[0]  # [N, H, Dq]
        c, k_pe = attn.project_latent(x[None])
        kv_pool = self.pool.mla[:, m]  # [P, B, C + R]
        kv_pool[meta["tok_page"], meta["tok_off"]] = torch.cat([c[0], k_pe[0]], dim=-1).to(kv_pool.dtype)
        Cw = attn.kv_lora_rank
        o = torch.empty(N, attn.num_heads, attn.vdim, dtype=x.dtype, device=x.device)
        if nd:
            kv = kv_pool[meta["dec_page"], meta["dec_off"]].to(x.dtype)  # [nd, S, C + R]
            valid = meta["dec_valid"]
            kv = torch.where(valid[..., None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
            cc, kp = kv.split([Cw, attn.rope], dim=-1)
            w_uk, w_uv = attn._kv_b()
            q_nope, q_pe = q[:nd].split([attn.nope, attn.rope], dim=-1)
            q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
            scores = torch.einsum("nhc,nsc->nhs", q_lat, cc) + torch.einsum("nhr,nsr->nhs", q_pe, kp)
            acc = torch.promote_types(scores.dtype, torch.float32)
            scores = (scores.to(acc) * attn.scale).masked_fill(~valid[:, None, :], torch.finfo(acc).min)
            p = torch.softmax(scores, dim=-1).to(cc.dtype)
            o[:nd] = torch.einsum("nhc,hvc->nhv", torch.einsum("nhs,nsc->nhc", p, cc), w_uv)
        off = nd
        B = self.B
        for s in seqs[nd:]:
            T, S = len(s.tokens), s.start + len(s.tokens)
            if s.start == 0:
                cc, kp = c[0, off:off + T], k_pe[0, off:off + T]
            else:
                pos = torch.arange(S, device=x.device)
                pages = torch.tensor(s.mla_pages[:-(-S // B)], device=x.device)
                kv = kv_pool[pages[pos // B], pos % B].to(x.dtype)
                cc, kp = kv.split([Cw, attn.rope], dim=-1)
            kvb = attn.kv_b_proj(cc).view(S, attn.num_heads, attn.nope + attn.vdim)
            k_nope, v = kvb.split([attn.nope, attn.vdim], dim=-1)
            kk = torch.cat([k_nope, kp[:, None, :].expand(-1, attn.num_heads, -1)], dim=-1)
            qq = q[off:off + T].transpose(0, 1)[None]  # [1, H, T, Dq]
            if s.start == 0:
                bias = None
            else:
                allowed = (torch.arange(S, device=x.device)[None, :]
                           <= torch.arange(s.start, S, device=x.device)[:, None])  # [T, S]
                bias = torch.zeros(allowed.shape, dtype=qq.dtype, device=x.device).masked_fill(
                    ~allowed, torch.finfo(qq.dtype).min)
            out = F.scaled_dot_product_attention(qq, kk.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                 attn_mask=bias, is_causal=bias is None, scale=attn.scale)
            o[off:off + T] = out[0].transpose(0, 1)
            off += T
        o = o.reshape(N, attn.num_heads * attn.vdim)
        if attn.g_proj is not None:
            o = o * torch.sigmoid(attn.g_proj(x))
        return attn.o_proj(o)
