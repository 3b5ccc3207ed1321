"""MoonEP: strictly balanced expert parallelism (K3_SPEC §9) on torch.distributed.

- `plan_counts(tokens_per_expert, num_ranks, capacity) -> alloc [E, R]` and `plan(...) -> MoonEPPlan`
  (planner.py: pure torch, CPU/GPU, no host sync);
- `MoonEPRuntime` (runtime.py): dispatch / prefetch / combine / reduce_grad with fixed-shape collectives;
- `ExpertParallel`, `enable_expert_parallel`, `gathered_experts`, `full_state_dict` (ep.py): the LatentMoE
  integration.
"""

from .ep import ExpertParallel, enable_expert_parallel, full_state_dict, gathered_experts
from .planner import MoonEPPlan, align_up, num_slots, phase_a, phase_b, plan, plan_counts
from .runtime import MoonEPRuntime, RuntimePlan, grouped_situ_ffn

__all__ = ["ExpertParallel", "MoonEPPlan", "MoonEPRuntime", "RuntimePlan", "align_up", "enable_expert_parallel",
           "full_state_dict", "gathered_experts", "grouped_situ_ffn", "num_slots", "phase_a", "phase_b", "plan",
           "plan_counts"]
