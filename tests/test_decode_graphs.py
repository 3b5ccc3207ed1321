"""The engine's decode step as captured in CUDA graphs: the in-place pool ops (`short_conv_step`,
`kda_decode_step_gated` on a strided per-layer view), the device-side decode metadata
(`PackedBatch.for_decode`) against the host builder, a batch padded with scratch entries against the unpadded
one, and (CUDA) graph replay against eager execution."""

import functools
import random

import pytest
import torch

from conftest import make_tiny, rel_rmse
from k3.model.paged_cache import PackedBatch, PagedCache
from k3.ops.conv import short_conv, short_conv_step
from k3.ops.kda import chunk_kda_gated, kda_decode_step_gated

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_short_conv_step_equals_short_conv_with_state(dtype, tol):
    g = torch.Generator().manual_seed(0)
    P, C, W, N = 9, 24, 4, 4
    pool = torch.randn(P, 2, C, W - 1, generator=g, dtype=dtype)  # two "layers": the step sees a strided view
    before = pool.clone()
    w = torch.randn(C, 1, W, generator=g, dtype=dtype)
    x = torch.randn(N, C, generator=g, dtype=dtype)
    slots = torch.tensor([7, 2, 5, 0])
    y = short_conv_step(x, w, pool[:, 1], slots)
    ref, new = short_conv(x[:, None], w, before[slots, 1], output_final_state=True, backend="reference")
    assert (y - ref[:, 0]).abs().max() <= tol
    assert torch.equal(pool[slots, 1], new)  # windows advanced in place
    others = [p for p in range(P) if p not in slots.tolist()]
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, 0], before[:, 0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_short_conv_step_triton_equals_the_reference(dtype, tol):
    """The one-kernel form (Triton's interpreter on CPU) against the PyTorch ops: outputs, and windows that
    advance in place at the given slots only; x a strided row slice as the KDA layer passes it."""
    if not torch.cuda.is_available():
        from k3.ops.conv import triton_available
        from k3.ops.moe_triton import interpreted
        if not (triton_available() and interpreted()):
            pytest.skip("needs CUDA or Triton's interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    P, C, W, N = 6, 200, 4, 3
    pool = torch.randn(P, 2, C, W - 1, generator=g).to(dev, dtype)
    ref_pool = pool.clone()
    w = torch.randn(C, 1, W, generator=g).to(dev)
    x = torch.randn(N, 3 * C, generator=g).to(dev, dtype)[:, C:2 * C]
    slots = torch.tensor([5, 1, 2], device=dev)
    y = short_conv_step(x, w, pool[:, 1], slots, backend="triton")
    ref = short_conv_step(x, w, ref_pool[:, 1], slots, backend="reference")
    assert rel_rmse(ref, y) <= tol  # fp32 sums in another order; bf16: one output rounding (2^-8 relative)
    assert torch.equal(pool, ref_pool)  # the window shift copies values: exact


def _gated_inputs(N, H, K, dtype, g, device="cpu"):
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(device)  # noqa: E731
    return r(N, H, K), r(N, H, K), r(N, H, K), r(N, H, K), r(N, H), r(H) * 0.3, r(H * K) * 0.5


def test_kda_decode_step_gated_updates_a_strided_pool_in_place():
    """One token per sequence from the pool's states, against the chunked path with initial states (fp64)."""
    g = torch.Generator().manual_seed(1)
    P, H, K, N = 7, 2, 16, 3
    q, k, v, f, bl, A_log, dt_bias = _gated_inputs(N, H, K, torch.float64, g)
    pool = torch.randn(P, 3, H, K, K, generator=g, dtype=torch.float64)
    before = pool.clone()
    slots = torch.tensor([4, 0, 6])
    o = kda_decode_step_gated(q, k, v, f, bl, A_log, dt_bias, pool[:, 2], slots, -5.0, backend="torch")
    ro, rs = chunk_kda_gated(q[:, None], k[:, None], v[:, None], f[:, None], bl[:, None], A_log, dt_bias,
                             initial_state=before[slots, 2], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             lower_bound=-5.0, backend="reference")
    assert (o - ro[:, 0]).abs().max() <= 1e-12 and (pool[slots, 2] - rs).abs().max() <= 1e-12
    others = [p for p in range(P) if p not in slots.tolist()]
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, :2], before[:, :2])


