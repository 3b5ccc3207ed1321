"""Paged MLA decode attention (`k3.ops.mla_decode`): the Triton kernel (CPU interpreter here, CUDA in the
`cuda` test) against the dense fp64 oracle, on a strided per-layer view of a paged pool with random page tables,
several flash-decoding splits and a history of one row; and the engine with the kernel against the
gathered-history path (k3-tiny, fp32)."""

import pytest
import torch

from conftest import make_tiny
from k3.ops.mla_decode import paged_mla_decode
from k3.ops.mla_decode.triton import LAUNCH, SWEEP_GROUPS

SPLIT = max(c["split"] for c in LAUNCH.values())  # history positions per program: the tests span several splits
from k3.serve import Engine, EngineConfig, SamplingParams


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's device: the GPU, else Triton's interpreter


def on_dev(*ts):
    return [t.to(DEV) for t in ts]


def case(H, C, R, page_size, n_pages, S, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(n_pages, 2, page_size, C + R, generator=g, dtype=torch.float64)  # 2 layers: strided view
    n = 4
    lens = torch.tensor([1, S // 3 + 1, S - 5, S])
    table = torch.randint(0, n_pages - 1, (n, -(-S // page_size)), generator=g)  # the last page: unused
    pages = table[:, torch.arange(S) // page_size]
    q_lat = torch.randn(n, H, C, generator=g, dtype=torch.float64)
    q_pe = torch.randn(n, H, R, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (q_lat, q_pe, pool[:, 1], pages, lens)]


@pytest.mark.parametrize("H,C,R,page_size,S", [(12, 256, 64, 16, 300), (4, 32, 8, 16, 70),
                                                (20, 64, 16, 6144, SPLIT * 2 + 77)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_kernel_equals_the_fp64_oracle(H, C, R, page_size, S, dtype, tol):
    """fp32: ≤ 1e-5 relative RMS (ieee dots); bf16: ≤ 8e-3 (the inputs' own rounding is ~3e-3). Heads past a
    block of 16, padded C / R (32 / 8 → 16-wide tiles) and three KV splits are covered."""
    q_lat, q_pe, kv, pages, lens = case(H, C, R, page_size, 3 if page_size > 1000 else 40, S)
    ref = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.07, backend="reference")
    qd, pd, kd, pages_d, lens_d = on_dev(q_lat.to(dtype), q_pe.to(dtype), kv.to(dtype), pages, lens)
    out = paged_mla_decode(qd, pd, kd, pages_d, lens_d, 0.07, backend="triton")
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel(out.cpu(), ref) <= tol, rel(out.cpu(), ref)
    # head-major views in and out (the model's layout around the kernel): same values, written in place
    hm = qd.transpose(0, 1).contiguous().transpose(0, 1)
    buf = torch.empty(H, q_lat.shape[0], C, dtype=dtype, device=DEV)
    res = paged_mla_decode(hm, pd, kd, pages_d, lens_d, 0.07, backend="triton", out=buf.transpose(0, 1))
    assert res.data_ptr() == buf.data_ptr() and torch.equal(buf.transpose(0, 1), out)
    # the first query sees one row: its output is that row's latent, exactly its softmax weight 1
    row = kv[pages[0, 0], 0, :C]
    torch.testing.assert_close(out[0].cpu().double(), row.expand(H, C).to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("n,NS,H,C", [(3, 3, 12, 256), (2, 8, 5, 40), (4, 5, 12, 512)])
def test_combine_kernel_equals_the_ops(n, NS, H, C, monkeypatch):
    """`mla_combine_kernel` (the interpreter here, CUDA on the GPU) against `combine`'s PyTorch ops on random fp32
    partials, with empty splits (m = -inf, l = 0) among them: within 1e-6, written into a head-major strided
    output. Each row reads only its first ceil(len / split) splits: the later ones hold NaN here (the decode
    kernel leaves them unwritten). Then through `paged_mla_decode` over three splits against the fp64 oracle."""
    from k3.ops.mla_decode import triton as T
    combine = T.combine
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(n * NS)
    split = 64
    part = torch.randn(n, NS, H, C, generator=g)
    m = torch.randn(n, NS, H, generator=g) * 3
    l = torch.rand(n, NS, H, generator=g) + 0.5
    m[:, 1], l[:, 1] = float("-inf"), 0.0  # a split a row's heads have nothing in (masked in every block)
    lens = torch.tensor([NS * split, (NS - 1) * split + 1, split + 7, 0][:n])  # all, all, 2 splits, none
    used = torch.arange(NS)[None, :] < (-(-lens // split))[:, None]  # [n, NS]
    ref = T.combine(part, m.masked_fill(~used[..., None], float("-inf")), l.masked_fill(~used[..., None], 0.0),
                    torch.float32).nan_to_num(0.0)  # the row with no split: zeros (the ops' 0 / 0 is NaN)
    part[~used], m[~used], l[~used] = float("nan"), float("nan"), float("nan")
    out = torch.empty(H, n, C, device=dev).transpose(0, 1)
    bh, bc = T.combine_launch(H, C)
    T.mla_combine_kernel[(n, -(-H // bh), -(-C // bc))](part.to(dev), m.to(dev), l.to(dev), out, lens.to(dev), H, NS,
                                                         out.stride(0), out.stride(1), C=C, SPLIT=split, BH=bh, BC=bc)
    assert torch.isfinite(out).all() and rel(out.cpu(), ref) <= 1e-6
    monkeypatch.setattr(T, "COMBINE_KERNEL", True)
    monkeypatch.setattr(T, "combine", None)  # the PyTorch ops must not run
    q_lat, q_pe, kv, pages, lens = case(4, 32, 8, 6144, 3, SPLIT * 2 + 77, seed=2)
    want = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.07, backend="reference")
    args = [t.float().to(dev) if t.is_floating_point() else t.to(dev) for t in (q_lat, q_pe, kv, pages, lens)]
    assert rel(paged_mla_decode(*args, 0.07, backend="triton").cpu(), want) <= 1e-5
    monkeypatch.setattr(T, "COMBINE_KERNEL", False)  # K3_MLA_COMBINE_KERNEL=0: the PyTorch ops
    monkeypatch.setattr(T, "mla_combine_kernel", None)
    monkeypatch.setattr(T, "combine", combine)
    assert rel(paged_mla_decode(*args, 0.07, backend="triton").cpu(), want) <= 1e-5


def test_rows_past_each_length_do_not_count():
    """Positions past lens[i] point at a poisoned page (1e6 everywhere): the oracle and the kernel ignore them."""
    q_lat, q_pe, kv, pages, lens = case(4, 32, 8, 16, 40, 60, seed=1)
    a = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.1, backend="reference")
    past = torch.arange(pages.shape[1])[None, :] >= lens[:, None]
    pages2 = torch.where(past, 39, pages)
    kv2 = kv.clone()
    kv2[39] = 1e6
    torch.testing.assert_close(paged_mla_decode(q_lat, q_pe, kv2, pages2, lens, 0.1, backend="reference"), a)
    f = torch.float32
    args = on_dev(q_lat.to(f), q_pe.to(f), kv2.to(f), pages2, lens)
    assert rel(paged_mla_decode(*args, 0.1, backend="triton").cpu(), a) < 1e-5


@pytest.mark.parametrize("S,page_size,launch", [(90, 16, None), (SPLIT + 300, 6144, None),
                                                (90, 16, dict(g=8, bh=4, bs=64, split=32, warps=4, stages=None)),
                                                (90, 16, dict(g=16, bh=8, bs=32, split=32, warps=4, stages=None)),
                                                (90, 16, dict(g=4, bh=16, bs=32, split=64, warps=4, stages=None))],
                         ids=["short", "two-splits", "8-rows-4-heads-blocks-wider-than-the-split",
                              "16-rows-blocks-of-128-pairs-across-rows", "4-rows-16-heads-padded"])
def test_token_runs_equal_one_row_each(S, page_size, launch):
    """An extend step's rows (three sequences' tokens, positions ascending, and padding rows of history 1) read
    in runs of up to GROUP_ROWS rows per program (`groups`, as `PackedBatch.for_extend` builds them) equal the
    oracle; rows past each length point at a poisoned page (1e6) so a row reading past its own end would show.
    With two KV splits, a run's shorter rows see splits where they have nothing (no NaN from -inf - -inf)."""
    from k3.model.paged_cache import token_runs

    g = torch.Generator().manual_seed(3)
    H, C, R, n_pages = 12, 64, 16, 30
    pool = torch.randn(n_pages, 2, page_size, C + R, generator=g, dtype=torch.float64)
    pool[n_pages - 1] = 1e6
    kv = pool[:, 1]
    tokens = [(5, S - 5), (1, 7), (6, S // 2 - 3)]  # (tokens, start) per sequence
    cu = torch.tensor([0] + [t for t, _ in tokens]).cumsum(0)
    N = int(cu[-1]) + 3  # three padding rows after them
    lens, tables = [], []
    for t, start in tokens:
        table = torch.randint(0, n_pages - 1, (-(-S // page_size),), generator=g)
        for i in range(t):
            lens.append(start + i + 1)
            tables.append(table)
    lens += [1] * 3
    tables += [torch.zeros(-(-S // page_size), dtype=torch.long)] * 3
    lens = torch.tensor(lens)
    pages = torch.stack(tables)[:, torch.arange(S) // page_size]
    pages = torch.where(torch.arange(S)[None, :] < lens[:, None], pages, n_pages - 1)
    q_lat = torch.randn(N, H, C, generator=g, dtype=torch.float64)
    q_pe = torch.randn(N, H, R, generator=g, dtype=torch.float64)
    ref = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.1, backend="reference")
    runs = token_runs(cu, N, 4)
    # the runs' own page tables are their last rows': same pages within every row's length
    for a, n in runs.tolist():
        if n:
            assert all(torch.equal(pages[r, :lens[r]], pages[a + n - 1, :lens[r]]) for r in range(a, a + n))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: on the GPU, else Triton's interpreter
    args = [t.to(dev, torch.float32) for t in (q_lat, q_pe, kv)] + [pages.to(dev), lens.to(dev)]
    if launch is None:
        out = paged_mla_decode(*args, 0.1, backend="triton", groups=runs.to(dev))
    else:  # a sweep setting: runs of its own row count, its launch through the kernel's entry point
        from k3.ops.mla_decode.triton import paged_mla_decode_triton
        g = launch["g"]
        out = paged_mla_decode_triton(*args, 0.1, groups=token_runs(cu, N, g).to(dev), group_rows=g,
                                      launch={k: v for k, v in launch.items() if k != "g"})
    out = out.cpu()
    assert torch.isfinite(out).all() and rel(out, ref) <= 1e-5, rel(out, ref)


@pytest.mark.parametrize("grouped", [False, True], ids=["row-by-row", "token-runs"])
@pytest.mark.parametrize("S, page_size", [(40, 8), (300, 64), (100, 128)])
def test_page_table_form_equals_the_positions_form(S, page_size, grouped):
    """`table_history`: each row's page table [n, P] (the kernel finds position p's page at column p // page_size)
    instead of the page of every position [n, S] gives the same result: the reference exactly, the kernel (row by
    row, or in token runs) against the fp64 oracle of the per-position form. Table columns past each sequence's
    last position point at a poisoned page (1e6)."""
    from k3.model.paged_cache import token_runs

    g = torch.Generator().manual_seed(S + page_size)
    H, C, R, n_pages = 4, 32, 16, 40
    kv = torch.randn(n_pages, page_size, C + R, generator=g, dtype=torch.float64)
    kv[n_pages - 1] = 1e6
    P = -(-S // page_size)
    seqs = [(5, S - 5), (1, 7), (6, S // 2 - 3)]  # (tokens, start): an extend step's rows, positions ascending
    cu = torch.tensor([0] + [t for t, _ in seqs]).cumsum(0)
    lens, tables = [], []
    for t, start in seqs:
        table = torch.randint(0, n_pages - 1, (P,), generator=g)
        table[-(-(start + t) // page_size):] = n_pages - 1  # columns past the sequence: poisoned
        lens += [start + i + 1 for i in range(t)]
        tables += [table] * t
    lens, table = torch.tensor(lens), torch.stack(tables)
    pages = torch.where(torch.arange(S)[None, :] < lens[:, None], table[:, torch.arange(S) // page_size], 0)
    N = len(lens)
    q_lat = torch.randn(N, H, C, generator=g, dtype=torch.float64)
    q_pe = torch.randn(N, H, R, generator=g, dtype=torch.float64)
    ref = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.1, backend="reference")
    assert torch.equal(paged_mla_decode(q_lat, q_pe, kv, table, lens, 0.1, backend="reference", table_history=S), ref)
    args = [t.to(DEV, torch.float32) for t in (q_lat, q_pe, kv)]
    groups = token_runs(cu, N, 4).to(DEV) if grouped else None
    out = paged_mla_decode(*args, table.to(DEV), lens.to(DEV), 0.1, backend="triton", groups=groups,
                           table_history=S).cpu()
    assert torch.isfinite(out).all() and rel(out, ref) <= 1e-5, rel(out, ref)
    with pytest.raises(ValueError, match="table_history"):
        paged_mla_decode(q_lat, q_pe, kv, table[:, :P - 1], lens, 0.1, backend="reference", table_history=S)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", SWEEP_GROUPS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_cuda_token_runs_every_sweep_setting(launch):
    """Every launch setting the token-run sweep may pick gives the oracle's result (fp32, 1e-5), over several
    splits of its own size."""
    test_token_runs_equal_one_row_each(2 * launch["split"] + 300, 6144, launch)


def test_bad_inputs_are_named():
    q_lat, q_pe, kv, pages, lens = case(4, 32, 8, 16, 40, 60)
    with pytest.raises(ValueError, match="backend"):
        paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.1, backend="fast")
    with pytest.raises(ValueError, match="kv must be"):
        paged_mla_decode(q_lat, q_pe, kv[..., :-1], pages, lens, 0.1)
    with pytest.raises(ValueError, match="pages must be"):
        paged_mla_decode(q_lat, q_pe, kv, pages.float(), lens, 0.1)
    with pytest.raises(ValueError, match="q_lat"):
        paged_mla_decode(q_lat[0], q_pe, kv, pages, lens, 0.1)


def test_engine_with_the_kernel_equals_the_gathered_path():
    """The engine's decodes through the paged kernel (interpreter) give the gathered path's tokens and logits
    (fp32, 1e-4), over several pages per sequence."""
    model = make_tiny(seed=4).to(DEV)  # the kernel's device (a CPU model only through the interpreter)
    prompts = [[(7 * i + 3 * j) % 4000 for j in range(5 + 9 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=12, temperature=0)
    runs = {}
    for backend in ("gather", "triton"):
        for m in model.modules():
            if type(m).__name__ == "MLAttention":
                m.decode_backend = backend
        eng = Engine(model, EngineConfig(block_size=8, hash_block_size=4, num_pages=64, record_logits=True))
        outs = eng.generate(prompts, sp)
        runs[backend] = (outs, eng.recorded_logits)
    for m in model.modules():
        if type(m).__name__ == "MLAttention":
            m.decode_backend = "auto"
    (a, la), (b, lb) = runs["gather"], runs["triton"]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        d = (torch.stack(la[x.request_id]) - torch.stack(lb[y.request_id])).abs().max()
        assert d <= 1e-4, d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["copy", "norm"])
def test_latent_write_kernel_equals_the_plain_ops(dtype, with_norm):
    """`write_latents` (the Triton kernel; the interpreter here, CUDA there) against the plain ops (RMSNorm,
    cat, index_put) on a strided per-layer view of a pool, c and k_pe row slices of one projection: the copy
    bitwise; with the norm within 1e-6 in fp32 (its sums in another order) and one rounding in bf16; every
    other row untouched; bad shapes are named."""
    from k3.ops.mla_decode import write_latents
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    C, R, N = 40, 8, 5
    pool = torch.randn(6, 2, 4, C + R, generator=g).to(dtype).to(dev)
    proj = (torch.randn(N, C + R + 3, generator=g) * 2).to(dtype).to(dev)
    c, k_pe = proj[:, :C], proj[:, C:C + R]
    pages = torch.tensor([5, 0, 2, 2, 3], device=dev)
    offs = torch.tensor([1, 3, 0, 2, 3], device=dev)
    norm = ((torch.rand(C, generator=g) + 0.5).to(dtype).to(dev), 1e-6) if with_norm else None
    a, b = pool.clone(), pool.clone()
    write_latents(a[:, 1], pages, offs, c, k_pe, norm, backend="triton")
    write_latents(b[:, 1], pages, offs, c, k_pe, norm, backend="reference")
    if not with_norm:
        assert torch.equal(a, b)
    else:  # fp32: the norm's sums in another order (1e-6); bf16: one rounding of the normalised value
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    keep = torch.ones(6, 4, dtype=torch.bool, device=dev)
    keep[pages, offs] = False
    assert torch.equal(a[:, 0], pool[:, 0]) and torch.equal(a[:, 1][keep], pool[:, 1][keep])
    assert not torch.equal(a, pool)
    with pytest.raises(ValueError, match="write_latents"):
        write_latents(a[:, 1], pages, offs, c, k_pe[:, :-1], norm)


def test_engine_with_the_fused_latent_write_equals_the_plain_write(monkeypatch):
    """K3_MLA_FUSED_WRITE: the engine's MLA layers write the latent norm and rows in one kernel (forced through
    the interpreter here); fp32 greedy tokens and logits (1e-5) equal the plain path's."""
    import k3.ops.mla_decode as mla_ops
    model = make_tiny(seed=4).to(DEV)  # the kernel's device (a CPU model only through the interpreter)
    prompts = [[(5 * i + 2 * j) % 4000 for j in range(6 + 7 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0)
    cfg = EngineConfig(block_size=8, hash_block_size=4, num_pages=64, record_logits=True)
    monkeypatch.setattr(mla_ops, "FUSED_WRITE", False)
    eng = Engine(model, cfg)
    ref = eng.generate(prompts, sp)
    seen = []
    real = mla_ops.write_latents

    def spy(*a, **k):
        seen.append(a[-1] is not None)
        return real(*a, **{**k, "backend": "triton"})

    monkeypatch.setattr(mla_ops, "FUSED_WRITE", True)
    monkeypatch.setattr("k3.model.paged_cache.write_latents", spy)
    fused = Engine(model, cfg)
    out = fused.generate(prompts, sp)
    assert seen and all(seen)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for x, y in zip(ref, out):
        assert (torch.stack(eng.recorded_logits[x.request_id]) -
                torch.stack(fused.recorded_logits[y.request_id])).abs().max() <= 1e-5


def test_latent_blocks_fit_shared_memory():
    """The positions per block shrink for wide latents and fp32 pools (a launch that asks for more shared memory
    than the GPU has fails): k3-small's bf16 pool keeps LAUNCH's 128; its fp32 pool and K3's 512-wide latent
    get 64; the budget holds for every case, and never below 16 positions."""
    from k3.ops.mla_decode.triton import LAUNCH, SMEM_BUDGET, block_positions
    bs, st = LAUNCH["decode"]["bs"], LAUNCH["decode"]["stages"]
    assert block_positions(bs, st, 256, 64, 2) == 128
    assert block_positions(bs, st, 256, 64, 4) == 64
    assert block_positions(bs, st, 512, 64, 2) == 64 and block_positions(bs, st, 512, 64, 4) == 32
    assert block_positions(bs, None, 256, 64, 2) == 64  # Triton's default: 3 stages
    for cp, rp, item in ((256, 64, 2), (256, 64, 4), (512, 64, 2), (512, 64, 4), (32, 16, 4)):
        b = block_positions(bs, st, cp, rp, item)
        assert 16 <= b <= bs and st * b * (cp + rp) * item <= SMEM_BUDGET
    assert block_positions(128, 2, 1 << 16, 64, 4) == 16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_cuda_kernel_equals_the_fp64_oracle(dtype, tol):
    for H, C, R, ps, S in [(12, 256, 64, 6144, 300), (64, 512, 64, 64, SPLIT * 3 + 5), (4, 32, 8, 16, 70)]:
        q_lat, q_pe, kv, pages, lens = case(H, C, R, ps, 3 if ps > 1000 else 80, S, device="cuda")
        ref = paged_mla_decode(q_lat, q_pe, kv, pages, lens, 0.07, backend="reference")
        out = paged_mla_decode(q_lat.to(dtype), q_pe.to(dtype), kv.to(dtype), pages, lens, 0.07)
        assert rel(out, ref) <= tol, (H, C, R, S, rel(out, ref))
