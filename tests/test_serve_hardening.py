"""Hardening of `k3 serve` below the HTTP layer (issue 17): sampling that cannot be broken by a request's
parameters, per-request failure isolation, round-robin admission between requests, strict JSON bodies and a
body limit enforced while the body streams in. The hostile-request suite against a real server is in
test_serve_hostile.py."""

import asyncio
import json
import random
import threading
import time
from array import array

import pytest
import torch

from k3.serve.driver import EngineDriver, RequestFailed
from k3.serve.errors import APIError
from k3.serve.json_body import json_depth, parse_json
from k3.serve.request import RequestOutput, SamplingParams, Sequence
from k3.serve.sampling import SamplingError, filter_probs, sample, sample_rows
from k3.serve.scheduler import Scheduler


def _logits(n, V=50, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


# ----------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("t", [1e-50, 1e-40, 5e-324, 1e-30])
def test_tiny_temperature_samples_the_argmax(t):
    """The T → 0 limit of softmax(logits / T) is the argmax; before the fix 1e-50 became 0 in fp32 and the
    probabilities NaN (multinomial raised, failing every request in the batch)."""
    x = _logits(8)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
              for p, k, s in [(1.0, 0, None), (0.5, 0, 3), (1.0, 5, None), (0.9, 3, 7)] * 2]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    toks, lps = sample(x, params, gens)
    assert toks == x.argmax(-1).tolist()
    ref = torch.log_softmax(x.double(), -1).gather(-1, x.argmax(-1, keepdim=True))[:, 0]
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, rtol=0, atol=1e-5)


def test_filter_probs_equals_the_textbook_softmax():
    """Subtracting the row max before dividing by T changes nothing but rounding (fp64 reference, 1e-6)."""
    x = _logits(6, 200, seed=1)
    temps, ks, ps = [0.05, 0.3, 1.0, 1.7, 2.0, 1e-3], [0, 0, 7, 0, 20, 0], [1.0, 0.8, 1.0, 0.95, 1.0, 1.0]
    got = filter_probs(x, temps, ks, ps)
    for i, (t, k, p) in enumerate(zip(temps, ks, ps)):
        ref = torch.softmax(x[i].double() / t, -1)
        sp, si = ref.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < p
        if k:
            keep &= torch.arange(len(sp)) < k
        want = torch.zeros_like(ref).scatter(0, si, sp * keep)
        torch.testing.assert_close(got[i].double(), want / want.sum(), rtol=0, atol=1e-6)


def test_non_finite_rows_fail_alone():
    """A row with NaN / +inf logits (or only -inf) is reported; every other row is sampled exactly as it would
    be alone (same seeds, same tokens); -inf entries alone are masked tokens, not a failure. `sample` raises
    SamplingError naming the rows without advancing any generator."""
    x = _logits(7, seed=2)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    x[5] = float("-inf")
    x[6, :40] = float("-inf")                       # masked vocabulary: valid, samples among the last 10
    params = [SamplingParams(temperature=tt, seed=s) for tt, s in
              [(0.8, 11), (0.8, 12), (0, None), (1.0, 13), (1e-50, None), (1.0, 14), (1.3, 15)]]

    def gens():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    toks, lps, failed = sample_rows(x, params, gens())
    assert failed == [1, 3, 5]
    assert [toks[i] for i in failed] == [-1, -1, -1] and all(lps[i] != lps[i] for i in failed)
    good = [0, 2, 4, 6]
    g = gens()
    alone, alone_lp = sample(x[good], [params[i] for i in good], [g[i] for i in good])
    assert [toks[i] for i in good] == alone and toks[6] >= 40
    torch.testing.assert_close(torch.tensor([lps[i] for i in good]), torch.tensor(alone_lp), rtol=0, atol=0)
    g = gens()
    states = [None if q is None else q.get_state() for q in g]
    with pytest.raises(SamplingError) as e:
        sample(x, params, g)
    assert e.value.rows == [1, 3, 5] and all(a is params[i] for a, i in zip(e.value.params, [1, 3, 5]))
    assert all(q is None or torch.equal(q.get_state(), s) for q, s in zip(g, states))


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1e-300, True, "1"])
def test_sampling_params_reject_non_finite_temperature(t):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=t)


# ----------------------------------------------------------------------------------------------- fairness

class _Layout:
    block_size = 16


class _Pool:
    """The page-pool surface the scheduler uses, as plain counters."""

    def __init__(self, n):
        self.layout = _Layout()
        self.free = list(range(n))
        self.ref = [0] * n

    @property
    def num_free(self):
        return len(self.free)

    def allocate(self):
        p = self.free.pop()
        self.ref[p] = 1
        return p

    def incref(self, p):
        self.ref[p] += 1

    def decref(self, p):
        self.ref[p] -= 1
        if not self.ref[p]:
            self.free.append(p)

    def zero_slot(self, p):
        pass


