"""Router selection-bias balancing: Quantile Balancing (QB, K3_SPEC §5) and the DeepSeek-V3 sign rule.

QB, for one global batch of m tokens, n experts, k per token (target load q = m·k/n):
  α_i = token i's (k+1)-th largest *biased* score s_i + b; margin m_ij = s_ij − α_i (raw s: the old bias
  enters only through α); b̂_j = −quantile_{1−k/n}(m_:j), so q margins of expert j cross the threshold;
  b ← b̂ − mean(b̂). The new bias applies from the next step; it is frozen in eval / inference.

`qb_update` is the exact rule (sorts every margin). `MarginHistogram` is the scalable rule: per-expert
histograms of margins over a range fixed by the current bias (scores are sigmoid outputs in [0, 1], so
margins lie in [−1 − max b, 1 − min b]), accumulated over micro-batches and summed across ranks by one
`all_reduce`; the quantile is read from the cumulative counts with linear interpolation inside a bin, so the
error is at most one bin width. `BalanceController` wires either rule (or the sign rule) into training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _check(scores: torch.Tensor, bias: torch.Tensor, k: int) -> None:
    if scores.ndim != 2:
        raise ValueError(f"scores shape {tuple(scores.shape)}: expected [m tokens, n experts]")
    m, n = scores.shape
    if bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)}: expected [{n}] (one per expert)")
    if not 1 <= k < n:
        raise ValueError(f"k={k}: expected 1 ≤ k < n experts = {n} (QB needs the (k+1)-th score)")
    if m < 1:
        raise ValueError("scores: expected at least one token")


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """[m, n] fp32 margins s_ij − α_i with α_i the (k+1)-th largest of s_i + b."""
    _check(scores, bias, k)
    s = scores.float()
    alpha = torch.topk(s + bias.float(), k + 1, dim=-1).values[:, k:]
    return s - alpha


def _center(b_hat: torch.Tensor) -> torch.Tensor:
    return b_hat - b_hat.mean()


def qb_update(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Exact QB: new bias [n] (fp32, mean zero) from raw router scores [m, n] of one global batch."""
    marg = qb_margins(scores, bias, k)
    m, n = marg.shape
    # quantile_{1-k/n} with linear interpolation between order statistics (as torch.quantile), per expert;
    # sorting avoids torch.quantile's input-size limit.
    srt = marg.sort(dim=0).values.double()
    pos = (1 - k / n) * (m - 1)
    lo = int(pos)
    hi = min(lo + 1, m - 1)
    frac = pos - lo
    quant = srt[lo] + (srt[hi] - srt[lo]) * frac
    return _center(-quant).float()


