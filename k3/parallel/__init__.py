"""Parallel training on torch.distributed, applied to a model from outside (`k3.model` never imports this
package): the device mesh over (pp, dp_shard, cp, ep) (`mesh`), FSDP2 for non-expert parameters (`fsdp`),
MoonEP expert parallelism (`moonep`), KDA context parallelism (`kda_cp`) and the memory/communication
planner behind `k3 plan` (`plan`). NCCL on GPU, gloo on CPU; NVLink multicast stays disabled."""