@pytest.mark.parametrize("dt_bias_on", [True, False])
def test_triton_decode_reads_strided_gate_and_beta_rows(dt_bias_on):
    """The Triton step (CPU interpreter, or CUDA) takes f and beta as row slices of one wider projection output, as
    the engine's joined projection hands them over (no copies), and equals the PyTorch step on contiguous copies."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    P, H, K, N = 6, 2, 16, 3
    q, k, v, _, _, A_log, dt_bias = _gated_inputs(N, H, K, torch.float32, g, dev)
    wide = torch.randn(N, H * K + 5 + H, generator=g).to(dev)
    f, bl = wide[:, :H * K].view(N, H, K), wide[:, H * K + 5:]
    assert not f.is_contiguous() and bl.stride(0) != H
    dtb = dt_bias if dt_bias_on else None
    pool = torch.randn(P, 2, H, K, K, generator=g).to(dev)
    ref_pool = pool.clone()
    slots = torch.tensor([5, 1, 2], device=dev)
    o = kda_decode_step_gated(q, k, v, f, bl, A_log, dtb, pool[:, 1], slots, -5.0, backend="triton")
    ro = kda_decode_step_gated(q, k, v, f.contiguous(), bl.contiguous(),
                               A_log, dtb if dt_bias_on else torch.zeros(H * K, device=dev), ref_pool[:, 1], slots, -5.0,
                               backend="torch")
    assert (o - ro).abs().max() <= 1e-5 and (pool - ref_pool).abs().max() <= 1e-5


@pytest.mark.parametrize("block_v,warps", [(16, 2), (32, 1), (64, 4)])
def test_triton_decode_column_blocks_equal_the_torch_step(block_v, warps):
    """The one-token Triton step at the column-block launches a decode may take (`NARROW_LAUNCH` for a small batch,
    the default 64) equals the PyTorch step: the blocks only split the state's value columns."""
    from k3.ops.kda.triton import kda_decode_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(block_v)
    P, H, K, N = 5, 2, 64, 2
    q, k, v, f, bl, A_log, dt_bias = _gated_inputs(N, H, K, torch.float32, g, dev)
    pool = torch.randn(P, H, K, K, generator=g).to(dev)
    ref_pool = pool.clone()
    slots = torch.tensor([3, 0], device=dev)
    o = kda_decode_triton(q, k, v, f, bl, pool, state_indices=slots, A_log=A_log, dt_bias=dt_bias, beta_logits=True,
                          use_qk_l2norm_in_kernel=True, block_v=block_v, num_warps=warps)
    ro = kda_decode_step_gated(q, k, v, f, bl, A_log, dt_bias, ref_pool, slots, -5.0, backend="torch")
    assert (o - ro).abs().max() <= 1e-5 and (pool - ref_pool).abs().max() <= 1e-5


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("narrow", [False, True], ids=["64-columns", "narrow"])
def test_cuda_kda_decode_step_gated_triton_equals_torch(narrow, monkeypatch):
    from k3.ops.kda.triton import decode
    monkeypatch.setattr(decode, "NARROW", narrow)
    g = torch.Generator().manual_seed(2)
    P, H, K, N = 11, 4, 64, 5
    q, k, v, f, bl, A_log, dt_bias = _gated_inputs(N, H, K, torch.float32, g, "cuda")
    pool = torch.randn(P, 2, H, K, K, generator=g).cuda()
    ref_pool = pool.clone()
    slots = torch.tensor([9, 3, 0, 10, 5], device="cuda")
    o = kda_decode_step_gated(q, k, v, f, bl, A_log, dt_bias, pool[:, 1], slots, -5.0)
    ro = kda_decode_step_gated(q, k, v, f, bl, A_log, dt_bias, ref_pool[:, 1], slots, -5.0, backend="torch")
    assert (o - ro).abs().max() <= 1e-4 and (pool - ref_pool).abs().max() <= 1e-4


