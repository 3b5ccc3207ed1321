"""Pipeline parallelism (`k3.parallel.pipeline`) on k3-tiny in fp32 against the single-process step on the same
micro-batches (loss = mean over micro-batches of lm_loss + 0.3 · mtp_loss; every gradient to 1e-5 `rel_rmse`):
- in one process: the stages of a pp = 2 and a pp = 3 split, chained by hand, give the model's loss and gradients;
  their state dicts partition the model's (checkpoint names);
- 2 gloo processes, pp = 2 (CI): `PipelineStep` with GPipe and with 1F1B, packed documents in one row, two
  micro-batches; `clip_grad_norm_` gives the global norm; `forward_loss` (evaluation: forward only, the stages
  in turn) gives the eval-mode model's lm and MTP losses on the whole batch (1e-5);
- 4 gloo processes (K3_LONG_TESTS=1), every stage under FSDP2: pp = 2 × dp_shard = 2, pp = 2 × ep = 2 (MoonEP)
  and pp = 2 × cp = 2 (context parallel, the cp ranks' losses add up): the loss, the clipped gradients and the
  global norm of `clip_grad_norm_`."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from conftest import full_grad, make_tiny, rel_rmse
from k3.parallel._launch import spawn_gloo
from k3.parallel.pipeline import PipelineStep, clip_grad_norm_, cu_seqlens_from_docs, split_stage, state_size

TOL = 1e-5
T = 32
W = 0.3  # mtp_weight
# pp × cp runs in fp64: context parallelism starts KDA chunks at segment boundaries, a different chunk grid, which
# moves fp32 KDA gate gradients by ~2e-5 relative (tests/test_parallel_cp.py makes the same choice)
CP_DTYPE = torch.float64
# 4 rows of T tokens: row 0 packs two documents, row 2 three; rows 1 and 3 hold one each
CU = [0, 13, 32, 64, 70, 71, 96, 128]
ROW_CU = [[0, 13, 32], [0, 32], [0, 6, 7, 32], [0, 32]]  # each row alone, re-based (written out independently)


def _batch():
    g = torch.Generator().manual_seed(321)
    return torch.randint(0, 4000, (4, T), generator=g), torch.tensor(CU, dtype=torch.int32)


def _row_loss(model, ids, r):
    out = model(ids[r:r + 1], labels=ids[r:r + 1], cu_seqlens=torch.tensor(ROW_CU[r], dtype=torch.int32))
    return out.loss + W * out.mtp_loss


def _reference(rows, dtype=torch.float32):
    """Single process: mean over the rows (one micro-batch each) of the row's loss; its gradients; the norm."""
    model = make_tiny(seed=7).to(dtype).train()
    loss = sum(_row_loss(model, _batch()[0], r) for r in rows) / len(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads.values()]))
    return loss.detach(), grads, norm


def _check_grads(got: dict, ref: dict):
    assert sorted(got) == sorted(ref), set(got) ^ set(ref)
    for n, g in got.items():
        assert g.shape == ref[n].shape, n
        err = rel_rmse(ref[n], g)
        assert err <= TOL, (n, err)


# ---- one process ---------------------------------------------------------------------------------------------

def test_state_size_counts_blocks():
    # block size 2: after layer 0 → [emb, partial]; layer 2 closes block {0,1} → after layers 0..2: 3 tensors
    assert [state_size(k, 2) for k in (1, 2, 3, 4, 5)] == [2, 2, 3, 3, 4]
    assert state_size(93, 12) == 2 + 92 // 12


