"""`Engine.pause` / `resume` (RL partial rollout) and `update_weights`: a paused request continued from its
host-memory state gives exactly the tokens and log-probs of an uninterrupted run (fp32, seeded sampling),
while other requests reuse its pages in between; nothing it computes after resuming enters the prefix cache."""

import copy
import random

import pytest
import torch

from conftest import make_tiny
from k3.serve import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=11).eval()


def engine(model, **kw):
    cfg = dict(block_size=32, hash_block_size=8, num_pages=48, max_num_batched_tokens=64)
    return Engine(model, EngineConfig(**(cfg | kw)))


def prompts(n, seed, lo=5, hi=50):
    rng = random.Random(seed)
    return [[rng.randrange(4000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run(eng, rids):
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[r] for r in rids]


@pytest.mark.parametrize("pause_after", [0, 1, 7, 23])
def test_paused_and_resumed_equals_uninterrupted(model, one_thread, pause_after):
    """Seeded sampling at temperature 1 (a different token anywhere shows up), several requests paused after
    `pause_after` steps (0: before admission, so no state), other traffic in between, then resumed."""
    ps = prompts(4, 1)
    sp = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, logprobs=True, ignore_eos=True)
          for i in range(len(ps))]
    ref = run(e0 := engine(model), [e0.submit(p, s) for p, s in zip(ps, sp)])
    eng = engine(model)
    rids = [eng.submit(p, s) for p, s in zip(ps, sp)]
    for _ in range(pause_after):
        eng.step()
    paused = [eng.pause(r) for r in rids[:3]]
    assert all(p.num_computed > 0 for p in paused) == (pause_after > 0)
    other = [eng.submit(p, SamplingParams(max_tokens=12, temperature=0)) for p in prompts(5, 2)]
    for _ in range(6):  # the others take the freed pages and write over them
        eng.step()
    for p in paused:
        eng.resume(p)
    outs = {o.request_id: o for o in run(eng, rids + other)}
    for r, want in zip(rids, ref):
        got = outs[r]
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= 1e-5
    eng.check_pool()
    assert eng.stats()["num_paused"] == 3


def test_pause_errors_and_pause_before_readmission(model):
    eng = engine(model)
    with pytest.raises(KeyError):
        eng.pause("nope")
    r = eng.submit(prompts(1, 3)[0], SamplingParams(max_tokens=20, temperature=0))
    for _ in range(3):
        eng.step()
    p = eng.pause(r)
    with pytest.raises(KeyError):
        eng.pause(r)
    eng.resume(p)
    with pytest.raises(ValueError, match="in flight"):
        eng.resume(p)
    p2 = eng.pause(r)  # resumed but not stepped since: the same saved state
    assert p2 is p
    eng.resume(p2)
    assert len(run(eng, [r])[0].token_ids) == 20
    with pytest.raises(ValueError, match="PausedRequest"):
        eng.resume("x")
    eng.check_pool()


def test_resumed_sequences_stay_out_of_the_prefix_cache(model):
    eng = engine(model)
    p = prompts(1, 4, 30, 31)[0]
    r = eng.submit(p, SamplingParams(max_tokens=40, temperature=0))
    for _ in range(4):
        eng.step()
    blocks = eng.stats()["prefix_cache_blocks"]
    eng.resume(eng.pause(r))
    run(eng, [r])
    assert eng.stats()["prefix_cache_blocks"] == blocks  # its decoded blocks were not registered
    eng.check_pool()


def test_update_weights_copies_in_place_and_clears_the_cache(model):
    policy = copy.deepcopy(model)
    eng = engine(copy.deepcopy(model))
    ptr = eng.model.language_model.lm_head.weight.data_ptr()
    p = prompts(1, 5)[0]
    before = run(eng, [eng.submit(p, SamplingParams(max_tokens=8, temperature=0))])[0].token_ids
    assert eng.stats()["prefix_cache_blocks"] > 0
    with torch.no_grad():
        for w in policy.parameters():
            w.add_(torch.randn_like(w) * 0.05)
    eng.update_weights(policy)
    assert eng.stats()["prefix_cache_blocks"] == 0
    assert eng.model.language_model.lm_head.weight.data_ptr() == ptr
    assert torch.equal(eng.model.language_model.lm_head.weight, policy.language_model.lm_head.weight)
    after = run(eng, [eng.submit(p, SamplingParams(max_tokens=8, temperature=0))])[0].token_ids
    direct = policy.generate(torch.tensor([p]), max_new_tokens=8)[0, len(p):].tolist()
    assert after == direct and after != before
    eng.update_weights(eng.model)  # its own model: nothing to copy
    with pytest.raises(RuntimeError):
        eng.update_weights({"nope": torch.zeros(1)})