def _admissions(groups, max_num_seqs=1, preempt_first=None):
    """Admission order of sequences (named by group + index) when each runs alone and finishes at once."""
    sched = Scheduler(_Pool(64), None, 16, max_num_seqs, 64)
    for name, g in groups:
        sched.waiting.append(Sequence(request_id=name, prompt_ids=array("q", [1, 2, 3, 4]), params=SamplingParams(), eos=(),
                                      group=g))
    if preempt_first is not None:
        seq = next(s for s in sched.waiting if s.request_id == preempt_first)
        seq.preempted = 1
    order = []
    while sched.waiting:
        work = sched.schedule()
        assert work and len(sched.running) <= max_num_seqs
        for w in work:
            order.append(w.seq.request_id)
            sched.remove(w.seq)
    return order


def test_sequence_token_views_equal_the_list():
    """A sequence keeps its prompt as the int64 array `Engine.submit` checked and builds the list only on demand:
    token_slice, input_ids, token_bytes, num_tokens and tokens equal those of prompt + output at every start /
    length, before and after the list exists; the outputs' prompt is a copy, so editing it leaves the engine's
    prompt alone."""
    rng = random.Random(3)
    prompt = [rng.randrange(1 << 40) for _ in range(37)]
    seq = Sequence(request_id="s", prompt_ids=array("q", prompt), params=SamplingParams(), eos=())
    seq.output = [rng.randrange(100) for _ in range(9)]
    full = prompt + seq.output
    for built in (False, True):
        assert (seq._prompt is not None) == built
        assert seq.num_tokens == len(full)
        for start in range(len(full) + 1):
            for n in (0, 1, 5, 40, 60):
                assert seq.token_slice(start, n) == full[start:start + n], (built, start, n)
                ids = seq.input_ids(start, n)  # a forward's input: an int64 array inside the prompt
                assert list(ids) == full[start:start + n], (built, start, n)
                assert isinstance(ids, array) == (start + n <= len(prompt)), (start, n)
                end = min(start + n, len(full))
                assert array("q", seq.token_bytes(start, end)).tolist() == full[start:end]
        assert seq.tokens == full
    out = seq.output_prompt()
    assert out == prompt and out is seq.output_prompt()
    out.append(-1)
    assert seq.prompt == prompt and seq.token_slice(0, 40) == full[:40]
    with pytest.raises(TypeError, match="prompt_ids"):
        Sequence(request_id="t", prompt_ids=prompt, params=SamplingParams(), eos=())


def test_admission_is_round_robin_between_groups():
    """One request of many sequences cannot delay another request by more than one sequence per group; before
    the fix admission was FIFO (the small request waited for the whole big one)."""
    big = [(f"A{i}", "A") for i in range(6)]
    assert _admissions(big + [("B0", "B"), ("B1", "B"), ("C0", "C")]) == \
        ["A0", "B0", "C0", "A1", "B1", "A2", "A3", "A4", "A5"]
    # a group admitted recently goes after a waiting group that was not (its turn came)
    assert _admissions(big[:2] + [("B0", "B")], max_num_seqs=2) == ["A0", "B0", "A1"]
    # preempted sequences go first (and use their group's turn); ungrouped sequences stay in arrival order
    assert _admissions(big[:3] + [("B0", "B")], preempt_first="A2") == ["A2", "B0", "A0", "A1"]
    plain = [(f"r{i}", None) for i in range(5)]
    assert _admissions(plain) == [f"r{i}" for i in range(5)]


# ----------------------------------------------------------------------------------------------- driver

class _PoisonEngine:
    """Engine test double that samples with the real `sample()` over random logits; a request whose prompt
    starts with token 0 gets NaN logits (a model blow-up) each step."""

    def __init__(self):
        self.live, self.lock, self.aborted = {}, threading.Lock(), []

    def submit(self, prompt, params, request_id=None, group=None):
        with self.lock:
            self.live[request_id] = (list(prompt), params, [])
        return request_id

    def has_unfinished(self):
        with self.lock:
            return bool(self.live)

    def step(self):
        time.sleep(0.001)
        with self.lock:
            items = list(self.live.items())
        x = _logits(len(items), seed=len(items))
        for i, (_, (p, _, _)) in enumerate(items):
            if p[0] == 0:
                x[i, 5] = float("nan")
        toks, _ = sample(x, [v[1] for _, v in items], [None] * len(items))  # raises SamplingError
        outs = []
        with self.lock:
            for (rid, (p, sp, out)), t in zip(items, toks):
                out.append(t)
                done = len(out) >= sp.max_tokens
                if done:
                    del self.live[rid]
                outs.append(RequestOutput(rid, p, list(out), [t], None, done, "length" if done else None, 0))
        return outs

    def abort(self, rid):
        with self.lock:
            self.live.pop(rid)
            self.aborted.append(rid)

    def stats(self):
        return {}


