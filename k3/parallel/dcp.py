"""Distributed checkpoints (`torch.distributed.checkpoint`) of a model under FSDP2 + MoonEP, resumable at
another layout (e.g. 2 ranks → 1 rank, or EP → no EP).

FSDP2 parameters are DTensors over the `fsdp` / `efsdp` meshes and DCP reshards them by itself. The routed
experts are the exception: each EP rank holds a different block of E/ep rows that FSDP only knows as an
[E/ep, …] tensor, so `dcp_state_dict` presents them as one [E, …] DTensor sharded over the `ep` mesh (rows
[e·E/ep, (e+1)·E/ep) on EP rank e: the full-model layout). The keys are the model's own state-dict keys, so a
plain single-process model (`model.state_dict()`) loads the same checkpoint.

    save_model(model, path, mesh)       # collective, every rank
    load_model(plain_model, path)       # one process, no process group needed

With an optimizer (`save_model(model, path, mesh, optimizer)`) its per-parameter state is stored beside the
weights as `optim.<parameter name>.<state key>`, laid out like the parameter (experts as [E, …] over `ep`),
so it too loads at another layout; `full_state_dict` gathers the single-process state dict on rank 0 (the
HF export of a distributed run).

Pipeline stages (`k3.parallel.pipeline.split_stage`) carry the checkpoint's parameter names, so each stage's
ranks save and load their own keys into the one DCP folder and the stages' states partition the whole model's:
a checkpoint written at pp = 2 loads into one process (or another layout) unchanged. For the HF export,
`gather_pipeline_state_dict` sends every stage's full tensors to global rank 0.
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


def _as_global_expert(t: torch.Tensor, mesh) -> torch.Tensor:
    """A rank's home-expert tensor [E/ep, …] (an FSDP2 DTensor over efsdp, or plain) → the [E, …] DTensor
    sharded over `mesh.ep` (a gathered copy)."""
    from torch.distributed.tensor import DTensor, Shard
    home = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return DTensor.from_local(home, mesh.ep, [Shard(0)], run_check=False)


def _write_home(dst: torch.Tensor, home: torch.Tensor) -> None:
    """Copy the full home rows `home` [E/ep, …] into `dst` (its FSDP2 shard when a DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate
    if isinstance(dst, DTensor):
        rep = DTensor.from_local(home, dst.device_mesh, [Replicate()] * dst.device_mesh.ndim, run_check=False)
        dst.to_local().copy_(rep.redistribute(dst.device_mesh, dst.placements).to_local())
    else:
        dst.copy_(home)


def optimizer_state_dict(model: nn.Module, optimizer, mesh=None) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state keyed `optim.<parameter name>.<state key>`: the live tensors
    (FSDP2 DTensors or plain; 0-dim step counts as they are) except the EP-sliced experts' per-element
    state, presented as gathered [E, …] DTensors over `mesh.ep` like the weights."""
    names = {id(p): n for n, p in model.named_parameters()}
    experts = set(_expert_names(model))
    if experts and mesh is None:
        raise ValueError("optimizer_state_dict: the model runs expert parallel; pass the K3Mesh it was built on")
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("optimizer_state_dict: the optimizer holds a parameter that is not the model's")
            for k, v in optimizer.state.get(p, {}).items():
                name = names[id(p)]
                if name in experts and torch.is_tensor(v) and v.dim() > 0:
                    v = _as_global_expert(v, mesh)
                out[f"optim.{name}.{k}"] = v
    return out


@torch.no_grad()
def init_optimizer_state(optimizer) -> None:
    """Create every parameter's optimizer state (the structure a checkpoint is read into): one step with
    zero gradients at lr 0, which leaves every weight unchanged (decoupled decay is scaled by lr too).
    Collective under FSDP2 (Muon gathers its updates)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    had = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, h in zip(params, had):
            if not h:
                p.grad = None


def save_model(model: nn.Module, path: str | os.PathLike, mesh=None, optimizer=None) -> None:
    """Collective: write the model's weights (and the optimizer's state) to `path` (a DCP directory)."""
    import torch.distributed.checkpoint as dcp
    sd = dcp_state_dict(model, mesh)
    if optimizer is not None:
        sd.update(optimizer_state_dict(model, optimizer, mesh))
    dcp.save(sd, checkpoint_id=str(path))


@torch.no_grad()
def load_model(model: nn.Module, path: str | os.PathLike, mesh=None, optimizer=None) -> nn.Module:
    """Read `path` into `model` (collective when distributed): a plain model, or one under FSDP2 + MoonEP
    built on `mesh`. Every key of the model must be in the checkpoint (DCP raises naming it otherwise).
    With `optimizer`, its state is created (`init_optimizer_state`) and read too; a parameter without state in
    the checkpoint (it never had a gradient) is left without state, as it was when saved."""
    import torch.distributed.checkpoint as dcp

    sd = dcp_state_dict(model, mesh)
    experts = _expert_names(model)
    osd = {}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        osd = optimizer_state_dict(model, optimizer, mesh)
        names = {id(p): n for n, p in model.named_parameters()}
        for p in [p for g in optimizer.param_groups for p in g["params"]]:
            keys = [f"optim.{names[id(p)]}.{k}" for k in optimizer.state.get(p, {})]
            if keys and not any(k in stored for k in keys):
                optimizer.state.pop(p)
                for k in keys:
                    osd.pop(k)
    dcp.load({**sd, **osd}, checkpoint_id=str(path))
    live = model.state_dict()
    for k in experts:  # the [E, …] view was a gathered copy: write this rank's rows back into the parameter
        _write_home(live[k], sd[k].to_local())
    if optimizer is not None:
        params = {n: p for n, p in model.named_parameters()}
        for k, v in osd.items():
            name, key = k[len("optim."):].rsplit(".", 1)
            if name in experts and torch.is_tensor(v) and v.dim() > 0:
                _write_home(optimizer.state[params[name]][key], v.to_local())
    return model


def full_state_dict(model: nn.Module, mesh=None, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
    """Collective: the single-process state dict (full tensors, experts [E, …], CPU copies), one tensor
    gathered at a time; on rank 0 only (None elsewhere) unless `rank0_only=False`. Under pipeline parallelism
    (`mesh.dims.pp > 1`, `model` a stage) "rank 0" is the stage's first rank (rank 0 of `mesh.fsdp`) and the
    dict holds that stage's tensors; `gather_pipeline_state_dict` brings the stages together."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if rank0_only and dist.is_initialized():
        keep = (mesh.fsdp.get_local_rank() if mesh is not None and mesh.dims.pp > 1 else dist.get_rank()) == 0
    else:
        keep = True
    out = {}
    for k, t in dcp_state_dict(model, mesh).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if keep:
            out[k] = full.cpu().clone()
        del full
    return out if keep else None


def gather_pipeline_state_dict(stage_sd: dict[str, torch.Tensor] | None, mesh,
                               device: torch.device | str = "cpu") -> dict[str, torch.Tensor] | None:
    """Collective over the pp group of global rank 0 (the first rank of every stage; the other ranks return None
    at once): every stage's `full_state_dict` (`stage_sd`, CPU tensors) sent tensor by tensor to global rank 0,
    which returns the whole model's state dict (CPU; None elsewhere). The stages' key sets must be disjoint
    (`split_stage`'s are). `device`: where the tensors travel (the device of the process group's backend)."""
    import torch.distributed as dist

    if mesh.fsdp.get_local_rank() != 0:
        return None
    group, me = mesh.pp.get_group(), mesh.pp.get_local_rank()
    metas: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, [(k, tuple(t.shape), t.dtype) for k, t in stage_sd.items()], group=group)
    seen = [k for m in metas for k, _, _ in m]
    if len(seen) != len(set(seen)):
        raise ValueError("gather_pipeline_state_dict: a key is held by two stages; stage state dicts must be disjoint")
    out = dict(stage_sd) if me == 0 else None
    for src in range(1, len(metas)):
        if me not in (0, src):
            continue
        for k, shape, dtype in metas[src]:
            if me == src:
                dist.send(stage_sd[k].to(device).contiguous(), group_dst=0, group=group)
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, group_src=src, group=group)
                out[k] = buf.cpu()
    return out
