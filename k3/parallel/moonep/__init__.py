"""MoonEP: strictly balanced expert parallelism (K3_SPEC §9) on torch.distributed.

- `plan_counts(tokens_per_expert, num_ranks, capacity) -> alloc [E, R]` and `plan(...) -> MoonEPPlan`
  (planner.py: pure torch, CPU/GPU, no host sync);
- `MoonEPRuntime` (runtime.py): dispatch / prefetch / combine / reduce_grad with fixed-shape collectives;
- `ExpertParallel`, `enable_expert_parallel`, `gathered_experts`, `full_state_dict`,
  `sync_data_parallel_grads`, `clip_grad_norm_` (ep.py): the LatentMoE integration and what a trainer needs.
"""

from .ep import (ExpertParallel, clip_grad_norm_, enable_expert_parallel, full_state_dict, gathered_experts,
                 sync_data_parallel_grads)
from .planner import MoonEPPlan, align_up, num_slots, phase_a, phase_b, plan, plan_counts
from ...ops.moe import grouped_situ_ffn
from .runtime import MoonEPRuntime, RuntimePlan

__all__ = ["ExpertParallel", "clip_grad_norm_", "sync_data_parallel_grads", "MoonEPPlan", "MoonEPRuntime", "RuntimePlan", "align_up", "enable_expert_parallel",
           "full_state_dict", "gathered_experts", "grouped_situ_ffn", "num_slots", "phase_a", "phase_b", "plan",
           "plan_counts"]
