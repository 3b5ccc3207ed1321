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

Implementations (`OptimConfig.impl`), all the same arithmetic and the same state:
- "loop": one chain of small kernels per parameter (`_muon_loop`, `_adamw_loop`, `_newton_schulz_reference`):
  the slow, obviously-correct reference.
- "foreach": torch's multi-tensor (`torch._foreach_*`) ops over a whole group; on CPU they run the loop's
  per-tensor ops, so results are bitwise those of "loop" except for Newton–Schulz (fused baddbmm products:
  equal to rounding).
- "fused" (default on CUDA): three Triton kernels that each touch every element once — Muon momentum +
  Nesterov blend written straight into the bf16 Newton–Schulz input, Muon decay + update read from the bf16
  Newton–Schulz output, and the whole AdamW update — one launch per block shape / group, the tensors
  addressed through a table of data pointers. Same arithmetic as "loop" in fp32 (to rounding).
Gradient clipping folds into the step: `grad_clip_scale` gives the global norm and the clip coefficient (as
`torch.nn.utils.clip_grad_norm_` computes them), and `step(grad_scale=c)` multiplies every gradient by c as it
reads it: the fused kernels in registers (no extra pass over the fp32 gradients, which clip_grad_norm_'s
in-place multiply is), the other paths with one in-place multiply first. Same values either way.
No path reads a value back to the host: AdamW's step count stays a 0-dim fp32 CPU tensor per parameter (the
checkpointed state), so its bias corrections are host floats without a device sync.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..ops._host import to_device

try:  # the fused kernels; everything else works without triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken
    triton = None

