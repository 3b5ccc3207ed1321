"""`k3.ops.l2_prefetch`: the plan's order (recorded weights, prefetches `ahead` projections later, a capture that
departs stops), `linear` reporting its weights, and (CUDA) an engine whose graphs carry the prefetches giving the
tokens and logits of the engine without them, bitwise (a prefetch is a hint: it changes no value)."""

import random

import pytest
import torch

from conftest import make_tiny
from k3.ops import gemv, l2_prefetch
from k3.ops.l2_prefetch import PrefetchPlan, capturing, recording

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8 + i, 16, generator=g) for i in range(n)]


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_plan_prefetches_each_weight_ahead_projections_early(ahead):
    ws = _weights(6)
    issued = []
    plan = PrefetchPlan(ahead, issue=issued.append)
    with recording(plan):
        for w in ws:
            l2_prefetch.note(w)
    assert plan.weights == ws and not issued
    counts = []
    with capturing(plan, side=False):
        for w in ws:
            l2_prefetch.note(w)
            counts.append(len(issued))
    # call 0 asks for weights 1..ahead, call j for weight j + ahead: every weight but the first, once, in order
    want = list(range(1, len(ws)))
    assert [next(i for i, t in enumerate(ws) if t is x) for x in issued] == want
    assert counts == [min(len(ws) - 1, j + ahead) for j in range(len(ws))]
    assert plan.issued == len(want) and not plan.departed
    l2_prefetch.note(ws[0])  # outside a plan: nothing
    assert len(issued) == len(want)


def test_plan_skips_large_or_strided_weights_and_stops_when_the_capture_departs(monkeypatch):
    ws = _weights(5, seed=1)
    ws[2] = ws[2].t()  # not contiguous: skipped
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", ws[4].numel() * 4 - 1)  # the last one over the limit
    issued = []
    plan = PrefetchPlan(1, issue=issued.append)
    with recording(plan):
        for w in ws:
            l2_prefetch.note(w)
    with capturing(plan, side=False):
        for w in ws:
            l2_prefetch.note(w)
    assert len(issued) == 2 and issued[0] is ws[1] and issued[1] is ws[3]
    issued.clear()
    with capturing(plan, side=False):  # another weight at call 1: the rest of the capture has no prefetches
        l2_prefetch.note(ws[0])
        l2_prefetch.note(ws[3])
        l2_prefetch.note(ws[2])
    assert plan.departed and len(issued) == 1 and issued[0] is ws[1]  # call 0's prefetch only


def test_plan_rejects_a_bad_distance():
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="ahead"):
            PrefetchPlan(bad)


def test_linear_reports_its_weights_in_order():
    """`linear` and `linear_fp32_tail` are where a forward's projections meet the plan."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, generator=g)
    ws = _weights(3, seed=3)
    plan = PrefetchPlan(1, issue=lambda w: None)
    with torch.no_grad(), recording(plan):
        for w in ws:
            gemv.linear(x, w)
    assert plan.weights == ws


@cuda
@pytest.mark.cuda
def test_cuda_engine_with_l2_prefetch_equals_the_engine_without(monkeypatch):
    """bf16 engine, CUDA graphs (decode, extend, prefill): with the prefetch kernels captured beside every forward,
    the same tokens and logits, bitwise; the graphs did get prefetches."""
    from k3.serve import Engine, EngineConfig, SamplingParams

    model = make_tiny(seed=19).cuda().to(torch.bfloat16).eval()
    rng = random.Random(19)
    shared = [rng.randrange(4000) for _ in range(40)]
    prompts = [shared + [rng.randrange(4000) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    prompts += [[rng.randrange(4000) for _ in range(rng.randrange(2, 300))] for _ in range(3)]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(l2_prefetch, "ON", on)
        eng = Engine(model, EngineConfig(block_size=32, hash_block_size=16, num_pages=128, max_num_seqs=8,
                                         record_logits=True))
        assert eng.runner.use_graphs
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outs = eng.generate(prompts[:1], sp) + eng.generate(prompts[1:], sp)
        runs.append((outs, eng))
        eng.check_pool()
        assert (sum(g.prefetches for g in eng.runner.graphs.values() if g is not None) > 0) == on
    (oa, ea), (ob, eb) = runs
    for a, b in zip(oa, ob):
        assert a.token_ids == b.token_ids
        x, y = ea.recorded_logits[a.request_id], eb.recorded_logits[b.request_id]
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))


@cuda
@pytest.mark.cuda
def test_cuda_l2_prefetch_changes_nothing():
    w = torch.randn(1000, 333, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    l2_prefetch.l2_prefetch(w)
    l2_prefetch.l2_prefetch(w[7:])  # an unaligned start and length
    torch.cuda.synchronize()
    assert torch.equal(w, before)
