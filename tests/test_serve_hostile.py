"""Hostile requests against a real `k3 serve` (uvicorn on 127.0.0.1, a random-weight k3-tiny Engine):
a table of attacks that must each get a 4xx (never a 5xx) while good requests running at the same time
still complete with the right tokens; a tiny temperature; 429 + Retry-After at capacity; round-robin
fairness between requests; an API key. Issue 17 items 1, 3, 4, 7, 8.

`K3_LONG_TESTS=1` adds a load run: 64 clients mixing good, hostile and abandoned requests."""

import concurrent.futures
import json
import os
import random
import threading
import time

import httpx
import pytest
import torch

from conftest import make_tiny
from test_serve_api import _Uvicorn
from k3 import K3Config
from k3.io.tokenizer import default_tokenizer
from k3.serve import Engine, EngineConfig
from k3.serve.server import ServerLimits, create_app

MODEL, KEY, MAX_LEN = "k3-tiny", "sk-hostile-test", 384
LIMIT = 64 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}





@pytest.fixture(scope="module")
def tok():
    return default_tokenizer(K3Config.preset("k3-tiny").text_config)


@pytest.fixture(scope="module")
def model():
    return make_tiny(0)


@pytest.fixture(scope="module")
def server(tok, model):
    engine = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=64, max_model_len=MAX_LEN,
                                        max_num_seqs=4))
    limits = ServerLimits(max_body_bytes=LIMIT, max_choices_per_request=16, max_pending=24, retry_after_s=2)
    with _Uvicorn(create_app(engine, tok, MODEL, MAX_LEN, limits=limits, api_key=KEY)) as srv:
        yield srv, engine


def _greedy_text(model, tok, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, temperature=0.0)[0, len(ids):].tolist()
    specials = set(tok.special_tokens.values())
    return tok.decode([t for t in out if t not in specials])


def _good(srv, ids, n, temperature=0.0):
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": temperature,
                         "ignore_eos": True})
    return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)


def _nested(depth):
    return "[" * depth + "]" * depth


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
C, P = "/v1/chat/completions", "/v1/completions"


def _raw(body):
    return body if isinstance(body, bytes) else json.dumps(body).encode()


