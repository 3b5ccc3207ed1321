"""The host work of a prefix hit before its forward, against the straightforward versions it replaced: `submit`'s id
conversion (`_valid_ids`: same arrays, same errors), the prefix keys reused from recent prompts (`RecentPrompts`:
same keys as hashing every block) and `ExtendGraph.fill` (same buffer as writing every field)."""

import itertools
import random
from array import array

import numpy as np
import pytest
import torch

from conftest import make_tiny
from k3.model.paged_cache import token_runs
from k3.ops.kda import STATES_AT_MULTIPLE
from k3.serve import Engine, EngineConfig, SamplingParams
from k3.serve.engine import _checked_ids
from k3.serve.prefix_cache import RecentPrompts, extend_hashes
from k3.serve.request import Sequence
from k3.serve.runner import ExtendGraph, SeqInput, _page_rows

ONE = SamplingParams(max_tokens=1, temperature=0)


def outcome(fn):
    try:
        return fn()
    except ValueError as e:
        return ("error", str(e))


def test_submit_converts_and_rejects_ids_as_before():
    eng = Engine(make_tiny(seed=1), EngineConfig(block_size=16, hash_block_size=4, num_pages=64))
    V = eng.text_config.vocab_size
    rng = random.Random(0)
    bad = [-1, V, V + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 2 ** 70, -2 ** 63, 1.5, "7", None, b"x",
           True, np.int64(5), np.uint64(2 ** 63), np.int64(-3), torch.tensor(4)]
    cases = [[], (), [0], [V - 1], (3, 4), b"\x01" * 8, b"\x01" * 7, "abc", 5, np.array([3, 4]), range(3)]
    for _ in range(200):
        p = [rng.randrange(V) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.7:
            for _ in range(rng.randrange(1, 3)):
                p.insert(rng.randrange(len(p) + 1), rng.choice(bad))
        cases.append(p if rng.random() < 0.8 else tuple(p))
    # each case fresh for both paths (an iterator is read once: it takes the old path)
    makers = [lambda c=c: c for c in cases] + [lambda c=c: iter(c) for c in cases if isinstance(c, list)]
    for make in makers:
        want = outcome(lambda: _checked_ids(make(), V).tolist())

        def new():
            rid = eng.submit(make(), ONE)
            seq = eng.requests.pop(rid)
            eng._inbox.remove(seq)
            assert seq.prompt_ids.typecode == "q"
            return seq.prompt_ids.tolist()
        assert outcome(new) == want, make()


def test_submit_takes_arrays_and_tensors_through_their_buffer():
    """A prompt as a NumPy array, a torch tensor or an `array.array` of any integer type: the int64 array a list of
    the same ids gives (`_checked_ids`), the same errors for empty or out-of-range ids, and a clear one for a float,
    bool or 2-D input; and the engine's tokens for it equal the list's."""
    eng = Engine(make_tiny(seed=1), EngineConfig(block_size=16, hash_block_size=4, num_pages=64))
    V = eng.text_config.vocab_size
    rng = random.Random(3)

    def submitted(ids):
        rid = eng.submit(ids, ONE)
        seq = eng.requests.pop(rid)
        eng._inbox.remove(seq)
        return seq.prompt_ids.tolist()

    for _ in range(40):
        p = [rng.randrange(V) for _ in range(rng.randrange(1, 50))]
        forms = [np.array(p), np.array(p, dtype=np.int32), np.array(p, dtype=np.uint32), torch.tensor(p),
                 torch.tensor(p, dtype=torch.int32), array("q", p), array("l", p), array("I", p),
                 np.repeat(np.array(p), 2)[::2]]  # a strided view
        if rng.random() < 0.5:  # one id out of range, negative or ≥ V
            j, bad = rng.randrange(len(p)), rng.choice([-1, -7, V, V + 3])
            p[j] = bad
            forms = [np.array(p), torch.tensor(p), array("q", p)]
        want = outcome(lambda: _checked_ids(p, V).tolist())
        for f in forms:
            assert outcome(lambda: submitted(f)) == want, (type(f), want)
    for f, msg in [(np.array([], dtype=np.int64), "empty"), (torch.tensor([], dtype=torch.long), "empty"),
                   (np.array([1.0, 2.0]), "integers, got dtype float64"), (torch.tensor([1.5]), "integers, got a"),
                   (torch.tensor([True]), "integers, got a torch.bool"), (np.array([True]), "integers, got dtype bool"),
                   (array("d", [1.0]), "typecode 'd'"),
                   (np.zeros((2, 3), dtype=np.int64), "one sequence \\(1-D\\), got shape \\(2, 3\\)"),
                   (torch.zeros(1, 4, dtype=torch.long), "got shape \\(1, 4\\)"),
                   (np.array([2 ** 63], dtype=np.uint64), f"\\[0, {V}\\), got \\[9223372036854775808\\]")]:
        with pytest.raises(ValueError, match=msg):
            eng.submit(f, ONE)
    prompt = [rng.randrange(V) for _ in range(30)]
    sp = SamplingParams(max_tokens=4, temperature=0)
    a, b = eng.generate([prompt], sp)[0], eng.generate([np.array(prompt, dtype=np.int32)], sp)[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids == prompt


@pytest.mark.parametrize("max_bytes", [64 << 20, 8 * 40], ids=["by-count", "by-bytes"])
def test_recent_prompts_give_the_keys_of_hashing_every_block(max_bytes):
    """Reused keys equal hashing every block, with entries evicted by count (3) or by bytes (40 tokens: a
    60-token prompt's blocks are not kept at all)."""
    rng = random.Random(1)
    H = 4
    bases = [[rng.randrange(50) for _ in range(60)] for _ in range(4)]
    bases.append(bases[0][:H] + [rng.randrange(50) for _ in range(56)])  # block 0 shared, then different
    recent = RecentPrompts(H, size=3, max_bytes=max_bytes)  # small: entries get evicted
    for i in range(400):
        base = rng.choice(bases)
        p = base[:rng.randrange(0, 61)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        if not p:
            continue
        if rng.random() < 0.2 and len(p) > H:  # one token changed inside the shared part
            j = rng.randrange(len(p))
            p[j] = (p[j] + 1) % 50
        seq = Sequence(request_id=str(i), prompt_ids=array("q", p), params=ONE, eos=())
        recent.extend(seq.hashes, seq)
        want = []
        extend_hashes(want, p, H)
        assert seq.hashes == want
        for _ in range(rng.randrange(0, 10)):  # decode: the blocks it completes are hashed one by one
            seq.output.append(rng.randrange(50))
            recent.extend(seq.hashes, seq)
        extend_hashes(want, p + seq.output, H)
        assert seq.hashes == want
        assert len(recent.keys) <= 3 and recent.bytes == sum(len(b) for b, _ in recent.keys.values()) <= max_bytes


def test_recent_prompts_hash_only_the_blocks_not_shared(monkeypatch):
    from k3.serve import prefix_cache
    calls = []
    real = prefix_cache.chain_hash
    monkeypatch.setattr(prefix_cache, "chain_hash", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    H, recent = 4, RecentPrompts(4)
    prefix = list(range(100, 140))  # 10 blocks

    def hashed(p):
        calls.clear()
        seq = Sequence(request_id="x", prompt_ids=array("q", p), params=ONE, eos=())
        recent.extend(seq.hashes, seq)
        n = len(calls)
        want = []
        extend_hashes(want, p, H)
        assert seq.hashes == want
        return n
    assert hashed(prefix + [1, 2]) == 10
    assert hashed(prefix + [3, 4, 5]) == 0       # every block shared
    assert hashed(prefix + [6, 7, 8, 9]) == 1    # one new block
    assert hashed(prefix[:21] + [0] * 19) == 5   # differs inside block 5: blocks 5..9 hashed
    assert hashed(prefix[:8]) == 0               # a shorter prompt: its 2 blocks are shared


def test_prefix_hits_equal_with_and_without_recent_prompts():
    """The engine's hits and outputs do not depend on the reused keys (a size-0 memo keeps nothing)."""
    model = make_tiny(seed=2)
    rng = random.Random(2)
    shared = [rng.randrange(4000) for _ in range(37)]
    prompts = [shared[:rng.randrange(5, 38)] + [rng.randrange(4000) for _ in range(rng.randrange(0, 7))]
               for _ in range(12)]
    res = []
    for size in (32, 0):
        eng = Engine(model, EngineConfig(block_size=16, hash_block_size=4, num_pages=120))
        eng.cache.recent.size = size
        outs = [eng.generate([p], SamplingParams(max_tokens=3, temperature=0))[0] for p in prompts]
        res.append([(o.num_cached_tokens, o.token_ids) for o in outs])
        assert (len(eng.cache.recent.keys) > 0) == (size > 0)
    assert res[0] == res[1]
    assert any(c > 0 for c, _ in res[0])


def reference_fill(g: ExtendGraph, seqs, scratch) -> np.ndarray:
    """`ExtendGraph.fill` as it was: every field written in place; the int32 run tables from the device function
    (`token_runs` over the bounds)."""
    t = np.zeros_like(g.host_np)
    f = g.fields(t)
    ids, src, pos, tdoc, cu = f["ids"], f["src"], f["pos"], f["tdoc"], f["cu"]
    k = len(seqs)
    lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, count=k)
    m = int(lens.sum())
    cu[0] = 0
    np.cumsum(lens, out=cu[1:k + 1])
    cu[k + 1:] = m
    ids[m:], src[:], pos[m:], tdoc[m:] = 0, -1, 0, g.seqs
    f["slots"][k:], f["table"][k:] = scratch[0], scratch[1]
    if k:
        ids[:m] = np.fromiter(itertools.chain.from_iterable(s.tokens for s in seqs), np.int64, count=m)
        td = np.repeat(np.arange(k), lens)
        tdoc[:m] = td
        starts = np.fromiter((s.start for s in seqs), np.int64, count=k)
        pos[:m] = np.arange(m) - cu[td] + starts[td]
        for j, s in enumerate(seqs):
            if s.src >= 0:
                src[cu[j]] = s.src
        f["slots"][:k] = [s.state_page for s in seqs]
        _page_rows(f["table"], seqs, scratch[1])
    runs, first = token_runs(torch.from_numpy(cu.copy()), g.tokens, STATES_AT_MULTIPLE, first=True)
    f["runs"][:], f["first"][:], f["cu32"][:] = runs.numpy(), first.numpy(), cu
    return t


@pytest.mark.parametrize("tokens,nseq,pages", [(16, 1, 1), (64, 4, 3), (128, 8, 6)])
def test_extend_fill_equals_writing_every_field(tokens, nseq, pages):
    g = ExtendGraph.__new__(ExtendGraph)  # the buffer alone: no runner, no capture
    g.tokens, g.seqs, g.pages, g._pad_for, g._arange = tokens, nseq, pages, None, np.arange(max(tokens, nseq))
    g.runs = tokens // STATES_AT_MULTIPLE + nseq + 1
    g.i32 = -(-(2 * g.runs + 2 * nseq + 1) // 2)
    g.host_np = np.full(g.buffer_words(), 12345, dtype=np.int64)
    g.host_f = g.fields(g.host_np)
    rng = random.Random(tokens)
    for scratch in [(7, 9)] * 30 + [(3, 4)] * 5:
        k = rng.randrange(0, nseq + 1)
        lens = [rng.randrange(0, 2 * tokens // max(k, 1)) for _ in range(k)]
        while sum(lens) > tokens:
            lens[rng.randrange(k)] //= 2
        seqs = [SeqInput(tokens=[rng.randrange(1000) for _ in range(n)], start=rng.randrange(500),
                         state_page=rng.randrange(20), mla_pages=[rng.randrange(20) for _ in range(rng.randrange(8))],
                         want_logits=True, src=rng.choice([-1, -1, rng.randrange(8)]) if n == 1 else -1)
                for n in lens]
        g.fill(seqs, scratch)
        assert np.array_equal(g.host_np, reference_fill(g, seqs, scratch)), (lens, scratch)
