"""Token sampling math shared by `model.generate` and the serving engine: per-row temperature, top-k and
top-p over logits, numerically safe for any temperature > 0.

The temperature divides `logits - max(logits)`, so the winning logit stays exactly 0 and any temperature > 0
gives finite or -inf scores, never NaN; rows whose temperature is below the dtype's smallest normal number are
scaled in fp64, so 1e-50 behaves as the limit it is (the argmax).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ._host import to_device
from ._triton import importable


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n] bool: rows holding a NaN or +inf, or only -inf (-inf entries alone are masked tokens)."""
    return ~torch.isfinite(logits.amax(-1))


# whether `greedy_pick` takes its Triton kernels on CUDA (the default: 1.25 -> 1.19 ms per batch-1 step on the H200,
# faster at batch 32 and 256 too, docs/benchmarks.md session 16) or the PyTorch ops (K3_GREEDY_KERNEL=0)
GREEDY_KERNEL = os.environ.get("K3_GREEDY_KERNEL", "1") == "1"


def greedy_pick(logits: torch.Tensor, backend: str = "auto", rows: torch.Tensor | None = None,
                last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] → (argmax ids [n] int64, log p(id) [n] fp32 under log_softmax(logits)), a row that is not
    finite (`nonfinite_rows`) giving id −1 and log p NaN; on the device, nothing read back. backend "auto": two
    Triton kernels on CUDA with `GREEDY_KERNEL` (`greedy_triton.py`: one pass over the logits), else (and
    "torch") these ops, its reference. `rows` / `last`: also written, as `write_outputs` writes them (the
    kernels in their second kernel: no extra launches)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"greedy_pick: unknown backend {backend!r}; valid backends are auto, torch, triton")
    if backend == "triton" or (backend == "auto" and GREEDY_KERNEL and logits.is_cuda and logits.dim() == 2
                               and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
                               and importable(__name__.rsplit(".", 1)[0] + ".greedy_triton")):
        from .greedy_triton import greedy_pick_triton
        return greedy_pick_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), rows=rows, last=last)
    return write_outputs(*picked(logits, logits.argmax(-1), nonfinite_rows(logits)), rows, last)


def check_outputs(n: int, device: torch.device, rows: torch.Tensor | None, last: torch.Tensor | None) -> None:
    """ValueError unless `rows` is None or a contiguous fp64 [2, n] and `last` None or an int64 vector of at least
    n, both on `device`."""
    if rows is not None and (rows.dtype != torch.float64 or tuple(rows.shape) != (2, n) or not rows.is_contiguous()
                             or rows.device != device):
        raise ValueError(f"rows must be a contiguous float64 [2, {n}] on {device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    if last is not None and (last.dtype != torch.int64 or last.dim() != 1 or last.shape[0] < n
                             or not last.is_contiguous() or last.device != device):
        raise ValueError(f"last must be a contiguous int64 vector of at least {n} on {device}, got {last.dtype} "
                         f"{tuple(last.shape)} on {last.device}")


def write_outputs(tok: torch.Tensor, lp: torch.Tensor, rows: torch.Tensor | None = None,
                  last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks (tok [n] int64, −1 for a failed row; lp [n]) also as the serving engine keeps them, on the device:
    `rows` [2, n] fp64 ← (ids, log p) (its one read-back: ids < 2^53 are exact in fp64) and `last[:n]` ← the ids
    with −1 as 0 (the next forward's device-fed tokens must be valid indices; the host drops a failed row).
    Returns (tok, lp)."""
    check_outputs(tok.shape[0], tok.device, rows, last)
    if rows is not None:
        rows.copy_(torch.stack([tok.double(), lp.double()]))
    if last is not None:
        last[:tok.shape[0]].copy_(tok.clamp_min(0))
    return tok, lp


def picked(logits: torch.Tensor, out: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen ids out [n] and their log p under log_softmax(logits) [n] fp32, with the rows `bad`
    (`nonfinite_rows`) as id −1 and log p NaN."""
    # log p(token) = logit - logsumexp: one reduction pass, no [n, V] log-softmax written
    lp = (logits.gather(-1, out[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).float()
    return torch.where(bad, -1, out), torch.where(bad, float("nan"), lp)


def host_tensor(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device's queue (a plain
    `torch.tensor(values, device=cuda)` synchronises the stream: the engine's asynchronous steps avoid that)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def filter_probs(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                 top_p: Sequence[float]) -> torch.Tensor:
    """logits [n, V] (finite rows) and per-row host values temperature (> 0), top_k (0 = off), top_p →
    probabilities [n, V] with the temperature applied and everything outside the top-k / nucleus set to
    zero (renormalised)."""
    n = logits.shape[0]
    if not (len(temperature) == len(top_k) == len(top_p) == n):
        raise ValueError(f"need one temperature / top_k / top_p per row ({n}), got {len(temperature)} / "
                         f"{len(top_k)} / {len(top_p)}")
    dev, dt = logits.device, logits.dtype
    z = logits - logits.amax(-1, keepdim=True)
    tiny = torch.finfo(dt).tiny
    probs = torch.softmax(z / host_tensor(temperature, dev, dt)[:, None], dim=-1)
    small = [i for i, t in enumerate(temperature) if t < tiny]   # not representable in the logits' dtype
    if small:
        si = host_tensor(small, dev)
        t64 = host_tensor([temperature[i] for i in small], dev, torch.float64)
        probs[si] = torch.softmax(z[si].double() / t64[:, None], dim=-1).to(dt)
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        sp, si = probs.sort(dim=-1, descending=True)
        rank = torch.arange(sp.shape[-1], device=dev)[None, :]
        tp = host_tensor(top_p, dev, dt)[:, None]
        tk = host_tensor(top_k, dev)[:, None]
        keep = (sp.cumsum(-1) - sp) < tp  # smallest prefix reaching top_p (first always kept)
        keep &= (tk == 0) | (rank < tk)
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
