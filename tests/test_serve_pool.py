"""Unified paged pool: typed views share one buffer without overlapping, reference counting, copies."""

import pytest
import torch

from k3 import K3Config
from k3.serve.pool import PagePool, PoolExhausted, PoolLayout


@pytest.fixture(params=[torch.float32, torch.bfloat16])
def pool(request):
    cfg = K3Config.preset("k3-tiny").text_config
    return PagePool(PoolLayout.for_model(cfg, block_size=16, dtype=request.param), num_pages=6)


def test_layout_matches_model_config():
    cfg = K3Config.preset("k3-small").text_config
    L = PoolLayout.for_model(cfg, block_size=6144, dtype=torch.bfloat16)
    n_mla = len(cfg.linear_attn_config.full_attn_layers)
    assert L.num_mla_layers == n_mla and L.num_kda_layers == cfg.num_hidden_layers - n_mla
    assert L.mla_bytes == n_mla * 6144 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert L.state_bytes == L.num_kda_layers * 12 * 128 * 128 * 4
    assert L.page_bytes >= max(L.mla_bytes, L.slot_bytes) and L.page_bytes % 256 == 0


def test_views_partition_each_page(pool):
    """Writing every typed region of page 2 with fresh values changes only page 2's bytes, and the state
    and conv regions of a slot do not overlap each other."""
    before = pool.storage.clone()
    g = torch.Generator().manual_seed(0)
    pool.state[2].copy_(torch.randn(pool.state[2].shape, generator=g))
    conv = torch.randn(pool.conv[2].shape, generator=g).to(pool.conv.dtype)
    pool.conv[2].copy_(conv)
    assert torch.equal(pool.conv[2], conv)  # the conv write did not clobber / was not clobbered by state
    changed = (pool.storage != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2]
    mla = torch.randn(pool.mla[4].shape, generator=g).to(pool.mla.dtype)
    pool.mla[4].copy_(mla)
    assert torch.equal(pool.mla[4], mla)
    assert (pool.storage != before).any(dim=1).nonzero().flatten().tolist() == [2, 4]
    assert pool.mla.data_ptr() == pool.state.data_ptr() == pool.storage.data_ptr()  # one buffer


def test_refcounts_and_free_list(pool):
    pages = [pool.allocate() for _ in range(6)]
    assert sorted(pages) == list(range(6)) and pool.num_free == 0
    with pytest.raises(PoolExhausted):
        pool.allocate()
    pool.incref(pages[0])
    assert not pool.decref(pages[0]) and pool.decref(pages[0])
    with pytest.raises(RuntimeError, match="free page"):
        pool.decref(pages[0])
    with pytest.raises(RuntimeError, match="free page"):
        pool.incref(pages[0])
    for p in pages[1:]:
        pool.decref(p)
    pool.check()
    assert pool.num_free == 6


def test_copies(pool):
    g = torch.Generator().manual_seed(1)
    a, b = pool.allocate(), pool.allocate()
    pool.mla[a].copy_(torch.randn(pool.mla[a].shape, generator=g).to(pool.mla.dtype))
    pool.mla[b].zero_()
    pool.copy_tokens(a, b, 5)
    assert torch.equal(pool.mla[b, :, :5], pool.mla[a, :, :5]) and not pool.mla[b, :, 5:].any()
    pool.state[a].copy_(torch.randn(pool.state[a].shape, generator=g))
    pool.conv[a].copy_(torch.randn(pool.conv[a].shape, generator=g).to(pool.conv.dtype))
    pool.copy_slot(a, b)
    assert torch.equal(pool.state[b], pool.state[a]) and torch.equal(pool.conv[b], pool.conv[a])
    pool.zero_slot(b)
    assert not pool.state[b].any() and not pool.conv[b].any()
    buf = pool.to_host(a)
    pool.from_host(buf, b)
    assert torch.equal(pool.storage[a], pool.storage[b])


def test_bad_sizes():
    cfg = K3Config.preset("k3-tiny").text_config
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(PoolLayout.for_model(cfg, 16, torch.float32), num_pages=1)


def _ops(rng, pool):
    """A random admission-like list of pool ops (slot copies, token copies, zero-fills) over pages 0-5."""
    ops = []
    for _ in range(rng.randrange(1, 6)):
        kind = rng.choice(["slot", "tokens", "zero"])
        src, dst = rng.sample(range(pool.num_pages), 2)
        ops.append((kind, src, dst, rng.randrange(1, pool.layout.block_size + 1)))
    return ops


def _run(pool, ops):
    for kind, src, dst, n in ops:
        if kind == "slot":
            pool.copy_slot(src, dst)
        elif kind == "tokens":
            pool.copy_tokens(src, dst, n)
        else:
            pool.zero_slot(dst)


@pytest.mark.parametrize("seed", range(6))
def test_deferred_copies_equal_the_eager_ones(pool, seed):
    """`defer` on: the ops only record (the pool's bytes do not move); the recorded list as word segments, run by
    `apply_page_ops`, gives the bytes the eager ops give, or (a page written twice, or read after another op
    writes it) `take_deferred` runs them itself in order and returns none. Fresh random bytes on every page."""
    import random

    from k3.ops.page_ops import apply_page_ops, table_of, table_words
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=g, dtype=torch.uint8))
    start = pool.storage.clone()
    ops = _ops(rng, pool)
    _run(pool, ops)
    want = pool.storage.clone()
    pool.storage.copy_(start)
    pool.defer = True
    _run(pool, ops)
    assert torch.equal(pool.storage, start)  # nothing ran yet
    segs = pool.take_deferred(max_segments=64)
    dsts = [d for _, _, d, _ in ops]
    independent = len(set(dsts)) == len(dsts) and not any(s in dsts for k, s, _, _ in ops if k != "zero")
    assert bool(segs) == independent
    if segs:
        assert torch.equal(pool.storage, start)
        table = torch.tensor(table_of(segs) + [0] * 3)
        assert table.numel() == table_words(len(segs) + 1)
        apply_page_ops(pool.words, table)
    assert torch.equal(pool.storage, want)
    assert pool.take_deferred(64) == []


def test_deferred_copies_run_before_any_other_access(pool):
    """Whatever else touches the pool's memory runs the recorded ops first (to_host, from_host, copy_page, flush);
    a list over `max_segments` runs at once."""
    pool.defer = True
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.state[a].fill_(3.0)
    pool.copy_slot(a, b)
    assert not torch.equal(pool.state[b], pool.state[a])
    buf = pool.to_host(b)
    assert torch.equal(pool.state[b], pool.state[a]) and torch.equal(buf, pool.storage[b].cpu())
    pool.zero_slot(b)
    pool.from_host(buf, c)
    assert not pool.state[b].any() and torch.equal(pool.state[c], pool.state[a])
    pool.copy_tokens(a, b, 3)
    assert pool.take_deferred(max_segments=pool.layout.num_mla_layers - 1) == []  # too many: run here
    assert torch.equal(pool.mla[b, :, :3], pool.mla[a, :, :3])
    pool.zero_slot(c)
    pool.flush()
    assert not pool.state[c].any()