def test_driver_fails_a_poisoned_request_alone():
    """Before the fix a SamplingError from engine.step failed every request in flight."""
    eng = _PoisonEngine()
    drv = EngineDriver(eng)
    drv.start()

    async def main():
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in range(4)]
        for i, q in enumerate(queues):
            prompt = [0, 1] if i == 2 else [i + 1, 1]
            await asyncio.wrap_future(drv.submit(f"r{i}", prompt, SamplingParams(max_tokens=5), loop, q))
        results = []
        for q in queues:
            while True:
                _, item = await asyncio.wait_for(q.get(), 20)
                if isinstance(item, BaseException) or item.finished:
                    results.append(item)
                    break
        return results

    try:
        res = asyncio.run(main())
    finally:
        drv.shutdown()
    assert isinstance(res[2], RequestFailed) and "not finite" in str(res[2])
    assert [r.finish_reason for i, r in enumerate(res) if i != 2] == ["length"] * 3
    assert all(len(r.token_ids) == 5 for i, r in enumerate(res) if i != 2)
    assert eng.aborted == ["r2"] and drv.pending == 0


# ----------------------------------------------------------------------------------------------- JSON bodies

def test_json_depth_and_strict_parse():
    g = random.Random(0)

    def nest(d):
        if d == 0:
            return g.choice([1, "x", None, 2.5])
        return [nest(d - 1), 3] if g.random() < 0.5 else {"k": nest(d - 1), "z": [1]}

    def ref(x):
        if isinstance(x, dict):
            x = list(x.values())
        return 1 + max((ref(y) for y in x), default=0) if isinstance(x, list) else 0

    for _ in range(50):
        obj = nest(g.randint(0, 30))
        assert json_depth(obj, 100) == ref(obj)
    assert parse_json(json.dumps({"a": nest(10)}).encode(), 64)
    for raw in (b"[" * 100_000 + b"]" * 100_000, json.dumps({"a": [[[[1]]]]}).encode(),
                b'{"t": NaN}', b'{"t": -Infinity}', b"\xff\xfe", b"[]", b"nul"):
        with pytest.raises(APIError) as e:
            parse_json(raw, max_depth=4)
        assert e.value.status == 400, raw[:20]
    assert parse_json(json.dumps({"a": [[1]]}).encode(), max_depth=3) == {"a": [[1]]}


def test_body_limit_is_enforced_while_the_body_streams():
    """A chunked body (no Content-Length) is refused once it passes the limit: at most the limit plus one
    chunk is read. Before the fix the whole body was buffered first (here 8 MiB; 400 MB in issue 17)."""
    from test_serve_api import ScriptedEngine

    from k3.io.tokenizer import default_tokenizer
    from k3 import K3Config
    from k3.serve.server import ServerLimits, create_app

    tok = default_tokenizer(K3Config.preset("k3-tiny").text_config)
    limit, chunk, total = 64 << 10, 16 << 10, 8 << 20
    app = create_app(ScriptedEngine(), tok, "m", 64, limits=ServerLimits(max_body_bytes=limit))
    pulled, sent = 0, []

    async def receive():
        nonlocal pulled
        if pulled >= total:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += chunk
        return {"type": "http.request", "body": b" " * chunk, "more_body": pulled < total}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert start["status"] == 413 and body["error"]["code"] == "request_too_large"
    assert pulled <= limit + chunk


def test_api_key_from_flag_or_environment(monkeypatch):
    import argparse

    from k3.serve.cli import add_parser, api_key

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    monkeypatch.delenv("K3_API_KEY", raising=False)
    assert api_key(p.parse_args(["serve", "--checkpoint", "x"])) is None
    monkeypatch.setenv("K3_API_KEY", "from-env")
    assert api_key(p.parse_args(["serve", "--checkpoint", "x"])) == "from-env"
    assert api_key(p.parse_args(["serve", "--checkpoint", "x", "--api-key", "flag"])) == "flag"
    monkeypatch.setenv("K3_API_KEY", "   ")
    with pytest.raises(ValueError, match="blank"):
        api_key(p.parse_args(["serve", "--checkpoint", "x"]))
