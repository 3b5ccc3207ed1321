"""QK-clip (MuonClip, Kimi K2; kept in K3) on the Gated MLA layers (K3_SPEC §7, checkpoint notes §7.4).

During a training step each MLA head's largest pre-softmax logit S_h = max scale·q·k is tracked (running
max over the step's forwards, i.e. over gradient-accumulation micro-batches). After the optimizer step every
head with S_h > τ gets γ_h = τ / S_h: its head-specific query and key rows are rescaled so that every logit
of that head is multiplied by exactly γ_h:

    q_nope rows (q_b_proj) × √γ,  k_nope rows (kv_b_proj) × √γ,  q_rope rows (q_b_proj) × γ;

the rope key slice `k_pe` from `kv_a_proj_with_mqa` is shared by all heads and is left untouched, and the
value rows of kv_b_proj are not logits and are left untouched. KDA layers need no clip (q, k are
L2-normalised).

The logits come from `MLAttention.record_max_logit = True` / `.max_logit` (fp32 [H], last forward); a forward
hook folds each training forward's values into the step's running max (gradient accumulation; recomputed
checkpointed forwards give the same values again, which the max absorbs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model.mla import MLAttention


class QKClip:
    """Tracks per-head max logits of every MLA layer of `model` in training forwards; `step()` (call right
    after `optimizer.step()`) rescales the heads above τ and starts the next step's tracking."""

    def __init__(self, model: nn.Module, tau: float = 100.0, group: "dist.ProcessGroup | None" = None):
        """group: the data-parallel ranks whose maxima are combined (one all_reduce MAX per step, so every
        replica clips identically); default the world group when torch.distributed is initialised."""
        if not tau > 0:
            raise ValueError(f"tau={tau}: expected > 0")
        self.tau, self.group = float(tau), group
        self.layers: dict[str, MLAttention] = {n: m for n, m in model.named_modules() if isinstance(m, MLAttention)}
        self.running: dict[str, torch.Tensor] = {}
        self._hooks = []
        for name, mod in self.layers.items():
            mod.record_max_logit = True
            self._hooks.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(mod: MLAttention, args, out):
            mx = mod.max_logit
            if not mod.training or mx is None:
                return
            prev = self.running.get(name)
            self.running[name] = mx.detach().float().clone() if prev is None else torch.maximum(prev, mx.to(prev.device))
        return hook

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Clip every head whose step max exceeded τ; reset tracking. Returns {"max_logit": the step's largest
        logit over all MLA heads (None if no training forward ran), "clipped_heads": how many heads were scaled}."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            self._all_reduce_max()
        overall, clipped = None, 0
        for name, mx in self.running.items():
            overall = mx.max().item() if overall is None else max(overall, mx.max().item())
            over = mx > self.tau
            if not over.any():
                continue
            clipped += int(over.sum())
            gamma = torch.where(over, self.tau / mx, torch.ones_like(mx))
            clip_heads(self.layers[name], gamma)
        self.running = {}
        return {"max_logit": overall, "clipped_heads": clipped}

    def _all_reduce_max(self) -> None:
        """Every layer's maxima, MAX-reduced across ranks in one flat tensor (−inf where a rank saw nothing)."""
        names = list(self.layers)
        ref = next(iter(self.layers.values())).kv_b_proj.weight
        flat = torch.full((len(names), self.layers[names[0]].num_heads), float("-inf"), device=ref.device)
        for i, n in enumerate(names):
            if n in self.running:
                flat[i] = self.running[n].to(flat.device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        self.running = {n: flat[i].clone() for i, n in enumerate(names) if torch.isfinite(flat[i]).all()}

    def remove(self) -> None:
        """Detach the forward hooks and stop max-logit recording."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for mod in self.layers.values():
            mod.record_max_logit = False

    def state_dict(self) -> dict:
        return {"tau": self.tau, "running": {k: v.clone() for k, v in self.running.items()}}

    def load_state_dict(self, sd: dict) -> None:
        unknown = set(sd["running"]) - set(self.layers)
        if unknown:
            raise ValueError(f"QKClip state names layers not in this model: {sorted(unknown)}")
        self.tau = float(sd["tau"])
        self.running = {k: v.clone() for k, v in sd["running"].items()}


@torch.no_grad()
def clip_heads(attn: MLAttention, gamma: torch.Tensor) -> None:
    """Scale head h's logits by gamma[h] ([H], in (0, 1]): √γ on q_nope and k_nope rows, γ on q_rope rows."""
    H, nope, rope = attn.num_heads, attn.nope, attn.rope
    if gamma.shape != (H,):
        raise ValueError(f"gamma shape {tuple(gamma.shape)}: expected [{H}] (one factor per head)")
    q = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    wq = q.weight.view(H, nope + rope, -1)
    g = gamma.to(wq.device, torch.float32)
    wq[:, :nope] = (wq[:, :nope].float() * g.sqrt()[:, None, None]).to(wq.dtype)
    wq[:, nope:] = (wq[:, nope:].float() * g[:, None, None]).to(wq.dtype)
    wk = attn.kv_b_proj.weight.view(H, nope + attn.vdim, -1)
    wk[:, :nope] = (wk[:, :nope].float() * g.sqrt()[:, None, None]).to(wk.dtype)
