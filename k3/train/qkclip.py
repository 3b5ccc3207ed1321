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
        replica clips identically); default the world group when torch.distributed is initialised. Under
        pipeline parallelism `model` is a stage and `group` the ranks holding that stage (`mesh.fsdp`)."""
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
    def step(self, sync: bool = True) -> dict:
        """Clip every head whose step max exceeded τ; reset tracking. Returns {"max_logit": the step's largest
        logit over all MLA heads (None if no training forward ran), "clipped_heads": how many heads were scaled}.

        Device-side: the scale factors of all layers are computed at once and applied unconditionally (γ = 1
        leaves a weight bit-identical), so nothing is read back per layer; the two statistics come back in one
        read (sync=True), or stay 0-dim device tensors (sync=False: no host sync at all)."""
        # (a pipeline stage without MLA layers has nothing to reduce, and neither have its peers)
        if self.layers and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            self._all_reduce_max()
        names = [n for n in self.layers if n in self.running]
        self_running, self.running = self.running, {}
        if not names:
            return {"max_logit": None, "clipped_heads": 0}
        groups: dict[tuple, list[str]] = {}  # layers of equal head layout (and device) are scaled together
        for n in names:
            a = self.layers[n]
            groups.setdefault((a.num_heads, a.nope, a.rope, a.vdim, a.kv_b_proj.weight.device), []).append(n)
        maxes, counts = [], []
        for (H, nope, rope, vdim, dev), group in groups.items():
            mx = torch.stack([self_running[n].to(dev, torch.float32) for n in group])  # [L, H]
            over = mx > self.tau
            gamma = torch.where(over, self.tau / mx, torch.ones_like(mx))
            _scale_heads([self.layers[n] for n in group], gamma)
            maxes.append(mx.amax())
            counts.append(over.sum())
        dev = maxes[0].device
        overall = torch.stack([m.to(dev) for m in maxes]).amax()
        clipped = torch.stack([c.to(dev) for c in counts]).sum()
        if not sync:
            return {"max_logit": overall, "clipped_heads": clipped}
        mv, cv = torch.stack([overall.double(), clipped.double()]).tolist()  # the one host read
        return {"max_logit": None if mv == float("-inf") else mv, "clipped_heads": int(cv)}

    @torch.no_grad()
    def _step_reference(self) -> dict[str, float]:
        """`step` as first written: per layer, read the max and the clip decision back to the host
        (2–3 host syncs per MLA layer), `clip_heads` on layers with a head over τ."""
        if self.layers and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            self._all_reduce_max()
        overall, clipped = None, 0
        for name, mx in self.running.items():
            if not torch.isfinite(mx).all():  # a layer no rank saw (all-reduced −inf)
                continue
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
        """Every layer's maxima, MAX-reduced across ranks in one flat tensor (−inf where a rank saw nothing;
        a layer no rank saw stays −inf and is left alone: γ = 1)."""
        names = list(self.layers)
        ref = next(iter(self.layers.values())).kv_b_proj.weight
        H = self.layers[names[0]].num_heads
        ninf = torch.full((H,), float("-inf"), device=ref.device)
        flat = torch.stack([self.running[n].to(ref.device, torch.float32) if n in self.running else ninf
                            for n in names])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        self.running = dict(zip(names, flat.unbind(0)))

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


@torch.no_grad()
def _scale_heads(layers: list[MLAttention], gamma: torch.Tensor) -> None:
    """`clip_heads` for several layers of one head layout at once, gamma [L, H]: one row factor per weight
    (√γ on q_nope and k_nope rows, γ on q_rope rows, 1 on value rows) and one in-place multiply per weight.
    The product is taken in fp32 (or the weight's dtype if wider) and rounded once, as `clip_heads` does, and
    a factor of 1 leaves a weight bit-identical."""
    a0 = layers[0]
    H, nope, rope, vdim = a0.num_heads, a0.nope, a0.rope, a0.vdim
    L = len(layers)
    g = gamma.to(torch.float32)
    sq = g.sqrt()
    fq = torch.cat([sq[:, :, None].expand(L, H, nope), g[:, :, None].expand(L, H, rope)], dim=-1)
    fk = torch.cat([sq[:, :, None].expand(L, H, nope), torch.ones_like(g)[:, :, None].expand(L, H, vdim)], dim=-1)
    for i, attn in enumerate(layers):
        q = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
        _scale_rows_(q.weight, fq[i].reshape(-1))
        _scale_rows_(attn.kv_b_proj.weight, fk[i].reshape(-1))


def _scale_rows_(w: torch.Tensor, factor: torch.Tensor) -> None:
    """w[r, :] *= factor[r] in place. An FSDP2 weight (a DTensor sharded on rows) scales its local rows with
    their slice of `factor`: no communication, the same products as the full matrix."""
    from torch.distributed.tensor import DTensor
    if not isinstance(w, DTensor):
        w.mul_(factor.to(w.device)[:, None])
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(pl.is_shard() and pl.dim != 0 for pl in w.placements):
        raise ValueError(f"QK-clip: weight placements {w.placements}: expected row (dim 0) sharding or replication")
    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    loc = w.to_local()
    loc.mul_(factor.to(loc.device)[offset[0]:offset[0] + shape[0], None])