@pytest.mark.parametrize("page_table", [False, True])
def test_packed_batch_decode_on_device_equals_the_host_builder(monkeypatch, page_table):
    """The device builder's fields equal the host builder's; its MLA pages per position (K3_MLA_PAGE_TABLE=0), or
    each row's page table with the history bound that the kernel reads it with (the default)."""
    monkeypatch.setattr("k3.ops.mla_decode.PAGE_TABLE", page_table)
    rng = random.Random(3)
    ps, n, S = 8, 5, 64
    starts = [rng.randrange(S) for _ in range(n)]
    tables = [rng.sample(range(100), S // ps) for _ in range(n)]
    slots = list(range(50, 50 + n))
    host = PackedBatch.build([1] * n, starts, slots, [t[:s // ps + 1] for t, s in zip(tables, starts)],
                             [True] * n, ps, 3, "cpu")
    dev = PackedBatch.for_decode(torch.tensor(starts), torch.tensor(slots), torch.tensor(tables), S, ps)
    assert dev.decode and host.decode and dev.num_docs == n
    for name in ("cu_seqlens", "slots", "rows", "tok_page", "tok_off"):
        assert torch.equal(getattr(dev, name), getattr(host, name)), name
    w = host.dec_valid.shape[1]
    if page_table:  # the rows' own tables: position p's page at column p // ps, as the host's per-position form
        assert dev.dec_history == S and dev.dec_off is None and dev.dec_valid is None
        assert torch.equal(dev.dec_page, torch.tensor(tables))
        p = torch.arange(w)
        page = dev.dec_page[:, p // ps]
        assert torch.equal(page[host.dec_valid], host.dec_page[host.dec_valid])
        assert torch.equal((p % ps).expand(n, w)[host.dec_valid], host.dec_off[host.dec_valid])
        page, off, valid = dev.decode_positions(ps)  # the gather fallback's per-position form, built once
        assert dev.decode_positions(ps) is dev._positions and torch.equal(valid[:, :w], host.dec_valid)
        assert not valid[:, w:].any()
        assert torch.equal(page[:, :w][host.dec_valid], host.dec_page[host.dec_valid])
        assert torch.equal(off[:, :w][host.dec_valid], host.dec_off[host.dec_valid])
        return
    assert dev.dec_history is None
    assert torch.equal(dev.dec_valid[:, :w], host.dec_valid) and not dev.dec_valid[:, w:].any()
    for name in ("dec_page", "dec_off"):
        assert torch.equal(getattr(dev, name)[:, :w][host.dec_valid], getattr(host, name)[host.dec_valid]), name


def _pool(model, pages, page):
    lm = model.language_model
    cfg, layers = lm.config, lm.model.decoder_layers
    la = cfg.linear_attn_config
    kda = [l.layer_idx for l in layers if l.is_kda]
    mla = [l.layer_idx for l in layers if not l.is_kda]
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    g = torch.Generator().manual_seed(9)  # garbage everywhere: nothing may read what it did not write
    return PagedCache(torch.randn(pages, len(kda), H, K, K, generator=g),
                      torch.randn(pages, len(kda), 3, H * K, W - 1, generator=g),
                      torch.randn(pages, len(mla), page, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g),
                      kda, mla)


def run_packed(lm, cache, batch, ids):
    """The model's packed forward over a paged cache (as the engine's runner) → fp32 logits of batch.rows."""
    cache.batch = batch
    _, hn, _ = lm.model(lm.model.embed_tokens(torch.tensor(ids))[None], cache=cache, rows=batch.rows)
    return lm.lm_head(hn)[0]


def prefilled_pools(model, ps, rng, tables):
    """Two pools (garbage everywhere) with the same three sequences of 13, 5 and 21 random tokens prefilled
    (KDA slots 1-3, MLA pages `tables`) → (pool a, pool b, the sequences)."""
    lm = model.language_model
    a = _pool(model, 40, ps)
    for s in (a.state, a.conv):
        s[[1, 2, 3]] = 0  # the three sequences' fresh KDA slots
    seqs = [[rng.randrange(4000) for _ in range(L)] for L in (13, 5, 21)]
    run_packed(lm, a, PackedBatch.build([len(s) for s in seqs], [0] * 3, [1, 2, 3], tables, [True] * 3, ps, 3,
                                        "cpu"), [t for s in seqs for t in s])
    b = _pool(model, 40, ps)
    for src, dst in ((a.state, b.state), (a.conv, b.conv), (a.mla, b.mla)):
        dst.copy_(src)
    return a, b, seqs


@torch.no_grad()
@pytest.mark.parametrize("page_table", [False, True], ids=["per-position-pages", "page-tables"])
def test_padded_device_decode_batch_equals_the_unpadded_one(one_thread, page_table, monkeypatch):
    """Three sequences prefilled, then one decode step two ways: the host-built batch of exactly those three,
    and the graph's batch — device-built, padded to 8 with entries on a scratch slot and page (which hold
    garbage) and a padded history, its MLA pages per position or as each row's page table
    (`mla_decode.PAGE_TABLE`). Same logits, same pool afterwards."""
    monkeypatch.setattr("k3.ops.mla_decode.PAGE_TABLE", page_table)
    model = make_tiny(seed=4)
    lm, ps = model.language_model, 8
    rng = random.Random(4)
    tables = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    a, b, seqs = prefilled_pools(model, ps, rng, tables)

    run = functools.partial(run_packed, lm)
    new = [rng.randrange(4000) for _ in seqs]
    starts = [len(s) for s in seqs]
    ref = run(a, PackedBatch.build([1] * 3, starts, [1, 2, 3], tables, [True] * 3, ps, 3, "cpu"), new)
    pad = 5
    B = 3 + pad
    got = run(b, PackedBatch.for_decode(torch.tensor(starts + [0] * pad), torch.tensor([1, 2, 3] + [39] * pad),
                                    torch.tensor(tables + [[38] * 3] * pad), 32, ps), new + [0] * pad)
    assert got.shape[0] == B
    assert (got[:3] - ref).abs().max() <= 1e-5
    real = [1, 2, 3] + [p for t in tables for p in t]
    for x, y in ((a.state, b.state), (a.conv, b.conv), (a.mla, b.mla)):
        assert (x[real] - y[real]).abs().max() <= 1e-5


def eager_then_replay(eng, g, inputs):
    """Run graph g's work eagerly on `inputs` (without programmatic dependent launch: each kernel starts after the
    one before it has finished, the reference for the graph's PDL edges), restore the pool, then replay it:
    (eager logits of every row, replayed logits as the runner returns them, the pool after the eager run, the
    pool before)."""
    from k3.ops import _triton
    before = eng.pool.storage.clone()
    g.fill(inputs, eng.runner.scratch)
    g.buf.copy_(g.host)
    old, _triton.PDL = _triton.PDL, False
    try:
        eager = g.run().clone()
    finally:
        _triton.PDL = old
    after_eager = eng.pool.storage.clone()
    eng.pool.storage.copy_(before)
    replayed = g(inputs, eng.runner.scratch).clone()
    torch.cuda.synchronize()
    return eager, replayed, after_eager, before


def pages_differing(eng, other):
    """Pool pages that differ from `other`, the runner's scratch pages left out (padding writes them at once)."""
    keep = [p for p in range(eng.pool.num_pages) if p not in eng.runner.reserved_pages]
    return [p for p in keep if not torch.equal(other[p], eng.pool.storage[p])]


def test_pdl_launch_keywords(monkeypatch):
    """`k3.ops._triton.pdl`: the launch keywords of programmatic dependent launch only for sm90+ CUDA tensors
    with the switch on; nothing for CPU tensors (the interpreter has no griddepcontrol) or with it off."""
    from k3.ops import _triton
    assert _triton.pdl(torch.zeros(1)) == {}
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        on = torch.cuda.get_device_capability()[0] >= 9
        assert _triton.pdl(x) == ({"PDL": True, "launch_pdl": True} if on and _triton.PDL else {})
        monkeypatch.setattr(_triton, "PDL", False)
        assert _triton.pdl(x) == {}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True], ids=["plain-latent-write", "fused-latent-write"])
def test_cuda_graph_replay_equals_eager(fused, monkeypatch):
    """A bf16 engine (the graphs need the MoE's sync-free grouped path): sequences of several lengths are
    prefilled, then each decode step's graph is replayed and also run eagerly on the same inputs and pool
    (restored in between): logits and every pool byte bitwise equal (but the scratch pages' garbage). Several
    batch and history buckets; the eager run with autograd on (the caller's mode must not change the path) and
    without programmatic dependent launch (the graph's kernels overlap their starts: a missing wait would read
    a buffer before its producer finished)."""

    import k3.ops.mla_decode as mla_ops
    monkeypatch.setattr(mla_ops, "FUSED_WRITE", fused)  # MLA's latent norm in the page write (K3_MLA_FUSED_WRITE)
    model = make_tiny(seed=6).cuda().to(torch.bfloat16).eval()
    for in_chunk in (True, False):  # with in-chunk checkpoints the engine's own steps capture the first graph
        check_replay_equals_eager(model, in_chunk)


def check_replay_equals_eager(model, in_chunk: bool):
    from k3.serve import Engine, EngineConfig, SamplingParams
    from k3.serve.runner import SeqInput

    eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=128, max_num_batched_tokens=512,
                                     checkpoints_in_chunks=in_chunk))
    assert eng.runner.use_graphs
    rng = random.Random(6)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 300))] for _ in range(11)]
    rids = [eng.submit(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts]
    while any(not eng.requests[r].output for r in rids):
        eng.step()
    checked = set()
    for n in (11, 5, 1, 3):
        seqs = [eng.requests[r] for r in rids[:n]]
        inputs = [SeqInput(tokens=[s.tokens[-1]], start=s.num_tokens - 1, state_page=s.state_page,
                           mla_pages=s.mla_pages, want_logits=True) for s in seqs]
        g = eng.runner.graph_for(inputs)
        eager, replayed, after_eager, _ = eager_then_replay(eng, g, inputs)
        assert torch.equal(eager[:n], replayed) and torch.isfinite(replayed).all()
        diff = pages_differing(eng, after_eager)
        assert not diff, (f"pages {diff[:8]} differ (scratch {eng.runner.reserved_pages}; sequences' state pages "
                          f"{[s.state_page for s in seqs]}, MLA pages {[s.mla_pages for s in seqs]})")
        checked.add((g.batch_size, g.history))
    assert len(checked) >= 3
    for r in rids:
        eng.abort(r)
    eng.check_pool()


@cuda
@pytest.mark.cuda
def test_cuda_graph_engine_runs_every_bucket():
    """A bf16 engine with graphs serves a mixed load (requests finishing at different lengths, prefill chunks
    between decode steps) with every request complete and the pool consistent; the graph path really ran."""
    from k3.serve import Engine, EngineConfig, SamplingParams

    model = make_tiny(seed=7).cuda().to(torch.bfloat16).eval()
    eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=256, max_num_batched_tokens=96))
    rng = random.Random(7)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 300))] for _ in range(23)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0, ignore_eos=True) for _ in prompts]
    outs = eng.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert len(eng.runner.graphs) >= 3
    eng.check_pool()