def test_cu_seqlens_from_docs_rebases_rows_and_drops_empty_documents():
    from k3.ops.varlen import doc_ids
    cu = torch.tensor([0, 13, 13, 32, 64, 70, 71, 96], dtype=torch.int32)  # an empty document at 13
    docs = doc_ids(cu, 3, 32)
    assert cu_seqlens_from_docs(docs[:1]).tolist() == [0, 13, 32]
    assert cu_seqlens_from_docs(docs[1:]).tolist() == [0, 32, 38, 39, 64]


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_chained_in_one_process_equal_the_model(pp, one_thread):
    ids, cu = _batch()
    model = make_tiny(seed=7).train()
    ref = copy.deepcopy(model)
    stages = [split_stage(model, r, pp, mtp_weight=W) for r in range(pp)]
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(len(k) for k in keys) == len(model.state_dict())  # disjoint
    assert all(s.training for s in stages)
    for r in (0, 2):  # two micro-batches of packed documents
        row = ids[r:r + 1]
        docs = torch.repeat_interleave(torch.arange(len(ROW_CU[r]) - 1), torch.tensor(ROW_CU[r]).diff())[None]
        x = row
        for s in stages:
            x = s(x, labels=row, docs=docs) if s.is_last else s(x, docs=docs)
        (x / 2).backward()
        (_row_loss(ref, ids, r) / 2).backward()
        lm, mtp = stages[-1].loss_parts[-1]
        assert abs((lm + W * mtp - x).item()) <= 1e-6
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _check_grads(got, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})


def test_split_stage_rejects_bad_ranks():
    model = make_tiny(seed=1)
    with pytest.raises(ValueError, match="pp_rank=2"):
        split_stage(model, 2, 2)
    with pytest.raises(ValueError, match="pp=6"):
        split_stage(model, 0, 6)  # k3-tiny has 5 layers
    with pytest.raises(TypeError, match="K3ForConditionalGeneration"):
        split_stage(model.language_model, 0, 2)
    first, last = split_stage(model, 0, 2), split_stage(model, 1, 2)
    first.state_dtype = torch.bfloat16  # the pipeline would send bf16 buffers: an fp32 state must not go out
    with pytest.raises(ValueError, match="state_dtype=torch.float32"):
        first(torch.randint(0, 4000, (1, 8)))
    with pytest.raises(ValueError, match=r"AttnRes state \[2, b, T, 128\]"):
        last(torch.randn(3, 1, 8, 128), labels=torch.randint(0, 4000, (1, 8)))
    with pytest.raises(ValueError, match="needs labels"):
        last(torch.randn(2, 1, 8, 128))


# ---- 2 processes: pp = 2 --------------------------------------------------------------------------------------

def _pp_worker(rank: int, world: int, out: str) -> None:
    model = make_tiny(seed=7).train()
    stage = split_stage(model, rank, 2)
    del model
    ids, cu = _batch()
    ids, cu = ids[:2], torch.tensor(CU[:4], dtype=torch.int32)  # rows 0 and 1
    pg = dist.new_group([0, 1])
    res = {}
    for kind in ("gpipe", "1f1b"):
        stage.zero_grad(set_to_none=True)
        step = PipelineStep(stage, pg, n_microbatches=2, mtp_weight=W, schedule=kind)
        loss = step(ids, ids, cu)
        res[kind] = dict(loss=loss.clone(), lm=step.lm_loss.clone(), mtp=step.mtp_loss.clone(),
                         grads={n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None})
    res["norm"] = clip_grad_norm_(stage, 1e-3, pg)
    res["clipped"] = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.eval()
    res["eval"] = torch.stack(step.forward_loss(ids, ids, cu))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def test_pp2_step_equals_single_process(tmp_path):
    spawn_gloo(_pp_worker, 2, str(tmp_path), timeout_s=300)
    ref_loss, ref_grads, ref_norm = _reference([0, 1])
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for kind in ("gpipe", "1f1b"):
        for p in parts:  # every pp rank sees the loss
            assert abs(p[kind]["loss"].item() - ref_loss.item()) <= TOL * ref_loss.item(), kind
            assert abs((p[kind]["lm"] + W * p[kind]["mtp"] - p[kind]["loss"]).item()) <= 1e-6
        got = {**parts[0][kind]["grads"], **parts[1][kind]["grads"]}
        _check_grads(got, ref_grads)
    for p in parts:
        assert abs(p["norm"].item() - ref_norm.item()) <= TOL * ref_norm.item()
    coef = 1e-3 / (ref_norm + 1e-6)
    _check_grads({**parts[0]["clipped"], **parts[1]["clipped"]}, {n: g * coef for n, g in ref_grads.items()})
    ids, _ = _batch()
    with torch.no_grad():  # the whole batch (rows 0, 1) in one eval-mode forward
        out = make_tiny(seed=7)(ids[:2], labels=ids[:2], cu_seqlens=torch.tensor(CU[:4], dtype=torch.int32))
    want = torch.stack([out.loss, out.mtp_loss]).float()
    for p in parts:  # every pp rank
        assert torch.allclose(p["eval"], want, rtol=TOL, atol=0), (p["eval"], want)


