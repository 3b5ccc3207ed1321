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

Nothing on the training path reads a value back to the host (a sync that stalls the launch queue): loads and
histograms are scatter-adds (torch.bincount reads the maximum index back), the histogram range lives on the
device, the range check is folded into the controller's step, and the step updates every layer with batched
ops and reads its statistics back once (or not at all: `step(sync=False)`).
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
    """Tokens routed to each expert, int64 [n], from topk_idx [m, k] (indices in [0, n)). A scatter-add:
    torch.bincount would read the largest index back to the host."""
    flat = topk_idx.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def maxvio(loads: torch.Tensor) -> float:
    """Max violation: max_j load_j / mean load − 1 (0 = perfectly balanced)."""
    l = loads.double()
    return (l.max() / l.mean() - 1).item()


def _maxvio_rows(loads: torch.Tensor) -> torch.Tensor:
    """`maxvio` of each row of loads [L, n], on the device (integer loads: the same numbers)."""
    l = loads.double()
    return l.amax(dim=-1) / l.mean(dim=-1) - 1


def route_topk(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Experts chosen with the selection bias: topk_idx [m, k] of scores + bias."""
    return torch.topk(scores.float() + bias.float(), k, dim=-1).indices


class MarginHistogram:
    """Per-expert histogram of QB margins for one layer and one step.

    The bin range is fixed by the bias of this step (the same on every rank), so counts from micro-batches
    and ranks add up exactly; `counts` [n, bins] is float64 (exact integers up to 2^53). The range (`lo`, `hi`,
    `width`: 0-dim float64 tensors on the bias's device) is never read back to the host."""

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
        self.lo = -span - b.max()
        self.hi = span - b.min()
        self.width = (self.hi - self.lo) / bins
        self.counts = torch.zeros(self.n, bins, dtype=torch.float64, device=bias.device)
        self._bias = bias.detach().clone()
        self.seen: torch.Tensor | None = None  # [2] running (min, max) of the margins added with check=False

    def add(self, scores: torch.Tensor, check: bool = True) -> None:
        """Accumulate the margins of raw scores [m, n] (routed with this step's bias). check=True verifies the
        margins lie in the histogram's range right here (a host sync); check=False only records their running
        (min, max) in `seen` for `out_of_range()` to judge later (the controller does, once per step)."""
        marg = qb_margins(scores, self._bias.to(scores.device), self.k).double()
        lo, width = self.lo.to(marg.device), self.width.to(marg.device)
        if check:
            if marg.numel() and (marg.min() < lo - 1e-9 or marg.max() > self.hi.to(marg.device) + 1e-9):
                raise self._range_error(marg.min(), marg.max())
        else:
            mm = torch.stack(torch.aminmax(marg)).to(self.counts.device)
            self.seen = mm if self.seen is None else torch.stack([torch.minimum(self.seen[0], mm[0]),
                                                                  torch.maximum(self.seen[1], mm[1])])
        idx = ((marg - lo) / width).floor().long().clamp_(0, self.bins - 1)  # hi edge → last bin
        flat = (idx + torch.arange(self.n, device=idx.device) * self.bins).reshape(-1).to(self.counts.device)
        ones = torch.ones(flat.numel(), dtype=torch.int32, device=flat.device)
        hits = torch.zeros(self.n * self.bins, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones)
        self.counts += hits.view(self.n, self.bins)

    def out_of_range(self) -> torch.Tensor:
        """0-dim bool on the device: did a margin added with check=False fall outside [lo, hi]?"""
        if self.seen is None:
            return torch.zeros((), dtype=torch.bool, device=self.counts.device)
        return (self.seen[0] < self.lo - 1e-9) | (self.seen[1] > self.hi + 1e-9)

    def _range_error(self, mn, mx) -> ValueError:
        return ValueError(f"margins outside [{self.lo:.4g}, {self.hi:.4g}]: router scores outside the declared "
                          f"score_range (got min {mn:.4g}, max {mx:.4g})")

    def new_bias(self) -> torch.Tensor:
        """QB bias [n] from the (already all-reduced) counts: −quantile_{1−k/n} per expert, mean-centred."""
        return qb_from_counts(self.counts, self.k, self.lo, self.width)


def qb_from_counts(counts: torch.Tensor, k: int, lo: float | torch.Tensor, width: float | torch.Tensor) -> torch.Tensor:
    """−quantile_{1−k/n} of each expert's margins from histogram counts [n, bins] (bins of `width` from `lo`),
    linearly interpolated inside the bin that holds the quantile; mean-centred, fp32."""
    if counts[0].sum() <= 0:
        raise ValueError("empty histogram: no tokens were observed this step")
    dev = counts.device
    lo = torch.as_tensor(lo, dtype=torch.float64, device=dev).reshape(1)
    width = torch.as_tensor(width, dtype=torch.float64, device=dev).reshape(1)
    return _qb_from_counts_rows(counts.unsqueeze(0), k, lo, width)[0]


def _qb_from_counts_rows(counts: torch.Tensor, k: int, lo: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """`qb_from_counts` for L histograms at once: counts [L, n, bins], lo and width [L] (float64) → [L, n] fp32.
    Row-wise the same arithmetic; an empty row is not checked here (gives a finite, meaningless row)."""
    L, n, bins = counts.shape
    m = counts[:, 0].sum(dim=-1)  # [L] tokens (exact integers)
    target = (1 - k / n) * m  # number of margins at or below the threshold
    cum = counts.cumsum(dim=-1)
    j = torch.searchsorted(cum, target[:, None, None].expand(L, n, 1).contiguous()).squeeze(-1)
    j = j.clamp_(max=bins - 1)
    below = torch.where(j > 0, cum.gather(-1, (j - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1),
                        torch.zeros_like(cum[:, :, 0]))
    inbin = counts.gather(-1, j.unsqueeze(-1)).squeeze(-1)
    frac = torch.where(inbin > 0, (target[:, None] - below) / inbin.clamp(min=1e-300), torch.zeros_like(inbin))
    quant = lo[:, None] + width[:, None] * (j.double() + frac.clamp(0, 1))
    b_hat = -quant
    return (b_hat - b_hat.mean(dim=-1, keepdim=True)).float()


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
    `exact=True`), without host syncs. `step()` sums everything of all layers across ranks with ONE
    all_reduce, writes the new biases (all layers at once), resets, and returns per-layer maxvio of the step's
    loads. method: "qb" | "sign" | "none"."""

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
        self._pending = None  # step(sync=False)'s range check, read at the next step
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
            self.hists[name].add(scores, check=False)  # range checked once, in step()

    @torch.no_grad()
    def step(self, sync: bool = True) -> dict:
        """Apply the step's statistics to every layer's bias; returns {layer name: maxvio of this step}.

        One all_reduce, then batched ops over the layers (grouped by expert count, top-k and device) and ONE
        host read for the maxvio values and the histogram range check (raised before any bias is written).
        sync=False skips the read: the values stay 0-dim device tensors; on CUDA the range check is copied to the
        host asynchronously and raised by the next `step()` (on CPU, where reading costs nothing, at once)."""
        self.raise_pending()
        names = [n for n in self.layers if n in self.loads]
        if not names:
            return {}
        distributed = dist.is_available() and dist.is_initialized()
        if self.method == "qb" and self.exact and distributed and dist.get_world_size(self.group) > 1:
            raise ValueError("exact QB gathers every margin and runs on one process only; "
                             "use exact=False (histogram) under data/expert parallelism")
        hist = self.method == "qb" and not self.exact
        parts = [self.loads[n] for n in names]
        if hist:
            parts += [self.hists[n].counts.reshape(-1) for n in names]
        flat = torch.cat([p.to(parts[0].device, torch.float64) for p in parts])
        if distributed:
            dist.all_reduce(flat, group=self.group)
        loads, counts, off = {}, {}, 0
        for n in names:
            loads[n] = flat[off:off + self.loads[n].numel()]
            off += loads[n].numel()
        if hist:
            for n in names:
                h = self.hists[n]
                counts[n] = flat[off:off + h.counts.numel()].view_as(h.counts)
                off += h.counts.numel()
        groups: dict[tuple, list[str]] = {}
        for n in names:
            bias = self.layers[n].gate.e_score_correction_bias
            groups.setdefault((bias.numel(), self.layers[n].top_k, bias.device), []).append(n)
        vio, bad, writes = [], [], []  # writes: (biases, new [L, n]) per group
        for (ne, k, dev), group in groups.items():
            biases = [self.layers[n].gate.e_score_correction_bias for n in group]
            ld = torch.stack([loads[n] for n in group]).to(dev)  # [L, n]
            vio.append(_maxvio_rows(ld))
            b = torch.stack(biases).float()
            if self.method == "sign":
                new = (b.double() + self.gamma * torch.sign(ld.mean(dim=-1, keepdim=True) - ld)).float()
            elif self.method == "qb":
                if self.exact:
                    new = torch.stack([qb_update(torch.cat(self.scores[n]), self.layers[n].gate.e_score_correction_bias,
                                                 k).to(dev) for n in group])
                else:
                    hs = [self.hists[n] for n in group]
                    new = _qb_from_counts_rows(torch.stack([counts[n] for n in group]).to(dev), k,
                                               torch.stack([h.lo for h in hs]).to(dev),
                                               torch.stack([h.width for h in hs]).to(dev))
                    bad.append(torch.stack([torch.stack([h.out_of_range().to(dev) for h in hs]).double(),
                                            torch.stack([h.lo for h in hs]).to(dev),
                                            torch.stack([h.hi for h in hs]).to(dev)] +
                                           [torch.stack([(h.seen if h.seen is not None else h.lo.expand(2))[i].to(dev)
                                                         for h in hs]) for i in (0, 1)], dim=1))
                if self.ema:
                    new = self.ema * b + (1 - self.ema) * new
            else:
                continue
            writes.append((biases, new))
        vdev = vio[0].device
        vio_t = torch.cat([v.to(vdev) for v in vio])
        bad_t = torch.cat([x.to(vdev) for x in bad]) if bad else None  # [L, 5]: flag, lo, hi, min, max
        ordered = [n for g in groups.values() for n in g]
        if sync:
            vals = torch.cat([vio_t] + ([bad_t.reshape(-1)] if bad_t is not None else [])).tolist()  # the one read
            if bad_t is not None:
                self._check_range(ordered, vals[len(names):])
            out = dict(zip(ordered, vals[:len(names)]))
        else:
            out = dict(zip(ordered, vio_t.unbind(0)))
            if bad_t is not None:
                self._defer_check(ordered, bad_t)
        for biases, new in writes:
            torch._foreach_copy_(biases, [r.to(biases[0].dtype) for r in new.unbind(0)])
        self._reset()
        return {n: out[n] for n in names}

    @staticmethod
    def _check_range(names: list[str], rows: list[float]) -> None:
        """Raise for the layers whose histogram saw margins outside its range (rows: flag, lo, hi, min, max)."""
        bad = [(n, rows[5 * i:5 * i + 5]) for i, n in enumerate(names) if rows[5 * i]]
        if bad:
            detail = "; ".join(f"{n}: range [{r[1]:.4g}, {r[2]:.4g}], got min {r[3]:.4g}, max {r[4]:.4g}"
                               for n, r in bad)
            raise ValueError(f"QB histogram margins outside their range: router scores outside the declared "
                             f"score_range ({detail})")

    def _defer_check(self, names: list[str], bad: torch.Tensor) -> None:
        if bad.device.type == "cuda":
            host = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            host.copy_(bad, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._pending = (names, host, ev)
        else:
            self._check_range(names, bad.reshape(-1).tolist())

    def raise_pending(self) -> None:
        """Raise the range error a `step(sync=False)` deferred, if its copy showed one."""
        if self._pending is not None:
            names, host, ev = self._pending
            self._pending = None
            ev.synchronize()  # long done: a step's work ago
            self._check_range(names, host.reshape(-1).tolist())

    @torch.no_grad()
    def _step_reference(self) -> dict[str, float]:
        """`step` as first written: layer by layer, with a host read per layer (maxvio, the histogram's range
        and emptiness checks). Same statistics, same biases."""
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
                    if h.out_of_range():
                        raise h._range_error(*h.seen)
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
                "hists": {n: {"counts": h.counts.clone(), "bias": h._bias.clone(),
                              "seen": None if h.seen is None else h.seen.clone()} for n, h in self.hists.items()},
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
            mh.seen = None if h.get("seen") is None else h["seen"].clone()
            self.hists[n] = mh
        self.scores = {n: [s.clone() for s in v] for n, v in sd["scores"].items()}
