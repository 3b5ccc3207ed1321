"""The greedy pick's Triton kernels (`k3.ops.greedy_triton`) against `k3.ops.sampling.greedy_pick`'s PyTorch ops
and fp64 (no server dependencies, so the GPU runs can take this file alone)."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_kernels_equal_the_torch_ops(dtype):
    """The greedy pick's Triton kernels (interpreter here; small splits so that a row spans several programs
    and blocks, V not a multiple of either) against `greedy_pick`'s PyTorch ops: the same ids (a tie across
    two splits and one inside a block: the first column wins, as torch.argmax), log p within 1e-5 of fp64; rows with a
    NaN, a +inf or only -inf give -1 and NaN; a row with -inf entries (masked tokens) is valid."""
    pytest.importorskip("triton")
    from k3.ops.greedy_triton import greedy_pick_triton
    from k3.ops.sampling import greedy_pick
    x = (torch.randn(8, 300, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    x[0, 250] = x[0, 37] = x[0].max() + 1   # tie across splits (split 64): column 37 wins
    x[1, 5] = x[1, 9] = x[1].max() + 1      # tie inside one block
    x[2, 7] = float("nan")
    x[3, 299] = float("inf")
    x[4] = float("-inf")
    x[5, :290] = float("-inf")               # masked vocabulary: the last 10 columns
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref_tok, ref_lp = greedy_pick(x, backend="torch")
    tok, lp = greedy_pick_triton(x.to(dev), split=64, block=16)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert tok.cpu().tolist() == ref_tok.tolist() and tok[0] == 37 and tok[1] == 5
    assert tok[2:5].tolist() == [-1, -1, -1] and lp[2:5].isnan().all() and tok[5] >= 290
    ok = ref_tok >= 0
    x64 = x.double()[ok]
    exact = x64.gather(-1, ref_tok[ok, None])[:, 0] - torch.logsumexp(x64, -1)  # log p in fp64 of the inputs
    assert (lp.cpu()[ok] - exact).abs().max() <= 1e-5
    if dtype == torch.float32:  # the torch ops in fp32 (bf16 logits would round their log p to bf16)
        assert (ref_lp[ok] - exact).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="powers of two"):
        greedy_pick_triton(x, split=64, block=128)



def test_greedy_pick_writes_the_engine_rows_and_ids():
    """`rows` / `last` (the engine's read-back rows and the next forward's device-fed ids): the kernels' second
    kernel writes what `write_outputs` writes after the torch ops, bitwise, a failed row as (-1, NaN) and id 0;
    `last` past n untouched; wrong shapes or dtypes refused, naming them."""
    pytest.importorskip("triton")
    from k3.ops.greedy_triton import greedy_pick_triton
    from k3.ops.sampling import greedy_pick
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(6)).to(dev) * 3
    x[2, 3] = float("nan")
    outs = []
    for pick in (lambda **kw: greedy_pick(x, backend="torch", **kw),
                 lambda **kw: greedy_pick_triton(x, split=64, block=16, **kw)):
        rows = torch.full((2, 5), 7.0, dtype=torch.float64, device=dev)
        last = torch.full((8,), 99, dtype=torch.int64, device=dev)
        tok, lp = pick(rows=rows, last=last)
        assert torch.equal(rows[0], tok.double()) and torch.equal(rows[1].isnan(), lp.isnan())
        assert last[:5].tolist() == tok.clamp_min(0).tolist() and last[5:].tolist() == [99] * 3
        outs.append((tok, rows, last))
    (t0, r0, l0), (t1, r1, l1) = outs
    assert t0.tolist() == t1.tolist() and t0[2] == -1 and l1[2] == 0
    assert (r0[1] - r1[1]).nan_to_num().abs().max() <= 1e-5 and torch.equal(r0[0], r1[0])
    with pytest.raises(ValueError, match="rows must be a contiguous float64 \\[2, 5\\]"):
        greedy_pick(x, backend="torch", rows=torch.zeros(2, 5, device=dev))
    with pytest.raises(ValueError, match="last must be a contiguous int64 vector of at least 5"):
        greedy_pick_triton(x, rows=None, last=torch.zeros(4, dtype=torch.int64, device=dev))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_pick_kernels_at_k3_vocabulary():
    """K3's 163,840-wide fp32 logits for 1 and 256 rows on the GPU (the kernels' default splits): the torch
    ops' ids, log p within 1e-5."""
    from k3.ops.greedy_triton import greedy_pick_triton
    from k3.ops.sampling import greedy_pick
    for n in (1, 256):
        x = torch.randn(n, 163840, device="cuda", generator=torch.Generator("cuda").manual_seed(n)) * 4
        ref_tok, ref_lp = greedy_pick(x, backend="torch")
        tok, lp = greedy_pick_triton(x)
        assert torch.equal(tok, ref_tok) and (lp - ref_lp).abs().max() <= 1e-5


def test_engine_with_the_greedy_kernels_equals_the_torch_ops(monkeypatch):
    """The engine's greedy pick through the Triton kernels (forced; the interpreter on the CPU) against the
    PyTorch ops: the same fp32 greedy tokens and log-probs (1e-5) for a mixed batch."""
    import k3.serve.sampling as serve_sampling
    from k3.ops.sampling import greedy_pick
    from k3.serve import Engine, EngineConfig, SamplingParams
    from conftest import make_tiny
    model = make_tiny(seed=5).to("cuda" if torch.cuda.is_available() else "cpu")  # the kernels take device rows
    prompts = [[(3 * i + 5 * j) % 4000 for j in range(5 + 6 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    cfg = EngineConfig(block_size=8, hash_block_size=4, num_pages=64)
    monkeypatch.setattr(serve_sampling, "greedy_pick", lambda x, **kw: greedy_pick(x, backend="torch", **kw))
    ref = Engine(model, cfg).generate(prompts, sp)
    calls = []

    def kernels(x, **kw):
        calls.append(x.shape[0])
        return greedy_pick(x, backend="triton", **kw)

    monkeypatch.setattr(serve_sampling, "greedy_pick", kernels)
    out = Engine(model, cfg).generate(prompts, sp)
    assert calls and [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(ref, out):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
