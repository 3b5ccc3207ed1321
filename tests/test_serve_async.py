"""Asynchronous scheduling (`EngineConfig.async_scheduling`): the next decode step is launched with its input
ids still on the device and the previous step's tokens read back while it runs. Oracle: the same engine run
synchronously (and `model.generate`); every test compares whole token / log-prob sequences (k3-tiny, fp32, CPU,
plus a CUDA check that a continuation step never waits for the device)."""


import pytest
import torch

from conftest import make_tiny, random_prompts as prompts
from k3.serve import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=5)


def engine(model, async_scheduling: bool, **kw) -> Engine:
    args = dict(block_size=16, hash_block_size=4, num_pages=96, async_scheduling=async_scheduling)
    args.update(kw)
    return Engine(model, EngineConfig(**args))


def mixed_params(n: int, stop_ids: tuple[int, ...] = ()) -> list[SamplingParams]:
    """Greedy and seeded sampling, different lengths, stop tokens: requests end at different steps."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=3 + 2 * i, temperature=0, logprobs=True, stop_token_ids=stop_ids))
        else:
            out.append(SamplingParams(max_tokens=4 + i, temperature=0.9, top_k=40, seed=100 + i, logprobs=True,
                                      stop_token_ids=stop_ids))
    return out


def run_all(eng: Engine, ps, params) -> dict:
    """Submit everything, step to the end collecting delta outputs; {prompt index: (tokens, logprobs)}."""
    rids = [eng.submit(p, sp) for p, sp in zip(ps, params)]
    got = {r: ([], []) for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.logprobs[len(o.logprobs) - len(o.new_token_ids):])
    eng.check_pool()
    return [got[r] for r in rids]


def delta(params):
    return [SamplingParams(**{**sp.__dict__, "output_kind": "delta"}) for sp in params]


@pytest.mark.parametrize("budget,pages", [(64, 96), (12, 96), (64, 14)])
def test_async_equals_sync(model, budget, pages):
    """Mixed batches (prefill chunks next to decodes at budget 12; preemption with 14 pages), greedy and seeded
    sampling, stop tokens: the asynchronous engine returns the same tokens and log-probs as the synchronous
    one, and its pool accounting holds."""
    ps = prompts(7, budget + pages)
    params = delta(mixed_params(7, stop_ids=(17, 99, 1234)))
    kw = dict(max_num_batched_tokens=budget, num_pages=pages)
    sync = run_all(engine(model, False, **kw), ps, params)
    eng = engine(model, True, **kw)
    asyn = run_all(eng, ps, params)
    assert [t for t, _ in asyn] == [t for t, _ in sync]
    for (_, a), (_, b) in zip(asyn, sync):
        assert a == pytest.approx(b, abs=1e-5)
    if pages == 14:
        assert eng.stats()["preemptions"] > 0


def test_continuation_steps_take_their_ids_from_the_device(model):
    """In a pure decode phase every step after the first is a continuation: its SeqInputs carry `src` (the
    token the host has not seen yet); greedy tokens equal `model.generate`."""
    eng = engine(model, True)
    seen = []
    real = eng.runner.forward

    def spy(inputs):
        seen.append([s.src for s in inputs])
        return real(inputs)

    eng.runner.forward = spy
    ps = prompts(3, 7, 5, 6)
    outs = eng.generate(ps, SamplingParams(max_tokens=6, temperature=0))
    for p, o in zip(ps, outs):
        assert o.token_ids == model.generate(torch.tensor([p]), max_new_tokens=6)[0, len(p):].tolist()
    continued = [s for s in seen if all(x >= 0 for x in s)]
    assert len(continued) >= 4 and sorted(continued[0]) == [0, 1, 2]


def test_pause_completes_the_token_in_flight(model):
    """Pausing while a step is in flight: the paused request keeps that token (not returned by step()), resumes
    to exactly the uninterrupted tokens, and the delta outputs add up to them with no gap or repeat."""
    ps = prompts(2, 11, 8, 9)
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=7, output_kind="delta")
    ref = engine(model, False).generate(ps, sp)
    eng = engine(model, True)
    rids = [eng.submit(p, sp) for p in ps]
    got = {r: [] for r in rids}
    for _ in range(4):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng._inflight is not None  # a step is in flight
    paused = eng.pause(rids[0])
    assert len(paused.output) == len(got[rids[0]]) + 1  # the completed in-flight token is the paused request's
    eng.resume(paused)
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert [got[r] for r in rids] == [o.token_ids for o in ref]
    eng.check_pool()


def test_abort_while_in_flight(model):
    """An abort between steps drops the request's token in flight; nothing more is returned for it, the others
    finish as alone, and the pool holds."""
    ps = prompts(3, 13, 6, 7)
    sp = SamplingParams(max_tokens=8, temperature=0)
    ref = engine(model, False).generate(ps, sp)
    eng = engine(model, True)
    rids = [eng.submit(p, sp) for p in ps]
    for _ in range(3):
        eng.step()
    out = eng.abort(rids[1])
    assert out.finish_reason == "abort" and out.token_ids == ref[1].token_ids[:len(out.token_ids)]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != rids[1]
            if o.finished:
                final[o.request_id] = o.token_ids
    assert final == {rids[0]: ref[0].token_ids, rids[2]: ref[2].token_ids}
    eng.check_pool()


def test_flush_returns_the_outputs_of_the_step_in_flight(model):
    ps = prompts(2, 17, 4, 5)
    eng = engine(model, True)
    sp = SamplingParams(max_tokens=5, temperature=0, output_kind="delta")
    rids = [eng.submit(p, sp) for p in ps]
    n = {r: 0 for r in rids}
    for _ in range(3):
        for o in eng.step():
            n[o.request_id] += len(o.new_token_ids)
    before = dict(n)
    for o in eng.flush():
        n[o.request_id] += len(o.new_token_ids)
    assert all(n[r] == before[r] + 1 for r in rids) and eng._inflight is None
    assert eng.flush() == []


def test_read_back_buffer_is_contiguous_for_every_batch():
    """The sampled ids' read-back buffer (`Engine.host_rows`) is a contiguous [2, n] for every n ≤ max_num_seqs:
    a non-blocking device→host copy into a strided slice of pinned memory goes through a pageable temporary and
    blocks the host until the forward in flight has finished (measured on the H200: the batch-1 step took
    GPU time + host time, 1.85 ms, instead of their maximum), which torch's sync debug mode does not flag."""
    m = make_tiny(seed=5).eval()
    eng = Engine(m, EngineConfig(block_size=16, hash_block_size=4, num_pages=64, max_num_seqs=8))
    for n in range(1, 9):
        for step in (0, 1):
            eng.num_steps = step
            h = eng.host_rows(n)
            assert h.shape == (2, n) and h.is_contiguous()
    eng.num_steps = 0
    a = eng.host_rows(4).data_ptr()
    eng.num_steps = 1
    assert eng.host_rows(4).data_ptr() != a  # the step in flight keeps its own buffer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_continuation_never_waits_for_the_device():
    """bf16 on CUDA with decode graphs: a continuation step issues no synchronising call before it reads the
    previous step's tokens (torch's sync debug mode would raise), and the tokens equal the synchronous
    engine's (same graphs, same inputs)."""
    m = make_tiny(seed=5).to("cuda", torch.bfloat16).eval()
    ps = prompts(4, 19, 10, 30)
    sp = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(block_size=16, hash_block_size=4, num_pages=64)
    ref = Engine(m, EngineConfig(async_scheduling=False, **kw)).generate(ps, sp)
    eng = Engine(m, EngineConfig(async_scheduling=True, **kw))
    assert eng.runner.use_graphs
    rids = [eng.submit(p, sp) for p in ps]
    for _ in range(4):  # prefill, first decodes, graph capture
        eng.step()
    order = []
    real_forward, real_finish = eng.runner.forward, eng._finish

    def forward(inputs):
        order.append(("forward", all(s.src >= 0 for s in inputs)))
        return real_forward(inputs)

    def finish(inf):
        if not order or order[-1][0] != "finish":
            torch.cuda.set_sync_debug_mode("default")  # the read-back itself waits, by design
        order.append(("finish", None))
        return real_finish(inf)

    eng.runner.forward, eng._finish = forward, finish
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert order == [("forward", True), ("finish", None)]  # launched from device ids, then read back
    eng.runner.forward, eng._finish = real_forward, real_finish
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    # outputs are cumulative by default: the final one holds every token
    assert [final[r] for r in rids] == [o.token_ids for o in ref]
