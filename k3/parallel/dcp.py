"""Distributed checkpoints (`torch.distributed.checkpoint`) of a model under FSDP2 + MoonEP, resumable at
another layout (e.g. 2 ranks → 1 rank, or EP → no EP).

FSDP2 parameters are DTensors over the `fsdp` / `efsdp` meshes and DCP reshards them by itself. The routed
experts are the exception: each EP rank holds a different block of E/ep rows that FSDP only knows as an
[E/ep, …] tensor, so `dcp_state_dict` presents them as one [E, …] DTensor sharded over the `ep` mesh (rows
[e·E/ep, (e+1)·E/ep) on EP rank e: the full-model layout). The keys are the model's own state-dict keys, so a
plain single-process model (`model.state_dict()`) loads the same checkpoint.

    save_model(model, path, mesh)       # collective, every rank
    load_model(plain_model, path)       # one process, no process group needed
"""

from __future__ import annotations

import os

import torch
from torch import nn


def _expert_names(model: nn.Module) -> list[str]:
    """Keys of the sharded experts, in module order: the same order on every rank (collectives follow it)."""
    from ..model.moe import LatentMoE
    return [f"{n}.experts.{k}" for n, m in model.named_modules() if isinstance(m, LatentMoE)
            and m.expert_parallel is not None for k in ("w1", "w2", "w3")]


def dcp_state_dict(model: nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """The model's state dict with EP-sliced experts as [E, …] DTensors sharded over `mesh.ep` (a `K3Mesh`;
    needed only when the model runs expert parallel). Parameters are the live tensors (no copies) except
    those experts, which are gathered over `efsdp` first."""
    from torch.distributed.tensor import DTensor, Shard

    sd = model.state_dict()
    experts = _expert_names(model)
    if experts and mesh is None:
        raise ValueError("dcp_state_dict: the model runs expert parallel; pass the K3Mesh it was built on")
    for k in experts:
        t = sd[k]
        home = t.full_tensor() if isinstance(t, DTensor) else t.detach()  # [E/ep, …], same on the efsdp ranks
        sd[k] = DTensor.from_local(home, mesh.ep, [Shard(0)], run_check=False)
    return sd


def save_model(model: nn.Module, path: str | os.PathLike, mesh=None) -> None:
    """Collective: write the model's weights to `path` (a DCP directory)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(dcp_state_dict(model, mesh), checkpoint_id=str(path))


@torch.no_grad()
def load_model(model: nn.Module, path: str | os.PathLike, mesh=None) -> nn.Module:
    """Read `path` into `model` (collective when distributed): a plain model, or one under FSDP2 + MoonEP
    built on `mesh`. Every key of the model must be in the checkpoint (DCP raises naming it otherwise)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, distribute_tensor

    sd = dcp_state_dict(model, mesh)
    experts = _expert_names(model)
    dcp.load(sd, checkpoint_id=str(path))
    live = model.state_dict()
    for k in experts:  # the [E, …] view was a gathered copy: write this rank's rows back into the parameter
        home = sd[k].to_local()
        dst = live[k]
        if isinstance(dst, DTensor):
            dst.copy_(distribute_tensor(home, dst.device_mesh, dst.placements))
        else:
            dst.copy_(home)
    return model