def test_joined_weight_cache_follows_in_place_updates():
    """Inference reuses one joined tensor (same storage: graphs that captured it stay valid) and rebuilds it in
    place when a part changes; with autograd it is built per call and gradients reach the parts."""
    from torch import nn

    from k3.model.layers import joined_weight, refresh_joined_weights

    m = nn.Module()
    a, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(2, 4))
    with torch.no_grad():
        w = joined_weight(m, "ab", [a, b], torch.float32)
        assert torch.equal(w, torch.cat([a, b])) and joined_weight(m, "ab", [a, b], torch.float32) is w
        a.add_(1.0)  # an optimizer step / load_state_dict: the version counter moves
        w2 = joined_weight(m, "ab", [a, b], torch.float32)
        assert w2.data_ptr() == w.data_ptr() and torch.equal(w2, torch.cat([a, b]))
        b.mul_(2.0)
    refresh_joined_weights(m)  # what Engine.update_weights calls before graphs replay
    assert torch.equal(m._joined_weights["ab"][1], torch.cat([a, b]).detach())
    with torch.no_grad():  # padded to a multiple of 8 rows: zeros after the parts, kept by a refresh
        p = joined_weight(m, "ab8", [a, b], torch.float32, multiple=8)
        assert p.shape == (8, 4) and torch.equal(p[:5], torch.cat([a, b])) and not p[5:].any()
        a.sub_(1.0)
        refresh_joined_weights(m)
        assert m._joined_weights["ab8"][1] is p and torch.equal(p[:5], torch.cat([a, b])) and not p[5:].any()
    pg = joined_weight(m, "ab8", [a, b], torch.float32, multiple=8)  # with autograd: built per call, padded too
    assert pg.shape == (8, 4) and pg.requires_grad and not pg[5:].any()
    a.data, b.data = a.data.double(), b.data.double()  # moved / converted (as .cuda() does): a new tensor
    with torch.no_grad():
        w3 = joined_weight(m, "ab", [a, b], torch.float64)
        assert w3.dtype == torch.float64 and torch.equal(w3, torch.cat([a, b]))
    m2 = nn.Linear(4, 3)
    with torch.no_grad():
        joined_weight(m2, "w", [m2.weight], torch.float32)
        m2.to("cuda" if torch.cuda.is_available() else "meta")  # a moved model: the cache follows
        assert joined_weight(m2, "w", [m2.weight], torch.float32).device == m2.weight.device
    a.data, b.data = a.data.float(), b.data.float()
    y = joined_weight(m, "ab", [a, b], torch.float32).sum()  # with autograd: not the cache
    y.backward()
    assert torch.equal(a.grad, torch.ones_like(a)) and torch.equal(b.grad, torch.ones_like(b))