# ---- 4 processes: pp × dp_shard, pp × ep ----------------------------------------------------------------------



def _composed_worker(rank: int, world: int, out: str, dp_shard: int, ep: int, cp: int) -> None:
    from k3.parallel.cp import enable_context_parallel
    from k3.parallel.fsdp import apply_fsdp
    from k3.parallel.mesh import ParallelDims, build_mesh
    from k3.parallel.moonep import enable_expert_parallel

    model = make_tiny(seed=7).to(CP_DTYPE if cp > 1 else torch.float32).train()
    dims = ParallelDims(pp=2, dp_shard=dp_shard, cp=cp, ep=ep)
    mesh = build_mesh(dims, "cpu", model.config.text_config)
    pp_rank, b = mesh.pp.get_local_rank(), mesh.batch.get_local_rank()
    stage = split_stage(model, pp_rank, 2)
    del model
    if ep > 1:
        enable_expert_parallel(stage, mesh.ep.get_group(), padding=4)
    if cp > 1:
        enable_context_parallel(stage, mesh.cp.get_group())
    apply_fsdp(stage, mesh)
    ids, _ = _batch()
    rows = ids[2 * b:2 * b + 2]  # batch rank b reads rows 2b, 2b + 1: one micro-batch each
    cu = torch.tensor([c - 2 * b * T for c in CU if 2 * b * T <= c <= 2 * (b + 1) * T], dtype=torch.int32)
    pg = mesh.pp.get_group()
    step = PipelineStep(stage, pg, n_microbatches=2, mtp_weight=W)
    loss = step(rows, rows, cu)
    mean = loss.clone()  # cp ranks: shares of their rows' loss; batch ranks: their rows' mean
    dist.all_reduce(mean, group=mesh.fsdp.get_group())
    mean /= dims.batch_parallel
    eg = mesh.ep.get_group()
    norm = clip_grad_norm_(stage, 1.0, pg, eg)  # clips (the norm is ≈ 30): checks the norm and the scaling
    grads = {n: full_grad(p.grad, n, eg) for n, p in stage.named_parameters() if p.grad is not None}
    if mesh.fsdp.get_local_rank() == 0:
        torch.save(dict(loss=mean, grads=grads, norm=norm), os.path.join(out, f"stage{pp_rank}.pt"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("K3_LONG_TESTS") != "1", reason="4-process compositions: set K3_LONG_TESTS=1")
@pytest.mark.parametrize("dp_shard,ep,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_pp2_composed_with_fsdp_moonep_or_cp_equals_single_process(tmp_path, dp_shard, ep, cp):
    spawn_gloo(_composed_worker, 4, str(tmp_path), dp_shard, ep, cp, timeout_s=600)
    ref_loss, ref_grads, ref_norm = (_reference([0, 1, 2, 3]) if cp == 1 else _reference([0, 1], CP_DTYPE))
    parts = [torch.load(tmp_path / f"stage{s}.pt") for s in range(2)]
    for p in parts:
        assert abs(p["loss"].item() - ref_loss.item()) <= TOL * ref_loss.item()
        assert abs(p["norm"].item() - ref_norm.item()) <= TOL * ref_norm.item()
    # FSDP gives unused parameters (layer 0's first AttnRes query) a zero gradient instead of None
    got = {n: g for p in parts for n, g in p["grads"].items() if n in ref_grads or g.abs().max() > 0}
    coef = 1.0 / (ref_norm + 1e-6)
    assert coef < 0.5
    _check_grads(got, {n: g * coef for n, g in ref_grads.items()})
