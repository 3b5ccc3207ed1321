"""Stable LatentMoE: router + selection bias, latent routed experts (SiTU-GLU), RMSNorm, shared experts.

    x ─ routed_expert_down_proj → latent ─ top-k experts → Σ w·expert → routed_expert_norm
      → routed_expert_up_proj → + shared_experts(x)

Routed experts are stacked [E, out, in] inside the module (`experts.w1/w2/w3`) for batched training;
the checkpoint I/O layer maps them to the release's per-expert `experts.{e}.w{1,2,3}` tensors.
On CUDA with bf16 activations (training under autocast) the router stays fp32 without an fp32 copy of the
input, and the experts run as grouped GEMMs with w1 ‖ w3 fused, Triton SiTU-GLU and a Triton combine, no host
sync (`k3.ops.moe`); elsewhere a per-expert loop.

Inference joins the latent, shared-expert and router projections of x into one GEMM (GEMV when decoding).

Expert parallel is applied from outside (the model never imports `k3.parallel`):
`k3.parallel.moonep.enable_expert_parallel(model, group)` hands every LatentMoE an EP executor through
`set_expert_parallel(ep)`, which keeps only the rank's home experts E/R in `experts.w1/w2/w3` and routes them
through MoonEP; `k3.parallel.moonep.gathered_experts(model)` gives the full layout back for saving.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3TextConfig
from ..ops import joined_linear as joined_linear_ops, moe_block
from ..ops._triton import grid_counters
from ..ops.gemv import linear, linear_fp32_tail
from ..ops.moe import experts_forward, route, routed_decode_fits
from .layers import RMSNorm, SituMLP, joined_weight


class MoEGate(nn.Module):
    """`gate.weight` [E, D] and the QB / aux-loss-free selection bias `gate.e_score_correction_bias` [E]."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class StackedExperts(nn.Module):
    """All routed experts of one layer: w1 (gate) and w3 (up) [E, I, L], w2 (down) [E, L, I]."""

    def __init__(self, num_experts: int, latent: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, intermediate))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, latent))