# (name, path, headers, body (dict or raw bytes), expected status)
HOSTILE = [
    ("no api key", C, JSON, CHAT, 401),
    ("wrong api key", C, JSON | {"Authorization": "Bearer sk-wrong"}, CHAT, 401),
    ("key without scheme", C, JSON | {"Authorization": KEY}, CHAT, 401),
    ("basic auth", C, JSON | {"Authorization": "Basic c2staG9zdGlsZS10ZXN0Og=="}, CHAT, 401),
    ("key as prefix", C, JSON | {"Authorization": f"Bearer {KEY}x"}, CHAT, 401),
    ("metrics without key", "/metrics", {}, None, 401),
    ("text/plain body", C, AUTH | {"Content-Type": "text/plain"}, CHAT, 415),
    ("form body", C, AUTH | {"Content-Type": "application/x-www-form-urlencoded"}, b"a=1", 415),
    ("multipart body", P, AUTH | {"Content-Type": "multipart/form-data; boundary=x"}, b"--x--", 415),
    ("no content type", P, AUTH, COMP, 415),
    ("json-ish content type", P, AUTH | {"Content-Type": "application/jsonp"}, COMP, 415),
    ("Content-Length over the limit", P, AUTH | JSON, COMP | {"user": "x" * LIMIT}, 413),
    ("nested arrays, 30k deep", C, AUTH | JSON, _nested(30_000).encode(), 400),
    ("nested objects in a field, 2k deep", C, AUTH | JSON,
     json.dumps(CHAT)[:-1].encode() + b', "metadata": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}", 400),
    ("nested tool schema, 200 deep", C, AUTH | JSON, json.dumps(CHAT | {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a":' * 200 + "1" + "}" * 200)}}]}).encode(), 400),
    ("NaN temperature", C, AUTH | JSON, _raw(CHAT)[:-1] + b', "temperature": NaN}', 400),
    ("Infinity top_p", P, AUTH | JSON, _raw(COMP)[:-1] + b', "top_p": Infinity}', 400),
    ("-Infinity max_tokens", P, AUTH | JSON, _raw(COMP)[:-1] + b', "max_tokens": -Infinity}', 400),
    ("huge integer temperature", P, AUTH | JSON, _raw(COMP)[:-1] + b', "temperature": ' + b"9" * 400 + b"}", 400),
    ("huge max_tokens", P, AUTH | JSON, COMP | {"max_tokens": 10 ** 30}, 400),
    ("token id out of range", P, AUTH | JSON, COMP | {"prompt": [1, 2 ** 70]}, 400),
    ("negative token id", P, AUTH | JSON, COMP | {"prompt": [-5]}, 400),
    ("prompts x n over the cap", P, AUTH | JSON, COMP | {"prompt": ["a", "b", "c", "d", "e"], "n": 4}, 400),
    ("300 prompts x n=16", P, AUTH | JSON, COMP | {"prompt": ["a b"] * 300, "n": 16}, 400),
    ("n = 17", C, AUTH | JSON, CHAT | {"n": 17}, 400),
    ("invalid UTF-8", C, AUTH | JSON, b'{"model": "\xff\xfe"}', 400),
    ("lone surrogate in content", C, AUTH | JSON,
     b'{"model": "k3-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}', None),
    ("lone surrogate in prompt", P, AUTH | JSON, b'{"model": "k3-tiny", "max_tokens": 2, "prompt": "a\\udfff"}',
     None),
    ("empty body", C, AUTH | JSON, b"", 400),
    ("null body", C, AUTH | JSON, b"null", 400),
    ("array body", C, AUTH | JSON, b"[1]", 400),
    ("truncated JSON", C, AUTH | JSON, _raw(CHAT)[:-3], 400),
    ("17 stop strings", C, AUTH | JSON, CHAT | {"stop": ["x"] * 17}, 400),
    ("empty stop string", P, AUTH | JSON, COMP | {"stop": [""]}, 400),
    ("seed 2**63", P, AUTH | JSON, COMP | {"seed": 2 ** 63}, 400),
    ("temperature as string", P, AUTH | JSON, COMP | {"temperature": "0"}, 400),
    ("temperature as bool", P, AUTH | JSON, COMP | {"temperature": True}, 400),
    ("max_tokens as float", P, AUTH | JSON, COMP | {"max_tokens": 2.0}, 400),
    ("context overflow", C, AUTH | JSON, CHAT | {"max_tokens": MAX_LEN}, 400),
    ("prompt over the context", P, AUTH | JSON, COMP | {"prompt": list(range(1, MAX_LEN + 5))}, 400),
    ("unknown field", C, AUTH | JSON, CHAT | {"functions": []}, 400),
    ("unknown model", C, AUTH | JSON, CHAT | {"model": "gpt-4o" * 1000}, 404),
    ("GET on a POST route", C, AUTH, None, 405),
    ("unknown route", "/v1/../../etc/passwd", AUTH, None, 404),
    ("tool message without its call", C, AUTH | JSON,
     CHAT | {"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]}, 400),
    ("1000 messages", C, AUTH | JSON, CHAT | {"messages": [{"role": "user", "content": "hi"}] * 1000}, 400),
    ("logprobs 20", P, AUTH | JSON, COMP | {"logprobs": 20}, 400),
    ("content-type with charset", C, AUTH | {"Content-Type": "application/json; charset=utf-8"}, CHAT, 200),
    ("bearer scheme in lower case", C, JSON | {"Authorization": f"bearer {KEY}"}, CHAT, 200),
    ("health without key", "/health", {}, None, 200),
]


def _send(h, path, headers, body):
    if body is None:
        return h.get(path, headers=headers)
    return h.post(path, headers=headers, content=_raw(body))


def test_hostile_requests_get_4xx_while_good_requests_complete(server, tok, model):
    srv, engine = server
    prompts = [tok.encode(t) for t in ("one two", "three four five", "six", "seven eight nine ten")]
    statuses = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(_good, srv, p, 6) for p in prompts]
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            for name, path, headers, body, want in HOSTILE:
                r = _send(h, path, headers, body)
                statuses[name] = r.status_code
                assert r.status_code < 500, (name, r.status_code, r.text[:300])
                if want is not None:
                    assert r.status_code == want, (name, r.status_code, r.text[:300])
                if r.status_code >= 400 and path != "/health":
                    err = r.json()["error"]
                    assert err["message"] and err["type"], name
                if r.status_code == 401:
                    assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text
        results = [f.result(120) for f in good]
    assert len(HOSTILE) >= 45
    for p, (status, text) in zip(prompts, results):
        assert status == 200 and text == _greedy_text(model, tok, p, 6)
    assert statuses["lone surrogate in content"] in (200, 400)


def test_chunked_body_over_the_limit(server):
    """A chunked upload of 4 MiB against a 64 KiB limit: refused (413, or the connection is closed once the
    limit is passed); the server keeps serving."""
    srv, _ = server

    def chunks():
        for _ in range(64):
            yield b" " * (64 << 10)

    try:
        r = httpx.post(srv.url + P, headers=AUTH | JSON, content=chunks(), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert _good(srv, [5, 6, 7], 2)[0] == 200


def test_tiny_temperatures_fail_no_one(server, tok, model):
    """temperature 1e-50 once failed every request in flight with a 500; now it is the greedy limit."""
    srv, _ = server
    prompts = [tok.encode(t) for t in ("alpha beta", "gamma", "delta epsilon zeta", "eta theta")]
    temps = [0.0, 1e-50, 0.0, 5e-324, 1e-40, 0.0]
    jobs = [(prompts[i % 4], t) for i, t in enumerate(temps)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        res = list(pool.map(lambda j: _good(srv, j[0], 5, j[1]), jobs))
    for (p, _), (status, text) in zip(jobs, res):
        assert status == 200 and text == _greedy_text(model, tok, p, 5)


def test_a_request_with_nan_logits_fails_alone(server, tok, model, monkeypatch):
    """A request whose logits turn NaN (a model blow-up, injected at the engine's sampler) gets a 500 of its
    own; the requests batched with it finish with their greedy tokens. Before, all of them got 500."""
    import k3.serve.engine as engine_module

    srv, _ = server
    name = "sample_device"
    real = getattr(engine_module, name)

    def poisoned(logits, params, generators, **kw):
        bad = [i for i, p in enumerate(params) if p.temperature == 0.123]
        if bad:
            logits = logits.clone()
            logits[bad, 7] = float("nan")
        return real(logits, params, generators, **kw)

    monkeypatch.setattr(engine_module, name, poisoned)
    prompts = [tok.encode(t) for t in ("iota kappa", "lambda", "mu nu xi")]
    jobs = [(p, 0.0) for p in prompts] + [(prompts[0], 0.123)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        res = list(pool.map(lambda j: _good(srv, j[0], 5, j[1]), jobs))
    for p, (status, text) in zip(prompts, res):
        assert status == 200 and text == _greedy_text(model, tok, p, 5)
    assert res[-1][0] == 500 and json.loads(res[-1][1])["error"]["code"] == "engine_error"
    assert "not finite" in res[-1][1]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


def test_capacity_answers_429_with_retry_after(server):
    srv, engine = server
    body = COMP | {"prompt": ["a b c"], "n": 16, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as h:
        with h.stream("POST", P, json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()   # keep a reference: a collected iterator closes the stream
            next(lines)
            r = h.post(P, json=body | {"stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "rate_limit_error"
            with h.stream("POST", P, json=COMP | {"n": 8, "stream": True}) as r:   # 16 + 8 fits the limit
                assert r.status_code == 200
    t0 = time.monotonic()
    while engine.has_unfinished() and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    assert not engine.has_unfinished()
    assert _good(srv, [5, 6, 7], 2)[0] == 200


def test_a_big_request_does_not_starve_a_small_one(server):
    """12 choices in waves of max_num_seqs=4, then a 2-token request: it is admitted at the next free slot
    (round-robin between requests: 4 choices finish first), not after the 12 (FIFO: at least 8 would). The
    choices are 16 tokens long so that the small request surely arrives while the first wave runs (at 4 tokens
    a fast engine could admit the second wave first, and the test failed by timing alone)."""
    srv, _ = server
    finished, started = [], threading.Event()

    def big():
        body = COMP | {"prompt": ["one", "two", "three", "four"], "n": 3, "max_tokens": 16, "ignore_eos": True,
                       "stream": True}
        with httpx.stream("POST", srv.url + P, headers=AUTH, json=body, timeout=120) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["finish_reason"]:
                            finished.append(time.monotonic())

    t = threading.Thread(target=big)
    t.start()
    assert started.wait(60)
    status, _ = _good(srv, [9, 8, 7], 2)
    done = time.monotonic()
    t.join(120)
    assert status == 200 and len(finished) == 12
    assert sum(f < done for f in finished) <= 5, sum(f < done for f in finished)


@pytest.mark.skipif(os.environ.get("K3_LONG_TESTS") != "1", reason="long load run: set K3_LONG_TESTS=1")
def test_load_64_clients_with_disconnects_and_hostile_mix(tok, model):
    """64 clients for 60 s: good requests (half streamed), ~30 % abandoned mid-way, hostile ones from the
    table. 0 server errors; afterwards nothing is running, waiting or leaked in the pool."""
    engine = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=256, max_model_len=MAX_LEN,
                                        max_num_seqs=32))
    limits = ServerLimits(max_body_bytes=LIMIT, max_choices_per_request=16, max_pending=256)
    with _Uvicorn(create_app(engine, tok, MODEL, MAX_LEN, limits=limits, api_key=KEY)) as srv:
        _load(srv, engine, tok)


def _load(srv, engine, tok):
    deadline = time.monotonic() + float(os.environ.get("K3_LOAD_SECONDS", "60"))
    errors, counts, lock = [], {}, threading.Lock()

    def client(i):
        g = random.Random(i)
        with httpx.Client(base_url=srv.url, timeout=120) as h:
            while time.monotonic() < deadline:
                kind = g.random()
                try:
                    if kind < 0.3:
                        name, path, headers, body, _ = g.choice(HOSTILE)
                        code = _send(h, path, headers, body).status_code
                    else:
                        body = COMP | {"prompt": tok.encode(g.choice(["a b", "c d e", "f"])), "ignore_eos": True,
                                       "max_tokens": g.randint(1, 24), "n": g.randint(1, 3),
                                       "temperature": g.choice([0.0, 0.7, 1e-50])}
                        if kind < 0.6:   # abandoned: read a little, then drop the connection
                            with h.stream("POST", P, headers=AUTH, json=body | {"stream": True}, timeout=5) as r:
                                code = r.status_code
                                for _ in r.iter_lines():
                                    break
                        else:
                            code = h.post(P, headers=AUTH, json=body | {"stream": g.random() < 0.5}).status_code
                except httpx.TransportError:
                    code = "transport"
                with lock:
                    counts[code] = counts.get(code, 0) + 1
                    if isinstance(code, int) and code >= 500:
                        errors.append(code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and counts.get(200, 0) > 64, counts
    t0 = time.monotonic()
    while engine.has_unfinished() and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    engine.check_pool()
    print("load run statuses:", counts)
