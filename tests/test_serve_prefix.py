"""KDA-aware prefix cache: exactness of hits against a cold full prefill, the hit length against a
brute-force oracle, checkpoint eviction fallback, the host tier, and the hashing/lookup rules."""

import random

import pytest
import torch

from conftest import make_tiny
from k3.serve import Engine, EngineConfig, SamplingParams
from k3.serve.prefix_cache import chain_hash, extend_hashes

TOL = 1e-4
H, B = 4, 16  # fine hash block / coarse page, scaled down from 512 / 6144


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=11)


def engine(model, **kw) -> Engine:
    args = dict(block_size=B, hash_block_size=H, num_pages=200, record_logits=True)
    args.update(kw)
    return Engine(model, EngineConfig(**args))


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 4000) for _ in range(n)]


def cold_logits(model, prompt, out) -> torch.Tensor:
    with torch.no_grad():
        lg = model(torch.tensor([prompt + out])).logits[0]
    return lg[len(prompt) - 1: len(prompt) - 1 + len(out)]


class Oracle:
    """Brute force over token tuples: which prefixes have MLA rows and KDA checkpoints under the engine's
    documented policy, and the resulting hit length (no eviction)."""

    def __init__(self, h: int):
        self.h, self.mla, self.ckpt = h, set(), set()

    def run_len(self, toks) -> int:
        j = 0
        while (j + 1) * self.h <= len(toks) - 1 and tuple(toks[:(j + 1) * self.h]) in self.mla:
            j += 1
        return j * self.h

    def hit(self, toks) -> int:
        run = self.run_len(toks)
        return max([L for L in range(self.h, run + 1, self.h) if tuple(toks[:L]) in self.ckpt], default=0)

    def record(self, prompt, out) -> int:
        h, N = self.h, len(prompt)
        L, run = self.hit(prompt), self.run_len(prompt)
        want = {(N - 1) // h * h, N // h * h} | ({run} if run > L else set())
        self.ckpt |= {tuple(prompt[:x]) for x in want if L < x <= N}
        seq = prompt + out
        computed = N + len(out) - 1
        self.mla |= {tuple(seq[:x]) for x in range(h, computed + 1, h)}
        snaps = [x for x in range(N + 1, computed + 1) if x % h == 0]
        if snaps:
            self.ckpt.add(tuple(seq[:snaps[-1]]))
        return L


def check_exact(model, eng, prompt, out):
    rec = torch.stack(eng.recorded_logits[out.request_id])
    diff = (cold_logits(model, prompt, out.token_ids) - rec).abs().max().item()
    assert diff <= TOL, diff
    return diff


def test_multi_turn_hits_equal_cold_prefill(model):
    rng = random.Random(0)
    eng = engine(model)
    cold = engine(model, enable_prefix_caching=False)
    oracle = Oracle(H)
    prompt = rand_tokens(rng, 13)
    hits = []
    for turn, (nout, nuser) in enumerate([(6, 5), (9, 3), (2, 11), (5, 4), (7, 9)]):
        sp = SamplingParams(max_tokens=nout, temperature=0)
        out = eng.generate([prompt], sp)[0]
        assert out.token_ids == cold.generate([prompt], sp)[0].token_ids
        check_exact(model, eng, prompt, out)
        assert out.num_cached_tokens == oracle.record(prompt, out.token_ids)
        hits.append(out.num_cached_tokens)
        prompt = prompt + out.token_ids + rand_tokens(rng, nuser)
    assert all(x > 0 for x in hits[1:])
    assert any(x % B for x in hits[1:]) and any(x > B for x in hits)  # hits inside a coarse page, past one


def test_cached_tokens_match_oracle_on_branching_trace(model):
    rng = random.Random(1)
    eng = engine(model)
    oracle = Oracle(H)
    systems = [rand_tokens(rng, n) for n in (10, 17, 33)]
    convs = []  # conversation prefixes to branch from
    for i in range(18):
        r = rng.random()
        if convs and r < 0.35:  # continue a conversation
            base = rng.choice(convs)
            p = base + rand_tokens(rng, rng.randrange(1, 9))
        elif convs and r < 0.5:  # exact repeat, or a strict prefix of an earlier prompt
            base = rng.choice(convs)
            p = base[:rng.randrange(max(1, len(base) // 2), len(base) + 1)]
        else:  # new conversation on a shared system prompt
            p = rng.choice(systems) + rand_tokens(rng, rng.randrange(1, 12))
        out = eng.generate([p], SamplingParams(max_tokens=rng.randrange(1, 10), temperature=0))[0]
        want = oracle.record(p, out.token_ids)
        assert out.num_cached_tokens == want, (i, len(p))
        if want:
            check_exact(model, eng, p, out)
        convs.append(p + out.token_ids)
    st = eng.stats()
    assert st["prefix_cache_hits"] > 0 and st["prefix_cache_evictions"] == 0
    eng.check_pool()


def test_hit_after_checkpoint_eviction_falls_back(model):
    rng = random.Random(2)
    eng = engine(model)
    p1 = rand_tokens(rng, 30)
    o1 = eng.generate([p1], SamplingParams(max_tokens=12, temperature=0))[0]
    p2 = p1 + o1.token_ids + rand_tokens(rng, 5)
    # checkpoints: 28 (end of prompt 1) and 40 (last decode boundary): a hit would restore 40
    hashes = []
    extend_hashes(hashes, p2, H)
    assert hashes[39 // H] in eng.cache.ckpt and hashes[27 // H] in eng.cache.ckpt
    eng.cache.drop_checkpoint(hashes[39 // H])
    o2 = eng.generate([p2], SamplingParams(max_tokens=4, temperature=0))[0]
    assert o2.num_cached_tokens == 28
    check_exact(model, eng, p2, o2)
    # evicting an MLA page drops the checkpoints under its keys in the same operation (rule 3)
    page, rows = eng.cache.mla[hashes[27 // H]]
    assert rows == 28 - B
    while page in eng.cache.page_keys:
        assert eng.cache.evict_one()
    assert hashes[27 // H] not in eng.cache.ckpt
    o3 = eng.generate([p2], SamplingParams(max_tokens=4, temperature=0))[0]
    assert o3.num_cached_tokens < 28 and o3.token_ids == o2.token_ids
    check_exact(model, eng, p2, o3)
    eng.reset_prefix_cache()  # e.g. after a weight update
    assert eng.generate([p2], SamplingParams(max_tokens=1, temperature=0))[0].num_cached_tokens == 0
    eng.check_pool()


def test_default_block_sizes_hit_inside_a_6144_block(model):
    """512-token keys inside a 6144-token page: the hit lands at 1024, a multiple of 512 inside page 0."""
    rng = random.Random(3)
    eng = Engine(model, EngineConfig(num_pages=8, record_logits=True, max_num_batched_tokens=2048))
    p1 = rand_tokens(rng, 1100)
    o1 = eng.generate([p1], SamplingParams(max_tokens=3, temperature=0))[0]
    p2 = p1 + o1.token_ids + rand_tokens(rng, 40)
    o2 = eng.generate([p2], SamplingParams(max_tokens=3, temperature=0))[0]
    assert o2.num_cached_tokens == 1024
    check_exact(model, eng, p2, o2)


def test_host_tier_round_trip(model):
    rng = random.Random(4)
    eng = engine(model, num_pages=10, host_cache_bytes=64 << 20)
    p1 = rand_tokens(rng, 37)
    o1 = eng.generate([p1], SamplingParams(max_tokens=6, temperature=0))[0]
    for _ in range(4):  # unrelated traffic evicts p1's pages to host memory
        eng.generate([rand_tokens(rng, 40)], SamplingParams(max_tokens=4, temperature=0))
    hashes = []
    extend_hashes(hashes, p1, H)
    assert hashes[0] not in eng.cache.mla and hashes[0] in eng.cache.host.mla
    p2 = p1 + o1.token_ids + rand_tokens(rng, 3)
    o2 = eng.generate([p2], SamplingParams(max_tokens=5, temperature=0))[0]
    assert o2.num_cached_tokens == (len(p1) + 5) // H * H and eng.cache.host.loads > 0
    check_exact(model, eng, p2, o2)
    eng.check_pool()


def test_chained_keys_and_lookup_rules(model):
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert chain_hash(chain_hash(b"r", a), b) != chain_hash(chain_hash(b"r", b), b)  # a key names its prefix
    hs = []
    extend_hashes(hs, a + b + [9], H)
    assert len(hs) == 2 and hs[1] == chain_hash(hs[0], b)
    eng = engine(model)
    p = list(range(100, 122))  # 22 tokens: blocks at 4..20, checkpoint at 20
    eng.generate([p], SamplingParams(max_tokens=1, temperature=0))
    hashes = []
    extend_hashes(hashes, p, H)
    hit = eng.cache.lookup(hashes, len(p))
    assert hit.num_tokens == 20 and len(hit.full_pages) == 1 and hit.partial[1] == 4
    assert eng.cache.lookup(hashes[:5], 21).num_tokens == 20  # 21 tokens: L ≤ 20
    assert eng.cache.lookup(hashes[:4], 20).num_tokens == 0  # needs one token to compute; no ckpt below


def test_cache_affinity_admits_the_longest_hit_first_with_aging(model):
    rng = random.Random(5)
    eng = engine(model, max_num_seqs=1, affinity_window=3)
    shared = rand_tokens(rng, 30)
    eng.generate([shared], SamplingParams(max_tokens=2, temperature=0))  # checkpoint at 28
    sp = SamplingParams(max_tokens=2, temperature=0)
    cold = [eng.submit(rand_tokens(rng, 20), sp) for _ in range(3)]
    warm = eng.submit(shared[:29] + [1, 2, 3], sp)  # 4th in the queue: outside the first window of 3
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    # the head runs first (nothing in the window hits); then the window reaches `warm`, which jumps the queue
    assert order == [cold[0], warm, cold[1], cold[2]]
    hot = [eng.submit(rand_tokens(rng, 20), sp)] + [eng.submit(shared[:29] + [k], sp) for k in range(4)]
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    # the cache hits jump ahead of the cold head, which runs once it has been skipped `window` times
    assert order == hot[1:4] + [hot[0], hot[4]]


def test_checkpoint_interval_keeps_extra_checkpoints(model):
    rng = random.Random(6)
    p = rand_tokens(rng, 30)
    branch = p[:21] + rand_tokens(rng, 6)
    for interval, want in ((0, 0), (2, 16)):
        eng = engine(model, checkpoint_interval=interval)
        eng.generate([p], SamplingParams(max_tokens=1, temperature=0))
        out = eng.generate([branch], SamplingParams(max_tokens=3, temperature=0))[0]
        assert out.num_cached_tokens == want
        if want:
            check_exact(model, eng, branch, out)


def test_identical_prompts_wait_for_the_first_ones_checkpoint(model):
    """An RL group: the same prompt submitted G times at once is prefilled once; the others restore the
    end-of-prompt checkpoint as soon as it is stored (and produce the same greedy tokens)."""
    rng = random.Random(7)
    p = rand_tokens(rng, 30)
    eng = engine(model)
    other = rand_tokens(rng, 9)
    outs = eng.generate([p] * 4 + [other], SamplingParams(max_tokens=5, temperature=0))
    assert [o.num_cached_tokens for o in outs] == [0, 28, 28, 28, 0]
    assert all(o.token_ids == outs[0].token_ids for o in outs[:4])
    for o in outs[1:4]:
        check_exact(model, eng, p, o)


def test_checkpoints_inside_a_chunk_are_stored_without_cutting_it(model):
    """`checkpoints_in_chunks`: a wanted KDA checkpoint a multiple of 16 tokens into a prefill chunk is written
    by the forward itself (`states_at`): one forward instead of two. Its slot holds what a forward cut at that
    position leaves (fp32 state and conv window, against the default cut path), and a later request restores
    it exactly."""
    rng = random.Random(8)
    p = rand_tokens(rng, 35)  # wanted checkpoints: {(35-1)//4·4, 35//4·4} = {32}, 32 = 2·16 tokens in
    key = None
    slot = {}
    for cut in (False, True):
        eng = engine(model, checkpoints_in_chunks=not cut)  # cut: every checkpoint position ends a chunk
        eng.generate([p], SamplingParams(max_tokens=1, temperature=0))
        assert eng.num_steps == (2 if cut else 1)
        hashes = []
        extend_hashes(hashes, p, H)
        key = hashes[32 // H - 1]
        page = eng.cache.ckpt[key]
        slot[cut] = (eng.pool.state[page].clone(), eng.pool.conv[page].clone())
        if not cut:
            branch = p[:33] + rand_tokens(rng, 5)
            out = eng.generate([branch], SamplingParams(max_tokens=4, temperature=0))[0]
            assert out.num_cached_tokens == 32
            check_exact(model, eng, branch, out)
            assert eng.pool.num_free + len(eng.cache.lru) >= eng.pool.num_pages - 2  # no slot leaked
    (s_in, c_in), (s_cut, c_cut) = slot[False], slot[True]
    assert (s_in - s_cut).abs().max() <= 1e-5 * s_cut.abs().max() and s_cut.abs().max() > 0
    assert (c_in - c_cut).abs().max() <= 1e-6 * c_cut.abs().max() and c_cut.abs().max() > 0


def test_eviction_skips_held_pages_once():
    """evict_one takes the least recently used page only the cache holds; pages running sequences still hold
    are passed over and moved to the back, so later scans do not walk them again; none evictable: False."""
    from k3.serve.prefix_cache import PrefixCache

    class Pool:  # the two members the cache's eviction uses
        def __init__(self, refs):
            self.refcount = dict(refs)

        def decref(self, p):
            self.refcount[p] -= 1

    pool = Pool({0: 2, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1})  # 0-2 also held by sequences, 3-5 by the cache only
    c = PrefixCache(pool, 16, 64)
    for p in range(6):
        key = bytes([p])
        c.mla[key], c.page_keys[p], c.lru[p] = (p, 16), [key], None
    assert c.evict_one() and list(c.lru) == [4, 5, 0, 1, 2] and pool.refcount[3] == 0 and bytes([3]) not in c.mla
    assert c.evict_one() and list(c.lru) == [5, 0, 1, 2]
    assert c.evict_one() and list(c.lru) == [0, 1, 2] and c.evictions == 3
    assert not c.evict_one() and list(c.lru) == [0, 1, 2]  # every page still held: nothing to evict
    pool.refcount[1] = 1  # a sequence let go of page 1
    assert c.evict_one() and list(c.lru) == [2, 0] and pool.refcount[1] == 0
