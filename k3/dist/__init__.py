"""Distributed execution on torch.distributed: MoonEP expert parallelism (`k3.dist.moonep`) and KDA
context parallelism (`k3.dist.kda_cp`). NCCL on GPU, gloo on CPU; NVLink multicast stays disabled."""
