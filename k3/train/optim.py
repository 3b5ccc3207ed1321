"""Per-Head Muon + AdamW in one optimizer, and the cosine schedule with linear warm-up (K3_SPEC §7).

Muon (matrices): momentum `buf = μ·buf + g` (Nesterov: `u = g + μ·buf`), Newton–Schulz orthogonalisation
of `u`, update `lr · 0.2·√max(A, B) · NS(u)` so that the update RMS (≈0.2) matches AdamW's and AdamW
hyper-parameters carry over (Moonlight's rule), decoupled weight decay `p ← p·(1 − lr·wd)`.

Per-Head Muon: for the attention projections whose output rows are laid out head by head (KDA
`q_proj`/`k_proj`/`v_proj`, MLA `q_b_proj` (or `q_proj`) and `kv_b_proj`) the matrix [H·r, in] is viewed as
H blocks [r, in] and each block is orthogonalised (and RMS-scaled with its own A = r, B = in) separately, so
heads with large gradients do not dominate the others' update. Stacked routed experts [E, out, in] are E
separate matrices.

AdamW: embeddings, lm_head, norms, biases, `A_log`, `dt_bias`, AttnRes pseudo-queries ([1, D]), depthwise
and patch convolution kernels, position embeddings — everything that is not a plain matrix. The router's
selection bias is a buffer updated by `k3.train.balance`, not by the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

NS_QUINTIC = (3.4445, -4.775, 2.0315)  # Keller Jordan's quintic coefficients (singular values → ≈[0.7, 1.2])


@dataclass
class OptimConfig:
    lr: float = 2e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_QUINTIC
    ns_dtype: str | None = None  # None: bfloat16 on CUDA, float32 elsewhere
    rms_scale: float = 0.2  # Muon update RMS to match AdamW's
    per_head: bool = True
    adam_lr: float | None = None  # None: same as lr (the RMS matching makes one lr fit both)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    decay_vectors: bool = False  # weight decay on 1-D tensors (norm gains, biases, A_log, dt_bias)

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: expected > 0")
        if self.adam_lr is not None and not self.adam_lr > 0:
            raise ValueError(f"adam_lr={self.adam_lr}: expected > 0 or None")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay}: expected ≥ 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum}: expected in [0, 1)")
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps={self.ns_steps}: expected ≥ 1")
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas={self.adam_betas}: expected each in [0, 1)")
        if self.ns_dtype not in (None, "float32", "bfloat16", "float64"):
            raise ValueError(f"ns_dtype={self.ns_dtype!r}: expected None, 'float32', 'bfloat16' or 'float64'")


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_QUINTIC,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonal polar factor U Vᵀ of each matrix in g [..., A, B] (batched over leading dims).

    Each matrix is divided by its Frobenius norm (singular values ≤ 1), then iterated
    X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X on the wide orientation. Returns g's dtype."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for the whole model. Each param group has `kind` = "muon" or "adamw"; Muon groups carry
    `head_rows` (rows per orthogonalised block, 0 = the whole matrix). State (momentum, Adam moments, step)
    lives in `state_dict()` for exact resume."""

    def __init__(self, groups: list[dict], cfg: OptimConfig):
        cfg.validate()
        defaults = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, kind="muon", head_rows=0,
                        momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                        ns_coefficients=tuple(cfg.ns_coefficients), ns_dtype=cfg.ns_dtype,
                        rms_scale=cfg.rms_scale, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["kind"] not in ("muon", "adamw"):
                raise ValueError(f"param group kind={g['kind']!r}: expected 'muon' or 'adamw'")
            if g["kind"] == "muon":
                for p in g["params"]:
                    muon_blocks(p.shape, g["head_rows"])  # validates shapes

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            (self._muon if g["kind"] == "muon" else self._adamw)(g)
        return loss

    def _muon(self, g: dict) -> None:
        """Momentum, then one batched Newton–Schulz per block shape (all heads / experts / matrices of the
        group with equal [A, B] blocks together: few large launches instead of one chain per tensor)."""
        mu, lr, wd = g["momentum"], g["lr"], g["weight_decay"]
        by_shape: dict[tuple, list] = {}
        for p in g["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p)
            buf = st["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            u = p.grad.add(buf, alpha=mu) if g["nesterov"] else buf
            blocks = muon_blocks(p.shape, g["head_rows"])
            by_shape.setdefault((blocks[1:], p.device, p.dtype), []).append((p, u.reshape(blocks)))
        for (ab, dev, _), items in by_shape.items():
            ns_dtype = getattr(torch, g["ns_dtype"]) if g["ns_dtype"] else (
                torch.bfloat16 if dev.type == "cuda" else torch.float32)
            o = newton_schulz(torch.cat([u for _, u in items]), g["ns_steps"], g["ns_coefficients"], dtype=ns_dtype)
            scale = g["rms_scale"] * math.sqrt(max(ab))
            for (p, u), ob in zip(items, o.split([u.shape[0] for _, u in items])):
                p.mul_(1 - lr * wd)
                p.add_(ob.reshape(p.shape), alpha=-lr * scale)

    def _adamw(self, g: dict) -> None:
        (b1, b2), eps, lr, wd = g["betas"], g["eps"], g["lr"], g["weight_decay"]
        for p in g["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            st["step"] += 1
            t = st["step"].item()
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


def muon_blocks(shape: torch.Size | tuple[int, ...], head_rows: int) -> tuple[int, int, int]:
    """[batch, A, B] view of a Muon parameter: [H·r, in] → [H, r, in] (head_rows = r), [out, in] → [1, out, in],
    stacked experts [E, out, in] unchanged."""
    if len(shape) == 2:
        rows, cols = shape
        if head_rows:
            if rows % head_rows:
                raise ValueError(f"per-head Muon: {rows} rows not divisible by head_rows={head_rows}")
            return rows // head_rows, head_rows, cols
        return 1, rows, cols
    if len(shape) == 3 and not head_rows:
        return tuple(shape)
    raise ValueError(f"Muon parameter of shape {tuple(shape)} with head_rows={head_rows}: expected 2-D "
                     f"(or 3-D stacked experts without head_rows)")


def classify_parameters(model: nn.Module, per_head: bool = True) -> dict[str, tuple[str, int]]:
    """name → (kind, head_rows) for every trainable parameter: kind in {"muon", "adamw", "adamw_nodecay"}.

    Per-head rows come from the attention modules (KDA head_dim; MLA nope+rope for q, nope+v for kv_b)."""
    from ..model.kda import KimiDeltaAttention
    from ..model.mla import MLAttention
    from ..model.moe import StackedExperts

    heads: dict[int, int] = {}  # id(param) → rows per head
    embeds: set[int] = set()
    stacked: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            for lin in (mod.q_proj, mod.k_proj, mod.v_proj):
                heads[id(lin.weight)] = mod.head_dim
        elif isinstance(mod, MLAttention):
            q = mod.q_proj if hasattr(mod, "q_proj") else mod.q_b_proj
            heads[id(q.weight)] = mod.nope + mod.rope
            heads[id(mod.kv_b_proj.weight)] = mod.nope + mod.vdim
        elif isinstance(mod, nn.Embedding):
            embeds.add(id(mod.weight))
        elif isinstance(mod, StackedExperts):
            stacked.update(id(p) for p in mod.parameters(recurse=False))
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in embeds or name.endswith("lm_head.weight") or "pos_emb" in name:
            kind = ("adamw", 0)
        elif p.ndim <= 1 or leaf in ("A_log", "dt_bias", "bias"):
            kind = ("adamw_nodecay", 0)
        elif p.ndim == 2 and min(p.shape) == 1:  # AttnRes pseudo-queries [1, D]: vectors, not matrices
            kind = ("adamw_nodecay", 0)
        elif p.ndim == 2:
            kind = ("muon", heads.get(id(p), 0) if per_head else 0)
        elif id(p) in stacked:
            kind = ("muon", 0)
        else:  # convolution kernels (depthwise short conv, patch embedding)
            kind = ("adamw", 0)
        out[name] = kind
    return out


def build_optimizer(model: nn.Module, cfg: OptimConfig | None = None) -> MuonAdamW:
    """Per-Head Muon for matrices, AdamW for the rest (see `classify_parameters`), one optimizer object."""
    cfg = cfg or OptimConfig()
    cfg.validate()
    kinds = classify_parameters(model, cfg.per_head)
    params = dict(model.named_parameters())
    buckets: dict[tuple[str, int], list] = {}
    for name, key in kinds.items():
        buckets.setdefault(key, []).append(params[name])
    groups = []
    adam_lr = cfg.adam_lr if cfg.adam_lr is not None else cfg.lr
    for (kind, head_rows), ps in sorted(buckets.items()):
        if kind == "muon":
            groups.append(dict(params=ps, kind="muon", head_rows=head_rows, lr=cfg.lr))
        else:
            wd = cfg.weight_decay if kind == "adamw" or cfg.decay_vectors else 0.0
            groups.append(dict(params=ps, kind="adamw", lr=adam_lr, weight_decay=wd))
    return MuonAdamW(groups, cfg)


class CosineWarmup:
    """LR factor: linear warm-up (step+1)/W for the first W steps, then cosine from 1 to min_lr_ratio at
    total_steps (held there after). A callable object, so LambdaLR's state_dict records its numbers."""

    def __init__(self, total_steps: int, warmup_frac: float = 0.01, min_lr_ratio: float = 0.1):
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps}: expected ≥ 1")
        if not 0 <= warmup_frac < 1:
            raise ValueError(f"warmup_frac={warmup_frac}: expected in [0, 1)")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={min_lr_ratio}: expected in [0, 1]")
        self.total_steps, self.min_lr_ratio = total_steps, min_lr_ratio
        self.warmup_steps = max(1, round(warmup_frac * total_steps)) if warmup_frac > 0 else 0

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        if step < w:
            return (step + 1) / w
        p = min(1.0, (step - w) / max(1, self.total_steps - w))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def build_scheduler(opt: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Cosine schedule with 1 % linear warm-up; call `sched.step()` once after each `opt.step()`."""
    return torch.optim.lr_scheduler.LambdaLR(opt, CosineWarmup(total_steps, warmup_frac, min_lr_ratio))
