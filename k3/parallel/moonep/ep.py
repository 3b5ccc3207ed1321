"""Expert parallelism for the LatentMoE: each rank keeps only its home experts' weights (E/R) and runs the
MoonEP path (plan → dispatch → prefetch → grouped SiTU-GLU → combine).

    ep = ExpertParallel(group)                    # or enable_expert_parallel(model, group)
    model = enable_expert_parallel(model, group)  # slices experts.w1/w2/w3 to rows [rank·E/R, (rank+1)·E/R)
    loss.backward()                               # one loss per rank, on its own batch
    sync_data_parallel_grads(model)               # all-reduce the replicated grads; experts are already summed
    clip_grad_norm_(model, 1.0)                   # global norm over shards + replicas
    with gathered_experts(model):                 # collective: full [E, …] experts on every rank
        if rank == 0: save_pretrained(model, out) # the release layout, unchanged

Input and route weights keep their single-process meaning; every rank must pass the same number of tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ...ops.moe import grouped_situ_ffn
from . import comm
from .runtime import MoonEPRuntime, RuntimePlan


class ExpertParallel:
    """The EP executor a LatentMoE calls instead of `experts_forward`; one instance can serve every layer."""

    def __init__(self, group=None, padding: int = 1, use_grouped_mm: bool | None = None, prefetch: str = "static"):
        self.runtime = MoonEPRuntime(group, padding, prefetch)
        self.group, self.rank, self.world = group, self.runtime.rank, self.runtime.R
        self.use_grouped_mm = use_grouped_mm
        self.on_plan = None  # optional callback(RuntimePlan), e.g. for tests and statistics

    def num_local(self, num_experts: int) -> int:
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP world size {self.world}")
        return num_experts // self.world

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, num_experts: int, beta: float = 4.0,
                 linear_beta: float = 25.0) -> torch.Tensor:
        """Same function as `k3.ops.moe.experts_forward` with all E experts; w1/w2/w3 hold the home rows."""
        if w1.shape[0] != self.num_local(num_experts):
            raise ValueError(f"local experts {w1.shape[0]} != num_experts/world = {num_experts // self.world}")
        out_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # as F.linear would: compute (and move weights) in that dtype
            dt = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = x.to(dt), w1.to(dt), w2.to(dt), w3.to(dt)
        rt = self.runtime
        rp: RuntimePlan = rt.plan(topk_idx, num_experts)
        if self.on_plan is not None:
            self.on_plan(rp)
        xs = rt.dispatch(x, rp)
        ws = rt.dispatch_weights(topk_weight, rp)
        W1, W2, W3 = rt.prefetch(rp, w1, w2, w3)
        y = grouped_situ_ffn(xs, rp.plan.local_cu_seqlens, W1, W2, W3, beta, linear_beta, self.use_grouped_mm)
        y = y.to(torch.promote_types(y.dtype, torch.float32)) * ws.unsqueeze(-1)
        return rt.combine(y, rp, x.dtype).to(out_dtype)


def _moe_layers(model: nn.Module):
    from ...model.moe import LatentMoE
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoE)]


@torch.no_grad()
def enable_expert_parallel(model: nn.Module, group=None, padding: int = 1,
                           use_grouped_mm: bool | None = None, prefetch: str = "static") -> nn.Module:
    """Convert every LatentMoE of `model` (full experts, identical on all ranks) to EP over `group` in place:
    keep experts rows [rank·E/R, (rank+1)·E/R) as the parameters and route through MoonEP. Returns model."""
    ep = ExpertParallel(group, padding, use_grouped_mm, prefetch)
    for name, m in _moe_layers(model):
        if m.expert_parallel is not None:
            raise ValueError(f"{name} already runs expert parallel")
        m.set_expert_parallel(ep)
    return model


@contextlib.contextmanager
def gathered_experts(model: nn.Module):
    """Collective: inside the block every EP LatentMoE holds all E experts (all-gathered, detached) and runs
    the single-process path, so `state_dict()` / `save_pretrained` give the full release layout."""
    saved = []
    with torch.no_grad():
        for _, m in _moe_layers(model):
            ep = m.expert_parallel
            if ep is None:
                continue
            local = {k: getattr(m.experts, k) for k in ("w1", "w2", "w3")}
            for k, p in local.items():
                setattr(m.experts, k, nn.Parameter(comm.all_gather(p.detach(), ep.group), requires_grad=False))
            m.expert_parallel = None
            saved.append((m, ep, local))
    try:
        yield model
    finally:
        for m, ep, local in saved:
            for k, p in local.items():
                setattr(m.experts, k, p)
            m.expert_parallel = ep


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the model's state dict with full [E, …] experts (a CPU copy), as the single-process model."""
    with gathered_experts(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _is_sharded(model: nn.Module) -> set[str]:
    """Names of the expert-parallel (sharded) parameters."""
    out = set()
    for name, m in _moe_layers(model):
        if m.expert_parallel is not None:
            out |= {f"{name}.experts.{k}" if name else f"experts.{k}" for k in ("w1", "w2", "w3")}
    return out


@torch.no_grad()
def sync_data_parallel_grads(model: nn.Module, group=None, average: bool = True) -> None:
    """After backward with one loss per rank: all-reduce (sum) the replicated parameters' grads over `group`
    (data parallel over the EP ranks). Sharded expert grads already hold Σ_r ∂loss_r/∂W (combine and
    reduce_grad summed them), so they are not reduced; with `average` every grad is divided by R, i.e. the
    gradient of the mean of the per-rank losses."""
    R, sharded = dist.get_world_size(group), _is_sharded(model)
    rep = [p.grad for n, p in model.named_parameters() if p.grad is not None and n not in sharded]
    for dt in {g.dtype for g in rep}:
        gs = [g for g in rep if g.dtype == dt]
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        for g, v in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(v.view_as(g))
    if average:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(R)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """Global-norm clipping for an EP model after `sync_data_parallel_grads`: replicated grads counted once,
    sharded expert grads summed over ranks. Returns the total norm (identical on every rank)."""
    sharded = _is_sharded(model)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    dev = named[0][1].device if named else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float64, device=dev)
    for n, g in named:
        sq[0 if n in sharded else 1] += g.double().square().sum()
    shard = sq[:1].clone()
    dist.all_reduce(shard, group=group)
    total = (shard[0] + sq[1]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for _, g in named:
        g.mul_(coef.to(g.dtype))
    return total.float()
