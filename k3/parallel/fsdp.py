"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for a K3 model on a `K3Mesh`, composed with MoonEP.

    mesh = build_mesh(ParallelDims(dp_shard=2, ep=2))
    enable_expert_parallel(model, mesh.ep.get_group())   # first: experts keep their E/ep home rows
    apply_fsdp(model, mesh)                              # then: shard what each rank holds

Routed experts (`StackedExperts`, already EP-sliced) are sharded over `mesh.efsdp` = (dp_shard, cp): their
gradients are summed over the EP ranks by MoonEP's combine/reduce_grad and over efsdp by FSDP. Every other
parameter is sharded per decoder layer (plus the root: embedding, head, norms) over `mesh.fsdp` =
(dp_shard, cp, ep). Loss convention: each rank's loss is its tokens' share of its sequence's loss (the cp
ranks of a sequence add up to it), and the step minimises the mean over the dp_shard·ep sequences. So every
reduced gradient is Σ_ranks ∂loss_r / (dp_shard·ep): FSDP's divide factor is set to dp_shard·ep for both
groups (expert grads arrive already summed over the ep ranks by MoonEP).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` in place (see the module docstring). `param_dtype` / `reduce_dtype`: FSDP2 mixed
    precision (e.g. bf16 / fp32 on GPU; None keeps the parameters' dtype). Returns model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from ..model.decoder import KimiDecoderLayer

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    from ..model.decoder import MTPLayer
    from ..model.moe import LatentMoE

    factor = float(mesh.dims.batch_parallel)

    def shard(m, group_mesh):
        fully_shard(m, mesh=group_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        m.set_gradient_divide_factor(factor)
        if group_mesh.device_type == "cpu" and 1 < group_mesh.size() != factor:
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: sum, then divide by the factor
            # (not on a 1-rank group: torch then divides there AND after, i.e. twice)

    for m in model.modules():
        if isinstance(m, LatentMoE):
            ex = m.experts
            ex.run_experts = types.MethodType(_run_experts, ex)
            shard(ex, mesh.efsdp)
            register_fsdp_forward_method(ex, "run_experts")
            m.expert_parallel = ShardedExperts(m.expert_parallel, ex)
    for m in model.modules():
        if isinstance(m, KimiDecoderLayer):
            shard(m, mesh.fsdp)
            register_fsdp_forward_method(m, "forward_mtp" if isinstance(m, MTPLayer) else "forward_attn_res")
    shard(model, mesh.fsdp)
    if hasattr(model, "generate"):  # it embeds the prompt (model.embed) outside forward: root unsharded
        model.generate = types.MethodType(_generate_unsharded, model)
    return model


def _generate_unsharded(self, *args, **kwargs):
    """`generate` of an FSDP2 root: its own parameters (embedding, head, output AttnRes) all-gathered for
    the whole generation (the decoder layers gather theirs per call), then sharded again."""
    self.unshard()
    try:
        return type(self).generate(self, *args, **kwargs)
    finally:
        self.reshard()


def _run_experts(self, ep, x, topk_idx, topk_weight, num_experts, beta, linear_beta):
    """The routed-expert computation of one LatentMoE, as a method of its FSDP2-sharded experts module (so that
    FSDP unshards w1/w2/w3 around it and reduce-scatters their gradients)."""
    if ep is None:
        from ..ops.moe import experts_forward
        return experts_forward(x, topk_idx, topk_weight, self.w1, self.w2, self.w3, beta, linear_beta)
    return ep(x, topk_idx, topk_weight, self.w1, self.w2, self.w3, num_experts, beta, linear_beta)


class ShardedExperts:
    """The experts executor of a LatentMoE whose `experts` module is FSDP2-sharded: the layer reads the
    (sharded) parameters before calling the executor, so this one ignores them and runs the experts through
    the experts module's registered FSDP forward method `run_experts` (MoonEP's `ExpertParallel` inside, or
    `k3.ops.moe.experts_forward` when the model has no EP); other attributes are the wrapped executor's."""

    def __init__(self, ep, experts: nn.Module):
        self.ep, self.experts = ep, experts

    def __getattr__(self, name):
        if name in ("ep", "experts"):
            raise AttributeError(name)
        return getattr(self.ep, name)

    def num_local(self, num_experts: int) -> int:
        return num_experts if self.ep is None else self.ep.num_local(num_experts)

    def __call__(self, x, topk_idx, topk_weight, w1, w2, w3, num_experts, beta=4.0, linear_beta=25.0):
        return self.experts.run_experts(self.ep, x, topk_idx, topk_weight, num_experts, beta, linear_beta)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, group=None) -> torch.Tensor:
    """Global-norm gradient clipping for a model under FSDP2 (+ MoonEP, + pipeline stages): each rank sums
    the squares of its local gradient shards (fp64), one all_reduce over `group` (default: the world) adds
    them, every gradient is scaled by min(1, max_norm / (norm + 1e-6)). Exact when every gradient element
    lives on exactly one rank of `group`: FSDP2 shards (non-experts over dp_shard·cp·ep, a rank's home
    experts over dp_shard·cp — the ep ranks hold different experts) and different pipeline stages do; a
    replicated plain gradient would be counted once per rank. Without a process group this is
    `torch.nn.utils.clip_grad_norm_`'s arithmetic. Returns the norm (fp32, identical on every rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    dev = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g in local:
        sq += g.double().square().sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in local:
        g.mul_(coef.to(g.dtype))
    return total.float()