NS_QUINTIC = (3.4445, -4.775, 2.0315)  # Keller Jordan's quintic coefficients (singular values → ≈[0.7, 1.2])
IMPLS = ("auto", "fused", "foreach", "loop")


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
    impl: str = "auto"  # "auto" (fused on CUDA, foreach elsewhere) | "fused" | "foreach" | "loop" (reference)

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
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: expected one of {IMPLS}")
        if self.impl == "fused" and triton is None:
            raise ValueError("impl='fused' needs triton, which does not import here: use 'foreach' or 'auto'")


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_QUINTIC,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate orthogonal polar factor U Vᵀ of each matrix in g [..., A, B] (batched over leading dims).

    Each matrix is divided by its Frobenius norm (singular values ≤ 1), then iterated
    X ← a·X + (b·S + c·S²)·X with S = XXᵀ on the wide orientation, in `dtype`. Each iteration is three batched
    products, b·S + c·S² as one baddbmm (one rounding, no elementwise kernels); a tall matrix
    is iterated on its transpose (strided views, no copies) and the last product is written back in g's
    orientation. The a·X term rides on the product as a·I added to the [A, A] polynomial's diagonal (no copy of
    X per iteration). Returns out_dtype (default g's dtype)."""
    a, b, c = coefficients
    *_, A, B = g.shape
    x = g.to(dtype).reshape(-1, A, B)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    tall = A > B
    if tall:
        x = x.mT
    for i in range(steps):
        s = torch.bmm(x, x.mT)
        poly = torch.baddbmm(s, s, s, beta=b, alpha=c)  # b·S + c·S²
        # a·X + P·X = (P + a·I)·X: a on P's diagonal ([A] elements) and a plain product, rather than a baddbmm
        # with beta = a, which first copies X (the largest tensor) into its output
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        if tall and i == steps - 1:  # ((P + aI)·X)ᵀ = Xᵀ·(P + aI)ᵀ: the result lands in the tall layout
            x = torch.bmm(x.mT, poly.mT)
        else:
            x = torch.bmm(poly, x)
    if tall and steps == 0:
        x = x.mT
    return x.reshape(g.shape).to(out_dtype or g.dtype)


def _newton_schulz_reference(g: torch.Tensor, steps: int = 5,
                             coefficients: tuple[float, float, float] = NS_QUINTIC, eps: float = 1e-7,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`newton_schulz` written plainly (one kernel per product and per term): the "loop" implementation's."""
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


# ---- fused kernels (Triton): every tensor of a launch is addressed through a table of data pointers --------
# tab [rows, T] int64: one row per operand (data pointers) and a last row of element counts; chunks [2, C] int64:
# (tensor index, first element) of each program's CHUNK = BLOCK·ITERS elements. ALIGNED (every pointer 16-byte
# aligned, every count and chunk start a multiple of 8) lets the compiler use 16-byte vector loads and stores.

if triton is not None:
    @triton.jit
    def _table_ptr(tab, row, n_tab, t, like, ALIGNED: tl.constexpr):
        ptr = tl.load(tab + row * n_tab + t).to(tl.pointer_type(like.dtype.element_ty))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _chunk_of(tab, row, n_tab, chunks, n_chunks, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(chunks + pid)
        start = tl.load(chunks + n_chunks + pid)
        numel = tl.load(tab + row * n_tab + t)
        if ALIGNED:
            start = tl.multiple_of(start, 8)
            numel = tl.multiple_of(numel, 8)
        return t, start, numel

    @triton.jit
    def _muon_momentum_kernel(tab, n_tab, chunks, n_chunks, mu, scale_ptr, g_like, buf_like, u_like,
                              NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                              BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """buf ← μ·buf + g; u = g + μ·buf (Nesterov) or buf, stored in u's dtype (the Newton–Schulz input).
        HAS_SCALE: g is the gradient times the fp32 scalar at scale_ptr (the clip coefficient)."""
        t, start, numel = _chunk_of(tab, 3, n_tab, chunks, n_chunks, ALIGNED)
        g_ptr = _table_ptr(tab, 0, n_tab, t, g_like, ALIGNED)
        b_ptr = _table_ptr(tab, 1, n_tab, t, buf_like, ALIGNED)
        u_ptr = _table_ptr(tab, 2, n_tab, t, u_like, ALIGNED)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            m = offs < numel
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_SCALE:
                g = g * tl.load(scale_ptr)
            b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
            b = b * mu
            b = b + g
            tl.store(b_ptr + offs, b.to(buf_like.dtype.element_ty), mask=m)
            if NESTEROV:
                u = g + mu * b
            else:
                u = b
            tl.store(u_ptr + offs, u.to(u_like.dtype.element_ty), mask=m)

    @triton.jit
    def _muon_update_kernel(tab, n_tab, chunks, n_chunks, decay, alpha, p_like, o_like,
                            ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """p ← p·decay, then p ← p + alpha·o (o: the Newton–Schulz output, any float dtype)."""
        t, start, numel = _chunk_of(tab, 2, n_tab, chunks, n_chunks, ALIGNED)
        p_ptr = _table_ptr(tab, 0, n_tab, t, p_like, ALIGNED)
        o_ptr = _table_ptr(tab, 1, n_tab, t, o_like, ALIGNED)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            m = offs < numel
            p = tl.load(p_ptr + offs, mask=m, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + offs, mask=m, other=0.0).to(tl.float32)
            p = p * decay
            p = p + alpha * o
            tl.store(p_ptr + offs, p.to(p_like.dtype.element_ty), mask=m)

    @triton.jit
    def _adamw_kernel(tab, n_tab, chunks, n_chunks, w1, b2, w2, bc2, eps, decay, step_size, scale_ptr, p_like, g_like,
                      HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """The "loop" AdamW, op for op: m.lerp_(g, w1); v·b2 + (w2·g)·g; d = √(v / bc2) + eps; p·decay;
        p + (step_size·m) / d. Moments in the parameter's dtype. HAS_SCALE: g times the scalar at scale_ptr."""
        t, start, numel = _chunk_of(tab, 4, n_tab, chunks, n_chunks, ALIGNED)
        p_ptr = _table_ptr(tab, 0, n_tab, t, p_like, ALIGNED)
        g_ptr = _table_ptr(tab, 1, n_tab, t, g_like, ALIGNED)
        m_ptr = _table_ptr(tab, 2, n_tab, t, p_like, ALIGNED)
        v_ptr = _table_ptr(tab, 3, n_tab, t, p_like, ALIGNED)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            msk = offs < numel
            g = tl.load(g_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            if HAS_SCALE:
                g = g * tl.load(scale_ptr)
            m = tl.load(m_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            d = g - m  # torch.lerp: small weights step from the start, large ones back from the end
            m = tl.where(w1 < 0.5, m + w1 * d, g - d * (1.0 - w1))
            v = v * b2
            v = v + w2 * g * g
            den = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
            p = p * decay
            p = p + tl.div_rn(step_size * m, den)
            tl.store(m_ptr + offs, m.to(p_like.dtype.element_ty), mask=msk)
            tl.store(v_ptr + offs, v.to(p_like.dtype.element_ty), mask=msk)
            tl.store(p_ptr + offs, p.to(p_like.dtype.element_ty), mask=msk)


def _interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return triton is not None and type(_adamw_kernel).__name__ == "InterpretedFunction"


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for the whole model. Each param group has `kind` = "muon" or "adamw"; Muon groups carry
    `head_rows` (rows per orthogonalised block, 0 = the whole matrix). State (momentum, Adam moments, step)
    lives in `state_dict()` for exact resume; the state is the same for every `impl`."""

    def __init__(self, groups: list[dict], cfg: OptimConfig):
        cfg.validate()
        defaults = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, kind="muon", head_rows=0,
                        momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                        ns_coefficients=tuple(cfg.ns_coefficients), ns_dtype=cfg.ns_dtype,
                        rms_scale=cfg.rms_scale, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
        super().__init__(groups, defaults)
        self.impl = cfg.impl  # not a group key: a checkpoint's param groups must not carry it across runs
        self._chunks: dict = {}
        self._scale, self._scales = None, {}  # the running step's grad_scale, and its per-device copies
        for g in self.param_groups:
            if g["kind"] not in ("muon", "adamw"):
                raise ValueError(f"param group kind={g['kind']!r}: expected 'muon' or 'adamw'")
            if g["kind"] == "muon":
                for p in g["params"]:
                    muon_blocks(p.shape, g["head_rows"])  # validates shapes

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "impl": self.impl}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("impl", "auto")
        self.__dict__.setdefault("_chunks", {})
        self.__dict__.setdefault("_scale", None)
        self.__dict__.setdefault("_scales", {})

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | float | None = None):
        """One update of every parameter with a gradient. `grad_scale` (a 0-dim tensor, e.g. the clip coefficient
        of `grad_clip_scale`, or a float): every gradient is multiplied by it first. The fused kernels apply it
        as they read the gradient (left unscaled in .grad); the other paths scale .grad in place, as
        `clip_grad_norm_` would."""
        if grad_scale is not None and not (isinstance(grad_scale, (int, float)) or (
                isinstance(grad_scale, torch.Tensor) and grad_scale.numel() == 1 and grad_scale.is_floating_point())):
            raise ValueError(f"grad_scale must be a float or a one-element float tensor, got {grad_scale!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._scale, self._scales = grad_scale, {}
        try:
            for g in self.param_groups:
                if any(_is_dtensor(p) for p in g["params"]):
                    self._prescale([_local(p.grad) for p in g["params"] if p.grad is not None])
                    (self._muon_dtensor if g["kind"] == "muon" else self._adamw_dtensor)(g)
                elif self.impl == "loop":
                    self._prescale([p.grad for p in g["params"] if p.grad is not None])
                    (self._muon_loop if g["kind"] == "muon" else self._adamw_loop)(g)
                else:
                    (self._muon if g["kind"] == "muon" else self._adamw)(g)
        finally:
            self._scale, self._scales = None, {}
        return loss

    def _scale_on(self, device: torch.device) -> torch.Tensor | None:
        """The step's grad_scale as a 0-dim fp32 tensor on `device` (made once per step and device), or None."""
        if self._scale is None:
            return None
        t = self._scales.get(device)
        if t is None:
            s = self._scale
            t = (s.detach().reshape(()).to(device=device, dtype=torch.float32) if isinstance(s, torch.Tensor)
                 else torch.full((), float(s), device=device, dtype=torch.float32))
            self._scales[device] = t
        return t

    def _prescale(self, grads: list[torch.Tensor]) -> None:
        """grads *= grad_scale in place (the paths without fused kernels), per device, with the fp32 scalar as
        `clip_grad_norm_` multiplies."""
        if self._scale is None or not grads:
            return
        for (dev, _), gs in self._by_device_dtype(grads).items():
            torch._foreach_mul_(gs, self._scale_on(dev))

    # ---- FSDP2 (DTensor) parameters ------------------------------------------------------------------------
    def _adamw_dtensor(self, g: dict) -> None:
        """AdamW is elementwise: run the group's usual path on the local shards (views: the updates land in
        the DTensors), keeping the moments as DTensors laid out like their parameters (for DCP)."""
        from torch.distributed.tensor import DTensor
        pairs = []
        for p in g["params"]:
            if p.grad is None:
                continue
            lp = _local(p)
            lp.grad = _local(p.grad)
            self.state[lp] = {k: _local(v) for k, v in self.state[p].items()} if p in self.state else {}
            pairs.append((p, lp))
        try:
            (self._adamw_loop if self.impl == "loop" else self._adamw)({**g, "params": [lp for _, lp in pairs]})
        finally:
            for p, lp in pairs:
                st = self.state.pop(lp)
                lp.grad = None
                for k, v in st.items():
                    if k not in self.state[p]:
                        self.state[p][k] = (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                                               stride=p.stride(), run_check=False)
                                            if _is_dtensor(p) and v.shape == lp.shape and v.dim() > 0 else v)

    def _momentum(self, g: dict, p: torch.Tensor) -> torch.Tensor:
        """Advance p's momentum buffer with its gradient (local shards for DTensors) and return the update to
        orthogonalise: the buffer, or its Nesterov form."""
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = _local(st["momentum_buffer"]), _local(p.grad)
        buf.mul_(g["momentum"]).add_(grad)
        return grad.add(buf, alpha=g["momentum"]) if g["nesterov"] else buf

    def _muon_dtensor(self, g: dict) -> None:
        """Muon on FSDP2-sharded parameters, one parameter at a time: momentum on the local shard; Newton–Schulz
        on the full matrix — the update `u` is all-gathered (`full_tensor`), orthogonalised, and this rank's rows
        of the result applied — except for stacked experts [E, out, in], sharded by expert (dim 0), whose local
        shard already holds whole matrices. Exact (the same arithmetic as one process); the cost: one all-gather
        of every 2-D update per step (the bytes of an FSDP parameter all-gather) and every rank orthogonalises
        every full matrix (redundant compute)."""
        lr, wd = g["lr"], g["weight_decay"]
        for p in g["params"]:
            if p.grad is None:
                continue
            u = self._momentum(g, p)
            blocks = muon_blocks(p.shape, g["head_rows"])
            ns_dtype = self._ns_dtype(g, u.device)
            whole = p.dim() == 3 and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0)
                                         for pl in getattr(p, "placements", ()))
            if not _is_dtensor(p) or whole:  # whole matrices here: stacked experts sharded by expert
                o = newton_schulz(u.reshape(-1, *blocks[1:]), g["ns_steps"], g["ns_coefficients"], dtype=ns_dtype)
                o = o.reshape(u.shape)
            else:
                from torch.distributed.tensor import DTensor
                full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                          run_check=False).full_tensor()
                o = newton_schulz(full.reshape(blocks), g["ns_steps"], g["ns_coefficients"], dtype=ns_dtype)
                o = _local_rows(o.reshape(p.shape), p)
            lp = _local(p)
            lp.mul_(1 - lr * wd)
            lp.add_(o.to(lp.dtype), alpha=-lr * g["rms_scale"] * math.sqrt(max(blocks[1:])))

    # ---- which path --------------------------------------------------------------------------------------
    def _fused_ok(self, device: torch.device, tensors: list[torch.Tensor], n_written: int | None = None) -> bool:
        """Fused kernels for these tensors (parameters and state first, gradients last)? "auto": on CUDA with
        triton; "fused": also on CPU under the interpreter. Fp32 / bf16 / fp16; parameters and state contiguous
        (written in place: a strided one sends the group to the foreach path), gradients are made contiguous."""
        if self.impl == "foreach" or triton is None:
            return False
        if device.type != "cuda":
            if self.impl == "auto":
                return False
            if not (device.type == "cpu" and _interpreted()):
                raise ValueError(f"impl='fused' on {device}: expected CUDA tensors (or TRITON_INTERPRET=1 at import "
                                 f"on CPU)")
        n_written = len(tensors) if n_written is None else n_written
        return all(t.dtype in _FUSED_DTYPES for t in tensors) and all(t.is_contiguous() for t in tensors[:n_written])

    @staticmethod
    def _ns_dtype(g: dict, device: torch.device) -> torch.dtype:
        if g["ns_dtype"]:
            return getattr(torch, g["ns_dtype"])
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @staticmethod
    def _by_device_dtype(params: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
        out: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            out.setdefault((p.device, p.dtype), []).append(p)
        return out

    # ---- Muon -----------------------------------------------------------------------------------------------
    def _muon(self, g: dict) -> None:
        """Momentum for the whole group at once, then per block shape one batched Newton–Schulz and one update
        of every parameter of that shape (foreach ops, or the fused kernels)."""
        mu, lr, wd, nesterov = g["momentum"], g["lr"], g["weight_decay"], g["nesterov"]
        params = [p for p in g["params"] if p.grad is not None]
        for p in params:
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p)
        for (dev, _), ps in self._by_device_dtype(params).items():
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            fused = self._fused_ok(dev, ps + bufs + [p.grad for p in ps], n_written=2 * len(ps))
            grads = [p.grad.contiguous() if fused else p.grad for p in ps]
            if not fused:
                self._prescale(grads)
            scale = self._scale_on(dev) if fused else None
            ns_dtype = self._ns_dtype(g, dev)
            buckets: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(ps):
                buckets.setdefault(muon_blocks(p.shape, g["head_rows"])[1:], []).append(i)
            if not fused:
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, grads)
                us = torch._foreach_add(grads, bufs, alpha=mu) if nesterov else bufs
            for (A, B), idx in buckets.items():
                sizes = [ps[i].numel() for i in idx]
                blocks = [n // (A * B) for n in sizes]
                x = torch.empty(sum(blocks), A, B, dtype=ns_dtype, device=dev)  # the Newton–Schulz input
                if fused:  # momentum + Nesterov written straight into x, in its dtype
                    offs = [0, *itertools.accumulate(sizes[:-1])]
                    ptrs = [[grads[i].data_ptr() for i in idx], [bufs[i].data_ptr() for i in idx],
                            [x.data_ptr() + o * x.element_size() for o in offs]]
                    self._launch(_muon_momentum_kernel, dev, ptrs, sizes, float(mu), scale, grads[idx[0]],
                                 bufs[idx[0]], x, NESTEROV=bool(nesterov), HAS_SCALE=scale is not None)
                else:
                    torch.cat([us[i].reshape(-1, A, B) for i in idx], out=x)
                o = newton_schulz(x, g["ns_steps"], g["ns_coefficients"], dtype=ns_dtype,
                                  out_dtype=ns_dtype if fused else ps[idx[0]].dtype)
                rms = g["rms_scale"] * math.sqrt(max(A, B))
                bp, obs = [ps[i] for i in idx], o.split(blocks)
                if fused:  # decay + update read from the Newton–Schulz output
                    self._launch(_muon_update_kernel, dev, [[p.data_ptr() for p in bp], [ob.data_ptr() for ob in obs]],
                                 sizes, float(1 - lr * wd), float(-lr * rms), bp[0], o)
                else:
                    torch._foreach_mul_(bp, 1 - lr * wd)
                    torch._foreach_add_(bp, [ob.view(p.shape) for p, ob in zip(bp, obs)], alpha=-lr * rms)

    def _muon_loop(self, g: dict) -> None:
        """Reference: per parameter momentum, then one batched Newton–Schulz per block shape (all heads /
        experts / matrices of the group with equal [A, B] blocks together), per parameter update."""
        lr, wd = g["lr"], g["weight_decay"]
        by_shape: dict[tuple, list] = {}
        for p in g["params"]:
            if p.grad is None:
                continue
            u = self._momentum(g, p)
            blocks = muon_blocks(p.shape, g["head_rows"])
            by_shape.setdefault((blocks[1:], p.device, p.dtype), []).append((p, u.reshape(blocks)))
        for (ab, dev, _), items in by_shape.items():
            ns_dtype = self._ns_dtype(g, dev)
            o = _newton_schulz_reference(torch.cat([u for _, u in items]), g["ns_steps"], g["ns_coefficients"],
                                         dtype=ns_dtype)
            scale = g["rms_scale"] * math.sqrt(max(ab))
            for (p, u), ob in zip(items, o.split([u.shape[0] for _, u in items])):
                p.mul_(1 - lr * wd)
                p.add_(ob.reshape(p.shape), alpha=-lr * scale)

    # ---- AdamW ----------------------------------------------------------------------------------------------
    def _adamw(self, g: dict) -> None:
        """The whole group at once: step counts advanced together (host tensors: no sync), then per (step
        count, device, dtype) one fused kernel or eight foreach ops."""
        (b1, b2), eps, lr, wd = g["betas"], g["eps"], g["lr"], g["weight_decay"]
        params = [p for p in g["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1)
        if all(s.device.type == "cpu" for s in steps):
            ts = torch.stack(steps).tolist()
        else:  # a checkpoint that put step counts on the device: one read each (as the loop does)
            ts = [s.item() for s in steps]
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p, t in zip(params, ts):
            buckets.setdefault((t, p.device, p.dtype), []).append(p)
        for (t, dev, _), ps in buckets.items():
            bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            fused = self._fused_ok(dev, ps + ms + vs + [p.grad for p in ps], n_written=3 * len(ps))
            grads = [p.grad.contiguous() if fused else p.grad for p in ps]
            if fused:
                ptrs = [[p.data_ptr() for p in ps], [x.data_ptr() for x in grads], [m.data_ptr() for m in ms],
                        [v.data_ptr() for v in vs]]
                scalars = (1 - b1, b2, 1 - b2, bc2, eps, 1 - lr * wd, -lr / bc1)
                scale = self._scale_on(dev)
                self._launch(_adamw_kernel, dev, ptrs, [p.numel() for p in ps], *map(float, scalars), scale, ps[0],
                             grads[0], HAS_SCALE=scale is not None)
                continue
            self._prescale(grads)
            for part in _numel_chunks(ps, 1 << 26):  # bound the fp32 temporaries (denominators)
                pp, gg, mm, vv = ([lst[i] for i in part] for lst in (ps, grads, ms, vs))
                torch._foreach_lerp_(mm, gg, 1 - b1)
                torch._foreach_mul_(vv, b2)
                torch._foreach_addcmul_(vv, gg, gg, value=1 - b2)
                denom = torch._foreach_div(vv, bc2)
                torch._foreach_sqrt_(denom)
                torch._foreach_add_(denom, eps)
                torch._foreach_mul_(pp, 1 - lr * wd)
                torch._foreach_addcdiv_(pp, mm, denom, value=-lr / bc1)

    def _adamw_loop(self, g: dict) -> None:
        """Reference: one parameter at a time."""
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

    # ---- fused launches -------------------------------------------------------------------------------------
    def _launch(self, kernel, device: torch.device, ptrs: list[list[int]], numels: list[int], *args, **constexprs):
        """One launch of a table-driven kernel over tensors with `numels` elements; `ptrs` one row of data
        pointers per operand. The chunk table depends only on the sizes and is cached on the device."""
        block, iters = (8192, 1) if device.type == "cpu" else (1024, 16)
        chunk = block * iters
        key = (device, chunk, tuple(numels))
        hit = self._chunks.get(key)
        if hit is None:
            counts = torch.tensor([-(-n // chunk) for n in numels])
            tid = torch.repeat_interleave(torch.arange(len(numels)), counts)
            first = torch.cat([torch.arange(int(c)) * chunk for c in counts]) if len(numels) else tid
            hit = (to_device(torch.stack([tid, first]).to(torch.int64).contiguous(), device), tid.numel())
            if len(self._chunks) > 256:
                self._chunks.clear()
            self._chunks[key] = hit
        chunks, n_chunks = hit
        if n_chunks == 0:
            return
        aligned = all(x % 16 == 0 for row in ptrs for x in row) and all(n % 8 == 0 for n in numels)
        tab = to_device(torch.tensor(ptrs + [list(numels)], dtype=torch.int64), device)
        kernel[(n_chunks,)](tab, len(numels), chunks, n_chunks, *args, ALIGNED=aligned, BLOCK=block, ITERS=iters,
                            **constexprs)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place updates land in it), or t itself."""
    return t.to_local() if _is_dtensor(t) else t


def _local_rows(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of `full` (laid out as the DTensor `like`): a local chunk, no communication."""
    from torch.distributed.tensor import DTensor, Replicate
    rep = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return rep.redistribute(like.device_mesh, like.placements).to_local()


def _numel_chunks(ts: list[torch.Tensor], cap: int) -> list[list[int]]:
    """Indices of ts in consecutive runs of at most `cap` elements (a larger tensor alone)."""
    out, cur, n = [], [], 0
    for i, t in enumerate(ts):
        if cur and n + t.numel() > cap:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t.numel()
    if cur:
        out.append(cur)
    return out


def grad_clip_scale(params, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(total L2 norm of the gradients, clip coefficient min(1, max_norm / (norm + 1e-6))) as 0-dim device
    tensors, the two numbers `torch.nn.utils.clip_grad_norm_` computes, without its in-place multiply: pass the
    coefficient to `MuonAdamW.step(grad_scale=...)`, which applies it as it reads each gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        z = torch.zeros(())
        return z, torch.ones(())
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return norm, torch.clamp(max_norm / (norm + 1e-6), max=1.0)


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


def newton_schulz_flops(model: nn.Module, cfg: OptimConfig | None = None) -> int:
    """FLOPs of one optimizer step's Newton–Schulz iterations (`newton_schulz` on every Muon block): per block
    [A, B] with a = min(A, B), b = max(A, B), each iteration multiplies XXᵀ (2a²b), S·S (2a³) and P·X (2a²b)."""
    cfg = cfg or OptimConfig()
    params = dict(model.named_parameters())
    total = 0
    for name, (kind, head_rows) in classify_parameters(model, cfg.per_head).items():
        if kind == "muon":
            n, A, B = muon_blocks(params[name].shape, head_rows)
            a, b = min(A, B), max(A, B)
            total += n * cfg.ns_steps * (4 * a * a * b + 2 * a ** 3)
    return total


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