@torch.no_grad()
def fuse_gate_up(model: nn.Module) -> int:
    """Lay every `StackedExperts`' w1 and w3 out as the two halves of one [E, 2I, L] tensor (same parameters,
    same values, no extra memory once the old storages are freed), so that inference runs each expert's gate
    and up projections as ONE grouped GEMM on the weights in place (`k3.ops.situ.gate_up_view`). In-place
    weight loads (`load_state_dict`, `Engine.update_weights`) keep the layout; `.to()` / `set_expert_parallel`
    build new tensors and merely fall back to two GEMMs. Returns the number of layers laid out."""
    from ..ops.situ import gate_up_view
    n = 0
    for m in model.modules():
        if isinstance(m, StackedExperts) and m.w1.shape == m.w3.shape and m.w1.dtype == m.w3.dtype:
            if gate_up_view(m.w1, m.w3) is None:
                I = m.w1.shape[1]
                w13 = torch.cat([m.w1, m.w3], 1)
                m.w1.data, m.w3.data = w13[:, :I], w13[:, I:]
            n += 1
    return n


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3TextConfig):
        super().__init__()
        D, L = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_token
        self.gate = MoEGate(D, cfg.num_experts)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = StackedExperts(cfg.num_experts, L, cfg.moe_intermediate_size)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.shared_experts = (SituMLP(D, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                       cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
                               if cfg.num_shared_experts > 0 else None)
        self.record_routing = False  # keep (topk_idx, scores) of the last forward, e.g. for balancing
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None
        self.expert_parallel = None  # an EP executor (k3.parallel.moonep.ExpertParallel) when sharded

    @torch.no_grad()
    def set_expert_parallel(self, ep) -> None:
        """Shard the routed experts for an EP executor `ep` (anything with `.rank`, `.num_local(E)` and the
        call signature of `experts_forward` plus `num_experts`, e.g. `k3.parallel.moonep.ExpertParallel`):
        keep rows [rank·E/R, (rank+1)·E/R) of w1/w2/w3 (the same values on every rank before the call)."""
        n = ep.num_local(self.cfg.num_experts)
        if self.experts.w1.shape[0] != self.cfg.num_experts:
            raise ValueError(f"experts hold {self.experts.w1.shape[0]} rows, expected all {self.cfg.num_experts}")
        lo = ep.rank * n
        for k in ("w1", "w2", "w3"):
            p = getattr(self.experts, k)
            setattr(self.experts, k, nn.Parameter(p[lo:lo + n].clone(), requires_grad=p.requires_grad))
        self.expert_parallel = ep

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_inplace: bool = False) -> torch.Tensor:
        """x [.., D] → the routed + shared experts' output (+ `residual`, x's shape: residual + output; inference
        folds it into the shared experts' down projection, whose output is the up projection's accumulator;
        `residual_inplace`: the caller's own tensor, which that projection may accumulate into, see `linear`)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        sh, down, router = self.shared_experts, self.routed_expert_down_proj.weight, self.gate.weight
        joined = (sh is not None and self.expert_parallel is None and not torch.is_grad_enabled()
                  and not torch.is_autocast_enabled(x.device.type) and router.dtype == down.dtype)
        logits = gate_up = None
        if joined:  # inference: x's latent, the shared experts' gate ‖ up and the router's logits (fp32) as one
            # GEMM (a GEMV in a decode step) over joined weights
            w_in = joined_weight(self, "in_proj", [down, sh.gate_proj.weight, sh.up_proj.weight, router], down.dtype)
            if self._block_fits(xf, w_in):  # a batch-1 decode step: the whole MoE as one kernel (K3_MOE_BLOCK)
                return self._block_decode(xf, w_in, residual).reshape(shape)
            y_in, logits = linear_fp32_tail(xf, w_in, router.shape[0])
            lat, gate_up = y_in.split([down.shape[0], y_in.shape[-1] - down.shape[0]], dim=-1)
        elif sh is not None and joined_linear_ops.ENABLED and torch.is_grad_enabled():
            # training: x's latent and the shared experts' gate ‖ up as one GEMM (`k3.ops.joined_linear`)
            lat, gate_up = joined_linear_ops.joined_linear(xf, [down, [sh.gate_proj.weight, sh.up_proj.weight]])
        else:
            lat = linear(xf, down)
        ex, beta, lbeta = self.experts, self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta
        if logits is not None and routed_decode_fits(lat, self.top_k, ex.w1, ex.w2, ex.w3):
            # a decode step: the experts chosen inside the two expert kernels (K3_MOE_ROUTE_IN_EXPERTS=0: not)
            from ..ops.moe_decode import experts_decode_routed
            y, idx, w, scores = experts_decode_routed(
                lat, logits, self.gate.e_score_correction_bias, self.top_k, self.cfg.moe_renormalize,
                self.cfg.routed_scaling_factor, ex.w1, ex.w2, ex.w3, beta, lbeta)
        else:
            idx, w, scores = route(xf, router, self.gate.e_score_correction_bias, self.top_k,
                                   self.cfg.moe_renormalize, self.cfg.routed_scaling_factor, logits=logits)
            run = experts_forward if self.expert_parallel is None else self._ep_forward
            y = run(lat, idx, w, ex.w1, ex.w2, ex.w3, beta, lbeta)
        if self.record_routing:
            self.last_routing = (idx.detach(), scores.detach())
        rn = self.routed_expert_norm  # applied by the up projection (a GEMV's prologue in a decode step)
        norm = None if rn is None else (rn.weight, rn.eps, None)
        res = None if residual is None else residual.reshape(-1, shape[-1])
        if self.shared_experts is None:
            return linear(y, self.routed_expert_up_proj.weight, add=res, norm=norm,
                          add_inplace=residual_inplace).reshape(shape)
        if torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            # residual + shared + routed as two GEMM epilogues (`linear`'s addmm), no add kernels
            shared = sh(xf, res) if gate_up is None else sh.down(gate_up, res)
            return linear(y if rn is None else rn(y), self.routed_expert_up_proj.weight, add=shared).reshape(shape)
        # inference: residual + shared experts as the up projection's accumulator (no add kernel)
        # the shared experts' output is a new tensor: the up projection accumulates into it in place
        shared = sh.down(gate_up, res, residual_inplace) if joined else sh(xf, res, residual_inplace)
        return linear(y, self.routed_expert_up_proj.weight, add=shared, norm=norm, add_inplace=True).reshape(shape)

    def _block_fits(self, xf: torch.Tensor, w_in: torch.Tensor) -> bool:
        sh, ex, up = self.shared_experts, self.experts, self.routed_expert_up_proj.weight
        return (moe_block.ON and (sh.beta, sh.linear_beta) == (self.cfg.activation_situ_beta,
                                                               self.cfg.activation_situ_linear_beta)
                and moe_block.fits(xf, w_in, ex.w1, ex.w2, ex.w3, sh.down_proj.weight, up))

    def _block_decode(self, xf: torch.Tensor, w_in: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """`forward`'s joined inference branch for one row as one persistent kernel (`k3.ops.moe_block`)."""
        sh, ex, rn = self.shared_experts, self.experts, self.routed_expert_norm
        bias = self.gate.e_score_correction_bias
        out, idx, _, scores = moe_block.moe_block_decode(
            xf, w_in, self.routed_expert_down_proj.weight.shape[0], sh.gate_proj.weight.shape[0], ex.w1, ex.w2,
            ex.w3, sh.down_proj.weight, self.routed_expert_up_proj.weight, None if rn is None else (rn.weight, rn.eps),
            None if bias is None else bias.float(), self.top_k, self.cfg.moe_renormalize,
            self.cfg.routed_scaling_factor, sh.beta, sh.linear_beta,
            None if residual is None else residual.reshape(1, -1).contiguous(),
            grid_counters(self, xf.device))
        if self.record_routing:
            self.last_routing = (idx, scores)
        return out

    def _ep_forward(self, lat, idx, w, w1, w2, w3, beta, linear_beta):
        return self.expert_parallel(lat, idx, w, w1, w2, w3, self.cfg.num_experts, beta, linear_beta)
