"""Context parallelism of the whole model (`k3.parallel.cp`: KDA CP + MLA CP, zigzag layout) on CPU gloo, k3-tiny in
fp64 (see DTYPE), against one process on the same whole batch:
- targets / num_targets (the per-position loss form CP uses) give the labels path's losses and gradients;
- 2 processes, cp = 2: the sum of the ranks' `loss` and `mtp_loss` and the summed gradients of every parameter
  equal the single-process step (rel_rmse <= 1e-5), and each MLA layer's recorded QK-clip max logit equals the
  single-process one, for plain rows, for packed documents (boundaries inside, at and across segments, a
  document spanning three segments, 1-token documents), and for packed documents through the dense reference
  attention, the separate KDA transition pass and the plain (logits) loss;
- 4 processes (K3_LONG_TESTS=1): dp_shard 2 × cp 2 with FSDP2, and ep 2 × cp 2 with MoonEP + FSDP2, equal the
  single-process step over the same two sequences."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from conftest import full_grad, make_tiny, rel_rmse
from k3.parallel._launch import spawn_gloo

TOL = 1e-5
# fp64: a different chunk grid (KDA pieces start at segment boundaries) changes the fp32 rounding of the KDA gate
# gradients by up to ~2e-5 relative (the fp32 single-process step itself is ~1e-4 from fp64), so the exactness
# check runs in fp64 (the router stays fp32 inside: observed errors ~1e-7)
DTYPE = torch.float64
T = 32  # 2·cp segments of 8 tokens (cp = 2): >= the conv halo (3) and the MTP shift (1)
MTP_W = 0.3
ROW_CU = [0, 5, 8, 21, 30, 32, 33, 34, 47, 64]  # B = 2 rows of 32; segments of 8: 0-8-16-24-32 | 32-40-48-56-64
# name, B, cu_seqlens, MLA attn_backend, KDA transition, loss_impl
CASES = [
    ("rows", 2, None, "auto", "auto", "fused"),
    ("packed", 2, ROW_CU, "auto", "auto", "fused"),
    ("packed_reference_separate_plain", 2, ROW_CU, "reference", "separate", "plain"),
]


def _batch(i, B, cu, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 17 + i)
    ids = torch.randint(0, 4000, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100  # an ignored label inside a segment
    out = {"input_ids": ids, "labels": labels}
    if cu is not None:
        out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return out


def _setup(model, attn_backend="auto", loss_impl="fused", dtype=DTYPE):
    from k3.model.mla import MLAttention
    model.to(dtype).train()
    model.language_model.loss_impl = loss_impl
    for m in model.modules():
        if isinstance(m, MLAttention):
            m.record_max_logit = True
            m.attn_backend = attn_backend
    return model


def _max_logits(model):
    from k3.model.mla import MLAttention
    return {n: m.max_logit.clone() for n, m in model.named_modules() if isinstance(m, MLAttention)}


def _reference(batches, attn_backend="auto", loss_impl="fused", dtype=DTYPE):
    """One process: mean over `batches` of loss + MTP_W·mtp_loss, grads, per-layer max logits (last batch)."""
    model = _setup(make_tiny(seed=7), attn_backend, loss_impl, dtype)
    losses, mtps = [], []
    for b in batches:
        out = model(**b)
        losses.append(out.loss)
        mtps.append(out.mtp_loss)
    loss, mtp = torch.stack(losses).mean(), torch.stack(mtps).mean()
    (loss + MTP_W * mtp).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), mtp.detach(), grads, _max_logits(model)


def _check(got_loss, got_mtp, got_grads, got_mx, ref, where):
    loss, mtp, grads, mx = ref
    assert abs(got_loss - loss.item()) <= TOL * abs(loss.item()), (where, got_loss, loss.item())
    assert abs(got_mtp - mtp.item()) <= TOL * abs(mtp.item()), (where, got_mtp, mtp.item())
    assert set(got_grads) == set(grads), (where, set(grads) ^ set(got_grads))
    for n, g in grads.items():
        err = rel_rmse(g, got_grads[n])
        assert err <= TOL, (where, n, err)
    if got_mx is not None:
        for n, m in mx.items():
            assert rel_rmse(m, got_mx[n]) <= TOL, (where, n, m, got_mx[n])


def test_targets_form_equals_labels():
    """The per-position loss form (targets from `shard_batch` at cp = 1) equals the labels path, fused and plain,
    with and without packed documents: losses and gradients."""
    from k3.parallel.cp import shard_batch
    for loss_impl in ("fused", "plain"):
        for cu in (None, ROW_CU):
            batch = _batch(0, 2, cu)
            ref = _reference([batch], loss_impl=loss_impl, dtype=torch.float32)
            model = _setup(make_tiny(seed=7), loss_impl=loss_impl, dtype=torch.float32)
            out = model(**shard_batch(batch, 0, 1, num_mtp=1))
            (out.loss + MTP_W * out.mtp_loss).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            _check(out.loss.item(), out.mtp_loss.item(), grads, None, ref, (loss_impl, cu))


def test_shard_batch_layout_and_targets():
    """Zigzag layout (rank r: segments r and 2P-1-r), targets from the whole sequence (the last token of a
    segment gets the first of the next), document and row ends masked, counts of the whole batch."""
    from k3.parallel.cp import shard_batch
    ids = torch.arange(16).view(1, 16) + 100
    parts = [shard_batch({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 6, 16])}, r, 2, num_mtp=1)
             for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[100, 101, 102, 103, 112, 113, 114, 115]]
    assert parts[1]["input_ids"].tolist() == [[104, 105, 106, 107, 108, 109, 110, 111]]
    assert parts[0]["targets"][0].tolist() == [[101, 102, 103, 104, 113, 114, 115, -100]]
    assert parts[1]["targets"][0].tolist() == [[105, -100, 107, 108, 109, 110, 111, 112]]
    assert parts[1]["targets"][1].tolist() == [[-100, -100, 108, 109, 110, 111, 112, 113]]
    assert parts[0]["num_targets"].tolist() == [14, 12]
    with pytest.raises(ValueError, match="divisible by 2·cp=4"):
        shard_batch({"input_ids": torch.zeros(1, 18, dtype=torch.long)}, 0, 2)
    with pytest.raises(ValueError, match="row boundary"):
        shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5, 16])}, 0, 2)


def _cp_worker(rank, world, outdir):
    from k3.parallel.cp import enable_context_parallel, shard_batch
    res = {}
    for i, (name, B, cu, attn, transition, loss_impl) in enumerate(CASES):
        model = _setup(make_tiny(seed=7), attn, loss_impl)
        enable_context_parallel(model, None, transition=transition)
        out = model(**shard_batch(_batch(i, B, cu), rank, world, num_mtp=1))
        (out.loss + MTP_W * out.mtp_loss).backward()
        lm = torch.stack([out.loss.detach(), out.mtp_loss.detach()])
        dist.all_reduce(lm)
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                grads[n] = p.grad
        res[name] = (lm[0].item(), lm[1].item(), grads, _max_logits(model))
    if rank == 0:
        torch.save(res, os.path.join(outdir, "cp.pt"))


def test_cp2_step_equals_single_process(tmp_path):
    spawn_gloo(_cp_worker, 2, str(tmp_path), timeout_s=300)
    res = torch.load(tmp_path / "cp.pt")
    for i, (name, B, cu, attn, transition, loss_impl) in enumerate(CASES):
        ref = _reference([_batch(i, B, cu)], attn, loss_impl)
        _check(*res[name], ref, name)


# ------------------------------------------------------------------------------------- 4 processes




def _composed_worker(rank, world, outdir, dp_shard, ep):
    from k3.parallel.cp import enable_context_parallel, shard_batch
    from k3.parallel.fsdp import apply_fsdp
    from k3.parallel.mesh import ParallelDims, build_mesh
    from k3.parallel.moonep import enable_expert_parallel

    model = _setup(make_tiny(seed=7))
    mesh = build_mesh(ParallelDims(dp_shard=dp_shard, cp=2, ep=ep), "cpu", model.config.text_config, seq_len=T)
    if ep > 1:
        enable_expert_parallel(model, mesh.ep.get_group(), padding=4)
    enable_context_parallel(model, mesh.cp.get_group())
    apply_fsdp(model, mesh)
    c = mesh.dims.coordinate(rank)
    seq = c["dp_shard"] * ep + c["ep"]  # the batch index of this (dp_shard, ep) pair
    b = _batch(seq, 1, ROW_CU[:6])
    out = model(**shard_batch(b, c["cp"], 2, num_mtp=1))
    (out.loss + MTP_W * out.mtp_loss).backward()
    lm = torch.stack([out.loss.detach(), out.mtp_loss.detach()])
    dist.all_reduce(lm)
    lm /= mesh.dims.batch_parallel
    eg = mesh.ep.get_group()
    grads = {n: full_grad(p.grad, n, eg) for n, p in model.named_parameters() if p.grad is not None}
    grads = {n: g for n, g in grads.items() if g.abs().max() > 0 or "self_attention_res_proj" not in n}
    if rank == 0:
        torch.save((lm[0].item(), lm[1].item(), grads, _max_logits(model)), os.path.join(outdir, "cp.pt"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("K3_LONG_TESTS") != "1", reason="4-process compositions: set K3_LONG_TESTS=1")
@pytest.mark.parametrize("dp_shard,ep", [(2, 1), (1, 2)])
def test_cp_composed_with_fsdp_and_moonep_four_processes(tmp_path, dp_shard, ep):
    spawn_gloo(_composed_worker, 4, str(tmp_path), dp_shard, ep, timeout_s=600)
    loss, mtp, grads, _ = torch.load(tmp_path / "cp.pt")
    ref = _reference([_batch(s, 1, ROW_CU[:6]) for s in range(2)])
    ref_grads = {n: g for n, g in ref[2].items() if g.abs().max() > 0 or "self_attention_res_proj" not in n}
    _check(loss, mtp, grads, None, (ref[0], ref[1], ref_grads, None), (dp_shard, ep))