def sign_update(loads: torch.Tensor, bias: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free rule: b_j + γ·sign(mean load − load_j). loads [n] token counts per expert."""
    if loads.shape != bias.shape or loads.ndim != 1:
        raise ValueError(f"loads {tuple(loads.shape)} and bias {tuple(bias.shape)}: expected both [n experts]")
    if not gamma >= 0:
        raise ValueError(f"gamma={gamma}: expected ≥ 0")
    l = loads.double()
    return (bias.double() + gamma * torch.sign(l.mean() - l)).to(bias.dtype)


def expert_loads(topk_idx: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens routed to each expert, int64 [n], from topk_idx [m, k]."""
    return torch.bincount(topk_idx.reshape(-1), minlength=n)


def maxvio(loads: torch.Tensor) -> float:
    """Max violation: max_j load_j / mean load − 1 (0 = perfectly balanced)."""
    l = loads.double()
    return (l.max() / l.mean() - 1).item()


def route_topk(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Experts chosen with the selection bias: topk_idx [m, k] of scores + bias."""
    return torch.topk(scores.float() + bias.float(), k, dim=-1).indices


class MarginHistogram:
    """Per-expert histogram of QB margins for one layer and one step.

    The bin range is fixed by the bias of this step (the same on every rank), so counts from micro-batches
    and ranks add up exactly; `counts` [n, bins] is float64 (exact integers up to 2^53)."""

    def __init__(self, bias: torch.Tensor, k: int, bins: int = 256, score_range: tuple[float, float] = (0.0, 1.0)):
        if bins < 2:
            raise ValueError(f"bins={bins}: expected ≥ 2")
        lo_s, hi_s = score_range
        if not hi_s > lo_s:
            raise ValueError(f"score_range={score_range}: expected (low, high) with high > low")
        b = bias.detach().double()
        self.k, self.bins, self.n = k, bins, b.numel()
        span = hi_s - lo_s
        # margin = s_ij − (s_il + b_l) with s in [lo_s, hi_s]: within [−span − max b, span − min b]
        self.lo = -span - b.max().item()
        self.hi = span - b.min().item()
        self.width = (self.hi - self.lo) / bins
        self.counts = torch.zeros(self.n, bins, dtype=torch.float64, device=bias.device)
        self._bias = bias.detach().clone()

    def add(self, scores: torch.Tensor) -> None:
        """Accumulate the margins of raw scores [m, n] (routed with this step's bias)."""
        marg = qb_margins(scores, self._bias.to(scores.device), self.k).double()
        if marg.numel() and (marg.min() < self.lo - 1e-9 or marg.max() > self.hi + 1e-9):
            raise ValueError(f"margins outside [{self.lo:.4g}, {self.hi:.4g}]: router scores outside the "
                             f"declared score_range (got min {marg.min().item():.4g}, max {marg.max().item():.4g})")
        idx = ((marg - self.lo) / self.width).floor().long().clamp_(0, self.bins - 1)  # hi edge → last bin
        flat = idx + torch.arange(self.n, device=idx.device) * self.bins
        self.counts += torch.bincount(flat.reshape(-1), minlength=self.n * self.bins).view(self.n, self.bins).to(
            self.counts.device, torch.float64)

    def new_bias(self) -> torch.Tensor:
        """QB bias [n] from the (already all-reduced) counts: −quantile_{1−k/n} per expert, mean-centred."""
        return qb_from_counts(self.counts, self.k, self.lo, self.width)


def qb_from_counts(counts: torch.Tensor, k: int, lo: float, width: float) -> torch.Tensor:
    """−quantile_{1−k/n} of each expert's margins from histogram counts [n, bins] (bins of `width` from `lo`),
    linearly interpolated inside the bin that holds the quantile; mean-centred, fp32."""
    n, bins = counts.shape
    m = counts[0].sum()
    if m <= 0:
        raise ValueError("empty histogram: no tokens were observed this step")
    target = (1 - k / n) * m  # number of margins at or below the threshold
    cum = counts.cumsum(dim=1)
    j = torch.searchsorted(cum, torch.full((n, 1), target.item(), dtype=cum.dtype, device=cum.device)).squeeze(1)
    j = j.clamp_(max=bins - 1)
    below = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(m).expand(n))
    inbin = counts.gather(1, j.unsqueeze(1)).squeeze(1)
    frac = torch.where(inbin > 0, (target - below) / inbin.clamp(min=1e-300), torch.zeros_like(inbin))
    quant = lo + width * (j.double() + frac.clamp(0, 1))
    return _center(-quant).float()


def qb_update_hist(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int = 256,
                   group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """Histogram QB for one batch (this rank's tokens); with torch.distributed initialised the counts are
    summed over `group` (default: world) by one all_reduce, so every rank gets the global-batch bias."""
    h = MarginHistogram(bias, k, bins)
    h.add(scores)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(h.counts, group=group)
    return h.new_bias()


class BalanceController:
    """Updates every LatentMoE layer's `gate.e_score_correction_bias` once per optimizer step.

    Attaches forward hooks to the model's LatentMoE layers (and sets `record_routing`); each training-mode
    forward (not the recomputation inside backward under activation checkpointing, not eval) adds its
    routing statistics: per-expert loads and, for QB, the margin histogram (or the raw scores for
    `exact=True`). `step()` sums everything of all layers across ranks with ONE all_reduce, writes the new
    biases, resets, and returns per-layer maxvio of the step's loads. method: "qb" | "sign" | "none"."""

    def __init__(self, model: nn.Module, method: str = "qb", gamma: float = 1e-3, exact: bool = False,
                 bins: int = 256, ema: float = 0.0, group: "dist.ProcessGroup | None" = None):
        from ..model.moe import LatentMoE

        if method not in ("qb", "sign", "none"):
            raise ValueError(f"method={method!r}: expected 'qb', 'sign' or 'none'")
        if not 0 <= ema < 1:
            raise ValueError(f"ema={ema}: expected in [0, 1)")
        if not gamma >= 0:
            raise ValueError(f"gamma={gamma}: expected ≥ 0")
        if method == "qb" and exact and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            raise ValueError("exact QB gathers every margin and runs on one process only; "
                             "use exact=False (histogram) under data/expert parallelism")
        self.method, self.gamma, self.exact, self.bins, self.ema, self.group = method, gamma, exact, bins, ema, group
        self.layers: dict[str, LatentMoE] = {n: m for n, m in model.named_modules() if isinstance(m, LatentMoE)}
        self._hooks = []
        for name, mod in self.layers.items():
            mod.record_routing = True
            self._hooks.append(mod.register_forward_hook(self._hook(name)))
        self._reset()

    def _reset(self) -> None:
        self.loads: dict[str, torch.Tensor] = {}
        self.hists: dict[str, MarginHistogram] = {}
        self.scores: dict[str, list[torch.Tensor]] = {}

    def _hook(self, name: str):
        def hook(mod, args, out):
            routing, mod.last_routing = mod.last_routing, None  # free the [m, n] scores
            if not mod.training or routing is None or torch._C._current_graph_task_id() != -1:
                return  # eval, or the recomputation of a checkpointed forward inside backward
            self.observe(name, *routing)
        return hook

    @torch.no_grad()
    def observe(self, name: str, topk_idx: torch.Tensor, scores: torch.Tensor) -> None:
        """Add one forward's routing (topk_idx [m, k], raw scores [m, n]) of layer `name`."""
        mod = self.layers[name]
        bias = mod.gate.e_score_correction_bias
        loads = expert_loads(topk_idx, bias.numel()).double()
        self.loads[name] = loads if name not in self.loads else self.loads[name] + loads
        if self.method != "qb":
            return
        if self.exact:
            self.scores.setdefault(name, []).append(scores.float())
        else:
            if name not in self.hists:
                self.hists[name] = MarginHistogram(bias, mod.top_k, self.bins)
            self.hists[name].add(scores)

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Apply the step's statistics to every layer's bias; returns {layer name: maxvio of this step}."""
        names = [n for n in self.layers if n in self.loads]
        if not names:
            return {}
        distributed = dist.is_available() and dist.is_initialized()
        if self.method == "qb" and self.exact and distributed and dist.get_world_size(self.group) > 1:
            raise ValueError("exact QB gathers every margin and runs on one process only; "
                             "use exact=False (histogram) under data/expert parallelism")
        parts = [self.loads[n] for n in names]
        if self.method == "qb" and not self.exact:
            parts += [self.hists[n].counts.reshape(-1) for n in names]
        flat = torch.cat([p.to(parts[0].device, torch.float64) for p in parts])
        if distributed:
            dist.all_reduce(flat, group=self.group)
        stats, off = {}, 0
        for n in names:
            numel = self.loads[n].numel()
            self.loads[n] = flat[off:off + numel]
            off += numel
            stats[n] = maxvio(self.loads[n])
        for n in names:
            bias = self.layers[n].gate.e_score_correction_bias
            if self.method == "sign":
                new = sign_update(self.loads[n].to(bias.device), bias.float(), self.gamma)
            elif self.method == "qb":
                if self.exact:
                    new = qb_update(torch.cat(self.scores[n]), bias, self.layers[n].top_k)
                else:
                    h = self.hists[n]
                    h.counts = flat[off:off + h.counts.numel()].view_as(h.counts)
                    off += h.counts.numel()
                    new = h.new_bias()
                if self.ema:
                    new = self.ema * bias.float() + (1 - self.ema) * new.to(bias.device)
            else:
                continue
            bias.copy_(new.to(bias.device, bias.dtype))
        self._reset()
        return stats

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for mod in self.layers.values():
            mod.record_routing = False
            mod.last_routing = None

    def state_dict(self) -> dict:
        """Mid-step statistics (empty right after `step()`); the biases themselves are model buffers."""
        return {"method": self.method, "gamma": self.gamma, "exact": self.exact, "bins": self.bins, "ema": self.ema,
                "loads": {n: v.clone() for n, v in self.loads.items()},
                "hists": {n: {"counts": h.counts.clone(), "bias": h._bias.clone()} for n, h in self.hists.items()},
                "scores": {n: [s.clone() for s in v] for n, v in self.scores.items()}}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("method", "exact", "bins"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"balance state {key}={sd[key]!r} does not match this controller's {getattr(self, key)!r}")
        unknown = set(sd["loads"]) - set(self.layers)
        if unknown:
            raise ValueError(f"balance state names layers not in this model: {sorted(unknown)}")
        self.gamma, self.ema = sd["gamma"], sd["ema"]
        self._reset()
        self.loads = {n: v.clone() for n, v in sd["loads"].items()}
        for n, h in sd["hists"].items():
            mh = MarginHistogram(h["bias"], self.layers[n].top_k, self.bins)
            mh.counts = h["counts"].clone()
            self.hists[n] = mh
        self.scores = {n: [s.clone() for s in v] for n, v in sd["scores"].items()}
