"""The engine's cold prefill graphs (`PrefillGraph`: a prompt's first chunk alone in a step, padded to a token
bucket, every table built on the device): the conv's padding rows, the in-place chunked KDA with checkpoint states
from device positions against the chunked oracle, the padded device-built `PackedBatch.for_prefill` against the
host-built chunked batch, the engine with the graph paths on (run eagerly on the CPU) against the engine without,
and (CUDA) replay against eager execution."""

import functools
import random
from unittest import mock

import pytest
import torch

from conftest import assert_same_batch, make_tiny, rel_rmse
from k3.model.paged_cache import PackedBatch, token_runs
from k3.ops.conv import CONV_TILE, conv_tiles, short_conv_step
from k3.ops.kda import chunk_kda_gated, kda_decode_step_gated

from test_decode_graphs import _gated_inputs, _pool, eager_then_replay, pages_differing, run_packed
from test_extend_graphs import _cu, _triton_or_skip, assert_same_outputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("lens", [[45], [70, 2, 33]], ids=["one", "several"])
def test_short_conv_tiles_zero_the_padding_after_the_last_sequence(lens):
    """The per-tile conv (a prefill chunk) with rows after the last sequence inside its last tiles (a captured
    prefill's padding, extra tiles of the last sequence): those rows are 0 (the output is allocated uninitialised),
    the others equal the reference, and the windows advance to the real end."""
    dev = _triton_or_skip()
    g = torch.Generator().manual_seed(21)
    P, C, W = 6, 96, 4
    m = sum(lens)
    N = -(-(m + 40) // CONV_TILE) * CONV_TILE  # at least one whole padding tile
    pool = torch.randn(P, 2, C, W - 1, generator=g).to(dev)
    ref_pool = pool.clone()
    w = torch.randn(C, 1, W, generator=g).to(dev)
    x = torch.randn(N, C, generator=g).to(dev)
    slots, cu = torch.tensor([4, 0, 2][:len(lens)], device=dev), _cu(lens, dev)
    last = len(lens) - 1
    tiles = conv_tiles(lens, dev)
    pad = torch.tensor([(last, t) for t in range(int(tiles[-1, 1]) + CONV_TILE, N, CONV_TILE)],
                       dtype=torch.int32, device=dev).reshape(-1, 2)
    for _ in range(2):  # the second call reuses the allocator's block the first one filled
        y = short_conv_step(x, w, pool[:, 1], slots, backend="triton", cu_seqlens=cu, tiles=torch.cat([tiles, pad]))
        pool[:, 1] = ref_pool[:, 1]
    y = short_conv_step(x, w, pool[:, 1], slots, backend="triton", cu_seqlens=cu, tiles=torch.cat([tiles, pad]))
    ref = short_conv_step(x[:m], w, ref_pool[:, 1], slots, backend="reference", cu_seqlens=cu)
    assert rel_rmse(ref, y[:m]) <= 1e-6 and torch.equal(y[m:], torch.zeros_like(y[m:]))
    assert torch.equal(pool, ref_pool)


def _states_inputs(lens, want, dtype, dev, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    P, H, K = 9, 2, 32
    N = rows or sum(lens) + 5  # padding rows of no sequence
    q, k, v, f, bl, A_log, dt_bias = _gated_inputs(N, H, K, dtype, g, dev)
    pool = torch.randn(P, 2, H, K, K, generator=g, dtype=dtype).to(dev) * 0.3
    cu = _cu(lens, dev)
    return (q, k, v, f, bl, A_log, dt_bias), pool, torch.tensor([4, 0, 6][:len(lens)], device=dev), cu, \
        torch.tensor(want, device=dev)


@pytest.mark.parametrize("lens,want", [([45], [16, 32, 0, 0]), ([40, 3, 37], [32, 0, 16, 40, 75])],
                         ids=["one", "several"])
def test_kda_step_states_at_equal_the_chunked_states(lens, want):
    """kda_decode_step_gated with `states_at` (device positions, < 1 unused; a sequence end included): the PyTorch
    token steps in pieces (fp64) against `chunk_kda_gated(states_at=)` from the same initial states: outputs, the
    requested states (zero where unused), the final states in the pool."""
    args, pool, slots, cu, pos = _states_inputs(lens, want, torch.float64, "cpu", 22)
    before = pool.clone()
    o, st = kda_decode_step_gated(*args, pool[:, 1], slots, -5.0, backend="torch", cu_seqlens=cu, states_at=pos)
    m = int(cu[-1])
    used = [i for i, p in enumerate(want) if p > 0]
    ro, rs, rsel = chunk_kda_gated(*(x[None, :m] for x in args[:5]), *args[5:], initial_state=before[slots, 1],
                                   output_final_state=True, cu_seqlens=cu.to(torch.int32),
                                   use_qk_l2norm_in_kernel=True, lower_bound=-5.0, backend="reference",
                                   states_at=pos[used])
    # fp64; the outputs agree to 2.5e-9 here with or without states_at (one row at a chunk start; the states to 1e-16)
    assert rel_rmse(ro[0], o[:m]) <= 1e-8 and not o[m:].any()
    assert rel_rmse(rsel, st[used]) <= 1e-12 and not st[[i for i in range(len(want)) if i not in used]].any()
    assert rel_rmse(rs, pool[slots, 1]) <= 1e-12


@pytest.mark.parametrize("lens,want", [([45], [16, 32, 0, 0]), ([40, 3, 37], [32, 0, 16, 40, 75])],
                         ids=["one", "several"])
def test_kda_extend_states_at_triton_equals_torch(lens, want):
    """The chunked Triton extend step with checkpoint states (its chunk → checkpoint table built on the device,
    Tb unfolded and folded) against the PyTorch token steps: outputs, states, pool (fp32)."""
    from k3.ops.kda.triton.chunk import cfg_override
    dev = _triton_or_skip()
    for fold in (False, True):
        args, pool, slots, cu, pos = _states_inputs(lens, want, torch.float32, dev, 23)
        ref_pool = pool.clone()
        chunks = token_runs(cu, args[0].shape[0], 16, first=True)
        with cfg_override(fold_tb=fold):
            o, st = kda_decode_step_gated(*args, pool[:, 1], slots, -5.0, backend="auto" if dev == "cuda" else "triton",
                                          cu_seqlens=cu, chunks=chunks, states_at=pos)
        ro, rst = kda_decode_step_gated(*args, ref_pool[:, 1], slots, -5.0, backend="torch", cu_seqlens=cu,
                                        states_at=pos)
        m = int(cu[-1])
        assert rel_rmse(ro[:m], o[:m]) <= 1e-5 and not o[m:].any()
        assert rel_rmse(rst, st) <= 1e-5 and (pool - ref_pool).abs().max() <= 1e-5


@pytest.mark.parametrize("length,want", [(100, [16, 48, 96, 0]), (40, [16, 32, 0, 0])], ids=["all-segments", "empty-tail"])
def test_kda_extend_split_equals_unsplit(length, want, nan_empty):
    """A one-sequence extend chunk (a prefill graph's) in 4 static segments — summaries, fp32 combine, segments
    from their states — against the unsplit recurrence, both from a pool slot: outputs, checkpoint states, the
    slot's final state (fp32); segments past the chunk's end are empty and the padding rows get o = 0 (outputs
    allocated NaN-filled here)."""
    from k3.ops.kda.triton import chunk as CH
    dev = _triton_or_skip()
    T = 128
    args, pool, slots, cu, pos = _states_inputs([length], want, torch.float32, dev, 29, rows=T)
    # slow decay (g ≈ -0.01 per token): a segment's state still carries its incoming state, so the combine counts
    args = args[:6] + (torch.full_like(args[6], -6.0),)
    chunks = token_runs(cu, T, 16, first=True)
    out = []
    for split, kernel in ((0, False), (4, False), (4, True)):  # unsplit; the combine as GEMMs; as one kernel
        p = pool.clone()
        with CH.cfg_override(extend_split=split), mock.patch.object(CH, "COMBINE_KERNEL", kernel), \
                mock.patch.object(CH, "EXTEND_SPLIT_MIN_TOKENS", 64), \
                mock.patch.object(CH, "_extend_split", wraps=CH._extend_split) as spy, \
                mock.patch.object(CH, "combine_segments", wraps=CH.combine_segments) as kspy:
            o, st = kda_decode_step_gated(*args, p[:, 1], slots, -5.0, backend="auto" if dev == "cuda" else "triton",
                                          cu_seqlens=cu, chunks=chunks, states_at=pos)
        assert spy.call_count == (split > 1) and kspy.call_count == kernel
        out.append((o, st, p))
    o0, s0, p0 = out[0]
    for o1, s1, p1 in out[1:]:
        assert rel_rmse(o0[:length], o1[:length]) <= 1e-5 and not o1[length:].any()
        assert rel_rmse(s0, s1) <= 1e-5 and rel_rmse(p0, p1) <= 1e-5


def test_split_tables_reused_only_for_the_same_unmodified_bounds():
    """`_split_tables` (built once per forward, reused by every KDA layer): the same cu_seqlens object gives the
    same tables; an in-place change of it, or another tensor, gives fresh ones, equal to the formula
    b = min(j · T / P, cu[1]), pairs (b[j], b[j + 1]), first chunk j · T / (P · 16)."""
    from k3.ops.kda.triton import chunk as CH
    T, P = 512, 4
    cu = torch.tensor([0, 300], dtype=torch.int32)
    b, pairs, first = CH._split_tables(cu, T, P)
    assert b.tolist() == [0, 128, 256, 300, 300] and pairs.tolist() == [0, 128, 128, 256, 256, 300, 300, 300]
    assert first.tolist() == [0, 8, 16, 24]
    assert CH._split_tables(cu, T, P)[0] is b
    cu[1] = 200  # in place: a new version
    b2 = CH._split_tables(cu, T, P)[0]
    assert b2 is not b and b2.tolist() == [0, 128, 200, 200, 200]
    other = torch.tensor([0, 200], dtype=torch.int32)
    assert CH._split_tables(other, T, P)[0] is not b2
    assert CH._split_tables(other, T, 2)[0].tolist() == [0, 200, 200]


def _combine_case(P, H, K, V, seed):
    """Summaries (transitions of norm ≈ 1, as a decaying state's), a pool with the slot 3, and the fp64 walk."""
    g = torch.Generator().manual_seed(seed)
    summ = torch.randn(P, H, K, V + K, generator=g)
    summ[..., V:] *= K ** -0.5
    pool = torch.randn(5, H, K, V, generator=g)
    exact = [pool[3].double()]
    for j in range(1, P):
        exact.append(summ[j - 1, ..., V:].double() @ exact[-1] + summ[j - 1, ..., :V].double())
    return summ, pool, torch.tensor([3]), torch.stack(exact)


@pytest.mark.parametrize("P,H,K,V,bv,prefetch", [(4, 2, 32, 48, 16, False), (8, 3, 16, 16, 32, True),
                                              (2, 1, 128, 128, 32, True), (3, 1, 16, 16, 16, False)])
def test_combine_segments_kernel_equals_the_gemms(P, H, K, V, bv, prefetch):
    """The segments' incoming states in one kernel (`combine.combine_segments`, the CPU interpreter here: exact
    fp32) and the reference's batched GEMMs, both against an fp64 walk of the recursion (h[0] = the slot's state,
    h[j] = M h + S): within 1e-6 relative RMS; V not a multiple of the value block; the pool untouched."""
    from k3.ops.kda.triton.combine import combine_segments, combine_segments_torch
    dev = _triton_or_skip()
    summ, pool, slot, exact = _combine_case(P, H, K, V, P * 100 + K)
    before = pool.clone()
    ref = combine_segments_torch(summ, pool, slot, P)
    out = combine_segments(summ.to(dev), pool.to(dev), slot.to(dev), P, block_v=bv, prefetch=prefetch).cpu()
    assert out.shape == (P, H, K, V) and out.dtype == torch.float32
    assert rel_rmse(exact, ref) <= 1e-6 and rel_rmse(exact, out) <= 1e-6
    assert torch.equal(out[0], pool[3]) and torch.equal(pool, before)
    with pytest.raises(ValueError, match="summ must be fp32"):
        combine_segments(summ[..., :-1].to(dev), pool.to(dev), slot.to(dev), P)
    with pytest.raises(ValueError, match="one slot"):
        combine_segments(summ.to(dev), pool.to(dev), torch.tensor([1, 2], device=dev), P)


@cuda
@pytest.mark.parametrize("prec,bound", [("tf32x3", 2e-6), ("ieee", 1e-6), ("tf32", 4e-3)])
@pytest.mark.parametrize("bv,warps,prefetch", [(16, 4, False), (32, 8, False), (32, 8, True), (64, 8, False)])
def test_combine_segments_kernel_precisions_on_cuda(prec, bound, bv, warps, prefetch):
    """On the GPU, k3-small's sizes (H 12, K = V 128) over 8 segments: 3xTF32 (the default) within 2e-6 of the
    fp64 walk (fp32's rounding; the GEMMs' own error is below 1e-6), exact FMA within 1e-6, one TF32 product within
    4e-3 (2^-11 per product, over 7 steps: 2.2e-3 measured on the H200)."""
    from k3.ops.kda.triton.combine import combine_segments
    summ, pool, slot, exact = _combine_case(8, 12, 128, 128, 5)
    out = combine_segments(summ.cuda(), pool.cuda(), slot.cuda(), 8, block_v=bv, num_warps=warps, precision=prec,
                           prefetch=prefetch)
    assert rel_rmse(exact, out.cpu()) <= bound


def test_kda_step_states_at_rejects_bad_calls():
    args, pool, slots, cu, pos = _states_inputs([20], [16], torch.float32, "cpu", 24)
    with pytest.raises(ValueError, match="states_at needs cu_seqlens"):
        kda_decode_step_gated(*args, pool[:, 1], torch.arange(args[0].shape[0]), -5.0, states_at=pos)


def test_kda_step_states_at_on_triton_needs_the_chunk_tables():
    dev = _triton_or_skip()
    args, pool, slots, cu, pos = _states_inputs([20], [16], torch.float32, dev, 24)
    with pytest.raises(ValueError, match="needs the chunk tables"):
        kda_decode_step_gated(*args, pool[:, 1], slots, -5.0, backend="triton", cu_seqlens=cu, states_at=pos)


def _chunk_reference(q, k, v, L, scale):
    """Dense masked attention (fp64): query i of N attends keys j <= i + L - N."""
    N = q.shape[0]
    s = torch.einsum("nhd,shd->hns", q.double(), k[:L].double()) * scale
    s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(N)[:, None] + L - N, float("-inf"))
    return torch.einsum("hns,shd->nhd", s.softmax(-1), v[:L].double())


def test_chunk_attention_equals_masked_attention():
    """`chunk_attention` (keys counted by a device tensor; rows past it hold garbage) against dense masked
    attention: the sdpa backend in fp64, and on CUDA the flash backend (varlen kernel, v zero-padded) in bf16."""
    from k3.ops.attention import chunk_attention
    g = torch.Generator().manual_seed(28)
    N, S, H, D, Dv, L = 20, 50, 3, 24, 16, 37
    q, k = torch.randn(N, H, D, generator=g, dtype=torch.float64), torch.randn(S, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(S, H, Dv, generator=g, dtype=torch.float64)
    k[L:], v[L:] = 1e6, float("nan")  # never read
    ref = _chunk_reference(q, k, v, L, 0.3)
    got = chunk_attention(q, k, v, torch.tensor([L]), 0.3, backend="sdpa")
    assert rel_rmse(ref, got) <= 1e-12
    with pytest.raises(ValueError, match="key_len 19 must lie"):
        chunk_attention(q, k, v, torch.tensor([19]), 0.3, backend="sdpa")
    with pytest.raises(ValueError, match="unknown backend"):
        chunk_attention(q, k, v, torch.tensor([L]), 0.3, backend="fa3")
    with pytest.raises(ValueError, match="flash backend needs"):  # fp64 (and, here, maybe no GPU)
        chunk_attention(q, k, v, torch.tensor([L]), 0.3, backend="flash")
    if torch.cuda.is_available():
        x = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
        got = chunk_attention(*x, torch.tensor([L], device="cuda"), 0.3, backend="flash")
        assert rel_rmse(ref, got.double().cpu()) <= 1e-2  # bf16 inputs and output


@torch.no_grad()
@pytest.mark.parametrize("start", [0, 21], ids=["cold", "after-history"])
def test_padded_prefill_batch_equals_the_chunked_batch(one_thread, start):
    """A sequence's chunk of 45 tokens (its first, or after 21 prefilled ones) with KDA checkpoints after 16 and
    32 of them, two ways: the host-built chunked batch and the graph's device-built prefill batch, padded to 64
    tokens, a 32-token history bucket and 4 checkpoints (two unused, on a scratch slot), with the scratch slot and
    page holding garbage. Same logits, same pool (fp32) on every page and slot but the scratch ones."""
    model = make_tiny(seed=25)
    lm, ps, W1 = model.language_model, 8, 3
    rng = random.Random(25)
    ids = [rng.randrange(4000) for _ in range(45)]
    table, slot, ck = list(range(10, 22)), 1, [(16, 2), (32, 3)]
    a = _pool(model, 40, ps)
    for s in (a.state, a.conv):
        s[[1, 2, 3]] = 0
    run = functools.partial(run_packed, lm)
    if start:
        run(a, PackedBatch.build([start], [0], [slot], [table], [True], ps, W1, "cpu"),
            [rng.randrange(4000) for _ in range(start)])
    b = _pool(model, 40, ps)
    for src, dst in ((a.state, b.state), (a.conv, b.conv), (a.mla, b.mla)):
        dst.copy_(src)
    ref = run(a, PackedBatch.build([45], [start], [slot], [table], [True], ps, W1, "cpu", [ck]), ids)
    N, hist, scratch_slot, scratch_page = 64, 32 if start else 0, 39, 38
    pages = -(-(hist + N) // ps)
    batch = PackedBatch.for_prefill(torch.tensor([start]), torch.tensor([45]), torch.tensor([slot]),
                                    torch.tensor((table + [scratch_page] * pages)[:pages]), torch.tensor([16, 32, 0, 0]),
                                    torch.tensor([2, 3, scratch_slot, scratch_slot]), N, hist, ps, W1, scratch_page)
    got = run(b, batch, ids + [0] * (N - 45))
    # fp32, the chunked KDA (eager) against the token steps (the CPU form of the graph's in-place chunked kernels)
    assert got.shape[0] == 1 and rel_rmse(ref, got) <= 1e-5
    real = [1, 2, 3] + table
    for x, y in ((a.state, b.state), (a.conv, b.conv), (a.mla, b.mla)):
        assert rel_rmse(x[real], y[real]) <= 1e-5


@pytest.mark.parametrize("length, ckpts, start, N", [(45, [16, 32, 0, 0], 0, 64), (64, [64, 0], 32, 64), (1, [], 0, 64),
                                                      (50, [0, 48, 16], 8, 64), (500, [256, 0, 480], 0, 512)])
def test_prefill_batch_with_host_tables_equals_the_device_built_one(length, ckpts, start, N):
    """`PackedBatch.for_prefill(tables=...)` (the prefill graph's int32 tables, built on the host by
    `prefill_tables_host`) gives every field the device-built tables give; in the chunk -> checkpoint table only its
    spare last entry (which the unused checkpoints all map to, in any order) may differ."""
    import numpy as np

    from k3.model.paged_cache import prefill_tables_host
    from k3.ops.conv import CONV_TILE

    hist, ps, W1 = 32 if start else 0, 8, 3
    pages = -(-(hist + N) // ps)
    args = (torch.tensor([start]), torch.tensor([length]), torch.tensor([5]), torch.arange(pages) + 3,
            torch.tensor(ckpts, dtype=torch.long), torch.arange(len(ckpts)) + 20, N, hist, ps, W1, 38)
    R, NT = N // 16 + 2, -(-N // CONV_TILE)
    host = [np.full(shape, -9, dtype=np.int32) for shape in ((R, 2), (1,), (2,), (R + 1,), (NT, 2))]
    prefill_tables_host(length, ckpts, N, *host)
    ref = PackedBatch.for_prefill(*args)
    got = PackedBatch.for_prefill(*args, tables=tuple(torch.from_numpy(h) for h in host))
    assert_same_batch(ref, got, skip_last=("step_state_slots",))


@pytest.mark.parametrize("host_tables", [True, False], ids=["host-tables", "graph-tables"])
def test_engine_with_prefill_graphs_equals_the_engine_without(one_thread, host_tables, monkeypatch):
    """A fp32 CPU engine with its graph paths on (prefill graphs run eagerly here: the same padding, device-built
    tables and pool updates as on the GPU) against the same engine without them: prompts of 130-250 tokens arriving
    one at a time (each first chunk alone in its step, with prefix-cache checkpoints inside), some sharing a prefix
    (later hits), a long one past the budget (its second chunk after history). Same tokens, logits within 1e-4, the
    prefill graphs used."""
    from k3.serve import Engine, EngineConfig, SamplingParams
    from k3.serve.runner import PrefillGraph

    monkeypatch.setattr("k3.serve.runner.HOST_TABLES", host_tables)  # K3_GRAPH_HOST_TABLES: either way

    model = make_tiny(seed=26)
    rng = random.Random(26)
    shared = [rng.randrange(4000) for _ in range(140)]
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(130, 250))] for _ in range(2)]
    prompts += [shared + [rng.randrange(4000) for _ in range(rng.randrange(1, 20))] for _ in range(2)]
    prompts += [[rng.randrange(4000) for _ in range(450)]]  # chunks of 256 and 194 tokens: the second after history
    runs, filled = [], []
    for graphs in (False, True):
        eng = Engine(model, EngineConfig(block_size=32, hash_block_size=16, num_pages=160, max_num_batched_tokens=256,
                                         max_num_seqs=4, record_logits=True))
        if graphs:
            assert eng.runner.enable_graphs()
        fill = PrefillGraph.fill
        with mock.patch.object(PrefillGraph, "fill", lambda g, seqs, sc: (filled.append(
                (g.history, [len(x.checkpoints) for x in seqs])), fill(g, seqs, sc))[1]):
            outs = [eng.generate([p], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
                    for p in prompts]
        runs.append((outs, eng))
        eng.check_pool()
    (_, ea), (_, eb) = runs
    assert_same_outputs(runs)
    steps = [(h, c[0]) for h, c in filled if c]  # the steps run through a prefill graph (not its capture's fill)
    assert any(h == 0 and n for h, n in steps) and any(h > 0 for h, _ in steps), steps
    assert ea.stats()["checkpoints_saved"] == eb.stats()["checkpoints_saved"] > 0


def test_engine_warm_up_captures_the_first_requests_graphs(one_thread):
    """`Engine.warm_up` captures the graphs a first long prompt and first decode steps replay (none without graph
    paths: an fp32 CPU engine); a request of those shapes then captures nothing new; bad sizes are refused."""
    from k3.serve import Engine, EngineConfig, SamplingParams
    from k3.serve.runner import SeqInput

    eng = Engine(make_tiny(seed=30), EngineConfig(block_size=32, hash_block_size=16, num_pages=96,
                                                  max_num_batched_tokens=512, max_num_seqs=4))
    assert eng.warm_up() == []
    assert eng.runner.enable_graphs()
    keys = eng.warm_up([300], [1, 3])
    assert ("prefill", 512, 0, 2) in keys and (1, 256) in keys and (4, 256) in keys
    rng = random.Random(30)
    eng.generate([[rng.randrange(4000) for _ in range(300)]], SamplingParams(max_tokens=1, temperature=0,
                                                                             ignore_eos=True))
    assert sorted(eng.runner.graphs, key=str) == keys  # its prefill replayed the warm graph
    dec = SeqInput(tokens=[5], start=100, state_page=eng.runner.scratch[0], mla_pages=[0], want_logits=True)
    assert eng.runner.graph_for([dec]) is eng.runner.graphs[(1, 256)]
    with pytest.raises(ValueError, match="positive ints"):
        eng.warm_up([0])


@cuda
@pytest.mark.cuda
def test_cuda_prefill_graph_replay_equals_eager():
    """bf16 engine: a prompt's first chunk (with checkpoints inside), then a second chunk after that history, each
    through its prefill graph, replayed and run eagerly on the same inputs and pool: logits and every pool byte but
    the scratch pages' bitwise equal; and against the eager chunked forward within bf16 rounding; then a whole
    request served through them."""
    from k3.serve import Engine, EngineConfig, SamplingParams
    from k3.serve.runner import SeqInput

    model = make_tiny(seed=27).cuda().to(torch.bfloat16).eval()
    eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=128, max_num_batched_tokens=512))
    assert eng.runner.use_graphs
    rng = random.Random(27)
    slot, ck = eng.pool.allocate(), [(eng.pool.allocate(), 16), (eng.pool.allocate(), 288)]
    pages = [eng.pool.allocate() for _ in range(8)]
    for p in [slot] + [c[0] for c in ck]:
        eng.pool.zero_slot(p)
    start = 0
    for n, checkpoints, want in ((300, [(o, p) for p, o in ck], (512, 0, 2)), (200, [], (256, 1024, 2))):
        inputs = [SeqInput(tokens=[rng.randrange(4000) for _ in range(n)], start=start, state_page=slot,
                           mla_pages=pages, want_logits=True, checkpoints=checkpoints)]
        g = eng.runner.graph_for(inputs)
        assert g is not None and (g.tokens, g.history, g.ckpts) == want
        eager, replayed, after_eager, before = eager_then_replay(eng, g, inputs)
        assert torch.equal(eager[:1], replayed) and torch.isfinite(replayed).all()
        assert not pages_differing(eng, after_eager)
        after_replay = eng.pool.storage.clone()
        eng.pool.storage.copy_(before)
        eng.runner.use_graphs = False
        chunked = eng.runner.forward(inputs)
        eng.runner.use_graphs = True
        # bf16: the same kernels but for padding, the attention call and the conv's row tiles (measured ≈ 1 %)
        assert rel_rmse(chunked, replayed) <= 4e-2
        eng.pool.storage.copy_(after_replay)  # the next chunk continues from the graph's state
        start += n
    for p in [slot] + [c[0] for c in ck] + pages:
        eng.pool.decref(p)
    ids = [rng.randrange(4000) for _ in range(900)]  # chunks of 512 (cold) and 388 (after 512) tokens
    out = eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and any(k[0] == "prefill" and k[2] > 0 for k in eng.runner.graphs)
    eng.check_pool()
