"""The "varlen" attention backend (`k3.ops.attention.varlen`): its document bounds, the Triton max-logit kernel
against the dense oracle (CPU interpreter in fp32, CUDA in bf16), and PyTorch's FlashAttention path against the
reference (values, gradients, max logit) on CUDA."""
import pytest
import torch

from conftest import rel_rmse
from k3.ops.attention import (doc_causal_attention, doc_max_logit, masked_max_logit, reference_doc_attention,
                              token_docs, varlen_available)
from k3.ops.attention.varlen import doc_bounds, doc_first

CUDA = torch.cuda.is_available()
# one document spans rows 0 and 1 (its cut at the row boundary is not in cu_seqlens); a repeated bound (an empty
# document); short and long documents
CASES = [(3, 40, [0, 7, 7, 55, 80, 101, 120]), (2, 64, None), (1, 50, [0, 1, 2, 50])]


@pytest.mark.parametrize("B,T,cu", CASES)
def test_doc_first_is_each_tokens_document_start(B, T, cu):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    docs = token_docs(cu_t, B, T, "cpu").reshape(-1)
    want = [next(s for s in range(t + 1) if s // T == t // T and docs[s] == docs[t]) for t in range(B * T)]
    bounds = doc_bounds(cu_t, B, T, "cpu")
    assert doc_first(bounds, B * T).tolist() == want
    assert bounds[0] == 0 and bounds[-1] == B * T and bool((bounds[1:] >= bounds[:-1]).all())


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("D", [24, 48, 64])
def test_max_logit_kernel_equals_the_dense_oracle(B, T, cu, D):
    """fp32 inputs (exact products): within 1e-5 of `masked_max_logit` per head, whatever the documents; a shift of
    one allowed key (dropping the diagonal) is caught by the first case."""
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(B * T + D)
    H = 3
    q, k = (torch.randn(B, T, H, D, generator=g).to(dev) for _ in range(2))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    ref = masked_max_logit(q.double(), k.double(), 0.3, token_docs(cu_t, B, T, dev))
    got = doc_max_logit(q, k, 0.3, cu_t, block=16)
    assert got.dtype == torch.float32 and got.shape == (H,)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_head_parts_cover_the_head_dim_in_power_of_two_tiles():
    from k3.ops.attention.varlen import head_parts
    assert [head_parts(d) for d in (192, 128, 24, 48, 64, 8, 200)] == [(128, 64), (128, 0), (16, 16), (32, 16),
                                                                        (64, 0), (16, 0), (128, 128)]


def test_varlen_backend_needs_cuda():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="varlen"):
        doc_causal_attention(q, q, q, 0.3, None, backend="varlen")


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and varlen_available()), reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize("cu", [[0, 100, 300, 333, 512], [0, 70, 70, 300, 512], None])
def test_cuda_varlen_equals_the_reference(cu):
    """bf16, MLA's head dims (d_qk 192 > d_v 128: v padded), packed documents with one spanning the row boundary
    and an empty one: output, max logit and the gradients of q, k, v within bf16 rounding of the dense oracle."""
    g = torch.Generator(device="cuda").manual_seed(len(cu or []))
    B, T, H = 2, 256, 4
    q, k = (torch.randn(B, T, H, 192, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    do = torch.randn(B, T, H, 128, device="cuda", generator=g).bfloat16()
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    outs = []
    for backend in ("varlen", "reference"):
        o, ml = doc_causal_attention(q, k, v, 192 ** -0.5, cu_t, return_max_logit=True, backend=backend)
        grads = torch.autograd.grad(o, (q, k, v), do)
        outs.append((o.float(), ml.float(), [x.float() for x in grads]))
    (o, ml, gr), (ro, rml, rgr) = outs
    assert rel_rmse(o, ro) <= 1e-2 and (ml - rml).abs().max() <= 2e-2 * rml.abs().max()
    for a, b in zip(gr, rgr):
        assert rel_rmse(a, b) <= 2e-2
