"""Packed documents (`cu_seqlens`): a packed batch behaves exactly like each document run alone."""

import pytest
import torch

from conftest import make_tiny, rel_rmse
from k3.model.k3 import lm_loss

# the Triton KDA path's tests: compiled on a GPU, interpreted on a CPU-only host (conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CU = [0, 5, 17, 24, 30, 31, 48]  # B=2, T=24: row boundary at 24; a 1-token and a 5-token document
# A .double() model still runs KDA's gates, beta and output norm in fp32 (by design), so packed vs alone agree to
# fp32 rounding, not fp64's: observed rel-RMSE ≈ 0.6 fp32 eps (7.4e-8) at 1 and 2 threads; the bar is 8 eps.
FP32_TOL = 8 * torch.finfo(torch.float32).eps


def _docs(ids):
    flat = ids.flatten()
    return [flat[a:b] for a, b in zip(CU[:-1], CU[1:])]


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_packed_forward_and_losses_equal_documents_alone(seed):
    model = make_tiny(seed=seed).double()
    g = torch.Generator().manual_seed(8 + seed)
    ids = torch.randint(0, 4000, (2, 24), generator=g)
    cu = torch.tensor(CU, dtype=torch.int32)
    out = model(ids, labels=ids, cu_seqlens=cu)
    logits = out.logits.reshape(48, -1)
    nll, mtp_nll, n, n_mtp = 0.0, 0.0, 0, 0
    lm = model.language_model
    for (a, b), doc in zip(zip(CU[:-1], CU[1:]), _docs(ids)):
        alone = model(doc[None], labels=doc[None])
        assert rel_rmse(alone.logits[0], logits[a:b]) < FP32_TOL
        L = b - a
        if L > 1:
            nll += alone.loss.item() * (L - 1)
            n += L - 1
        if L > 2:  # MTP layer 1 predicts t + 2
            mtp_nll += lm_loss(lm(doc[None], labels=doc[None]).mtp_logits, doc[None], shift=2).item() * (L - 2)
            n_mtp += L - 2
    assert abs(out.loss.item() - nll / n) < 1e-5  # the loss is computed in fp32
    assert abs(out.mtp_loss.item() - mtp_nll / n_mtp) < 1e-5


def test_packed_gradients_equal_sum_over_documents():
    model = make_tiny(seed=4).double().train()
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 4000, (2, 24), generator=g)
    cu = torch.tensor(CU, dtype=torch.int32)
    docs = _docs(ids)
    counts = [len(d) - 1 for d in docs]
    model(ids, labels=ids, cu_seqlens=cu).loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for d, c in zip(docs, counts):
        if c > 0:
            (model(d[None], labels=d[None]).loss * c / sum(counts)).backward()
    for n, p in model.named_parameters():
        if n in packed and "mtp" not in n and p.grad is not None and p.grad.abs().sum() > 0:
            assert rel_rmse(p.grad, packed[n]) < 1e-5, n  # fp32 loss


def test_bad_cu_seqlens_named():
    model = make_tiny()
    ids = torch.randint(0, 4000, (2, 8))
    with pytest.raises(ValueError, match="end at the token count 16"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, cu_seqlens=torch.tensor([0, 9, 4, 16], dtype=torch.int32))


class _Reads(torch.overrides.TorchFunctionMode):
    """Counts the host reads (tolist / item / int / bool) of one tensor."""

    def __init__(self, t):
        super().__init__()
        self.t, self.n = t, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__bool__", "__index__") and args \
                and args[0] is self.t:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_cu_seqlens_is_read_once_per_batch_not_per_layer():
    """The entry check and every KDA layer's chunk tables (Triton path, interpreted here) share one read of the
    batch's cu_seqlens: on a GPU each read drains the queue mid-forward (12 KDA layers in k3-small). An in-place
    write to the tensor is seen (its version counter moves); with K3_CU_MEMO=0 each consumer reads again; a tensor
    moved by `bounds_to` (the trainer's batches) is not read at all."""
    from k3.ops import varlen
    model = make_tiny(seed=1).to(DEV)
    kda = [m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention"]
    assert len(kda) >= 2
    for m in kda:
        m.backend = "triton"
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEV)
    cu = torch.tensor(CU, dtype=torch.int32, device=DEV)
    with _Reads(cu) as r:
        model(ids, labels=ids, cu_seqlens=cu)
    assert r.n == 1
    cu[1:-1].copy_(torch.tensor(CU[1:-1][::-1], dtype=torch.int32))  # a bad layout written in place
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, labels=ids, cu_seqlens=cu)
    cu.copy_(torch.tensor(CU, dtype=torch.int32))
    old, varlen.MEMO = varlen.MEMO, False
    try:
        with _Reads(cu) as r:
            model(ids, labels=ids, cu_seqlens=cu)
    finally:
        varlen.MEMO = old
    assert r.n > len(kda)  # the entry check and each KDA layer (and any attention path) read it themselves
    moved = varlen.bounds_to(cu.cpu(), DEV)  # what `k3 train` does with a host batch: values kept, no read at all
    with _Reads(moved) as r:
        model(ids, labels=ids, cu_seqlens=moved)
    assert r.n == 0


def test_cu_seqlens_written_behind_torchs_back_is_read_again():
    """A write the version counter does not see (here through a DLPack alias, which has its own counter; in
    practice a kernel's or a NumPy view's) between two forwards must not leave the KDA layers with the old layout:
    the values are kept for one forward only."""
    model = make_tiny(seed=2).to(DEV)
    for m in model.modules():
        if type(m).__name__ == "KimiDeltaAttention":
            m.backend = "triton"
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(3)).to(DEV)
    cu = torch.tensor(CU, dtype=torch.int32, device=DEV)
    model(ids, labels=ids, cu_seqlens=cu)
    other = [0, 9, 12, 24, 40, 44, 48]
    v = cu._version
    torch.from_dlpack(cu).copy_(torch.tensor(other, dtype=torch.int32))
    assert cu._version == v and cu.tolist() == other  # written, unseen by cu's version counter
    got = model(ids, labels=ids, cu_seqlens=cu).logits
    want = model(ids, labels=ids, cu_seqlens=torch.tensor(other, dtype=torch.int32, device=DEV)).logits
    assert torch.equal(got, want)


def test_mla_records_max_logit_per_head():
    model = make_tiny(seed=5).double()
    mla = next(m for m in model.modules() if type(m).__name__ == "MLAttention")
    mla.record_max_logit = True
    mla.train()  # recorded in training forwards only
    x = torch.randn(2, 9, model.config.text_config.hidden_size, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding: padded keys excluded
    mla(x, attention_mask=mask)
    q = mla.project_q(x)
    c, k_pe = mla.project_latent(x)
    kv = mla.kv_b_proj(c).view(2, 9, mla.num_heads, -1)[..., :mla.nope]
    k = torch.cat([kv, k_pe.unsqueeze(2).expand(-1, -1, mla.num_heads, -1)], -1)
    s = torch.einsum("bthd,bshd->bhts", q, k) * mla.scale
    allowed = torch.ones(9, 9).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    ref = s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(mla.max_logit.double(), ref, rtol=1e-6, atol=1e-6)
