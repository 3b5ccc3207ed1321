"""OpenAI-compatible server: the official `openai` client against a real uvicorn server on 127.0.0.1.

Two servers: one over a real random-weight k3-tiny Engine (chat, streaming, usage and cached tokens,
completions, metrics, malformed requests, context limits, disconnects; greedy outputs checked against the
model's own `generate()` loop), and one over `ScriptedEngine`, a test double with the Engine API that
answers with a fixed token script, for what a random model cannot produce on demand (tool calls,
reasoning, stop strings)."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_tiny
from k3 import K3Config
from k3.io.tokenizer import default_tokenizer
from k3.io import chat
from k3.serve import Engine, EngineConfig, RequestOutput
from k3.serve.server import create_app

MAX_LEN = 512   # the official encoding adds a thinking-effort message (~60 tokens here) to every prompt
MODEL = "k3-tiny"


class _Uvicorn:
    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30 and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class ScriptedEngine:
    """Engine API test double: each request emits the next queued token script, one token per step,
    honouring max_tokens and stop_token_ids like the real engine (stop token kept in the output)."""

    def __init__(self):
        self.scripts: list[list[int]] = []
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.live: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.fail_next = False
        self.default = [1, 2, 3]     # used when no script is queued

    def submit(self, prompt, params, request_id=None, group=None):
        with self.lock:
            self.prompts[request_id] = list(prompt)
            script = self.scripts.pop(0) if self.scripts else self.default
            self.live[request_id] = dict(prompt=list(prompt), params=params, script=list(script), out=[])
        return request_id

    def step(self):
        time.sleep(0.002)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected engine failure")
        outs = []
        with self.lock:
            for rid, r in list(self.live.items()):
                t = r["script"].pop(0)
                r["out"].append(t)
                reason = ("stop" if t in r["params"].stop_token_ids else
                          "length" if len(r["out"]) >= r["params"].max_tokens or not r["script"] else None)
                if reason:
                    del self.live[rid]
                outs.append(RequestOutput(rid, r["prompt"], list(r["out"]), [t], None, reason is not None, reason, 0))
        return outs

    def abort(self, rid):
        with self.lock:
            r = self.live.pop(rid)
            self.aborted.append(rid)
        return RequestOutput(rid, r["prompt"], r["out"], [], None, True, "abort", 0)

    def has_unfinished(self):
        with self.lock:
            return bool(self.live)

    def stats(self):
        with self.lock:
            return {"running": len(self.live), "waiting": 0}


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer(K3Config.preset("k3-tiny").text_config)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny(0)


@pytest.fixture(scope="module")
def real(tok, model):
    engine = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=48, max_model_len=MAX_LEN))
    with _Uvicorn(create_app(engine, tok, MODEL, MAX_LEN)) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def scripted(tok):
    engine = ScriptedEngine()
    with _Uvicorn(create_app(engine, tok, MODEL, MAX_LEN)) as srv:
        yield srv, engine


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(model, prompt, n, stop):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0.0, eos_token_id=stop)
    ids = out[0, len(prompt):].tolist()
    return ids[:ids.index(stop) + 1] if stop in ids else ids


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


# ----------------------------------------------------------------------------------------------- real engine

def test_chat_non_stream_and_stream_match_generate(real, tok, model):
    srv, _ = real
    c = _client(srv)
    prompt = chat.encode(tok, MSGS)
    parser = chat.ChatStreamParser(tok, inside="think")
    parser.feed_ids(_greedy(model, prompt, 10, tok.eos_token_id))
    parser.finish()
    want = parser.message
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0)
    ch = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and ch.message.role == "assistant"
    assert ch.message.reasoning_content == want.reasoning_content and (ch.message.content or "") == want.content
    assert r.usage.prompt_tokens == len(prompt) and 1 <= r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert ch.finish_reason in ("length", "stop", "tool_calls")

    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == ch.finish_reason
    reasoning = "".join(getattr(k.choices[0].delta, "reasoning_content", None) or "" for k in chunks[:-1])
    content = "".join(k.choices[0].delta.content or "" for k in chunks[:-1])
    assert (reasoning, content) == (want.reasoning_content, want.content)
    # the identical prompt hits the prefix cache: whole 16-token hash blocks, consistent with /metrics
    u = chunks[-1].usage
    assert u.prompt_tokens == len(prompt)
    assert 16 <= u.prompt_tokens_details.cached_tokens < len(prompt)
    assert u.prompt_tokens_details.cached_tokens % 16 == 0


def test_n_choices_seed_and_logprobs(real):
    srv, _ = real
    c = _client(srv)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0, seed=1234, n=2, logprobs=True)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.message.reasoning_content for x in a.choices] == [x.message.reasoning_content for x in b.choices]
    for ch in a.choices:
        lps = ch.logprobs.content
        assert lps and all(x.logprob <= 0 and x.top_logprobs == [] for x in lps)
    assert a.usage.completion_tokens == sum(len(x.logprobs.content) for x in a.choices)


def test_concurrent_requests_routed(real, tok, model):
    """Concurrent greedy requests batched by the engine each get their own tokens (= a solo generate())."""
    srv, _ = real
    c = _client(srv)
    prompts = [tok.encode(t) for t in ("one two", "three four five", "six", "seven eight nine ten")]
    results = [None] * len(prompts)

    def run(i):
        chunks = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        results[i] = "".join(k.choices[0].text for k in chunks if k.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    specials = set(tok.special_tokens.values())
    for p, got in zip(prompts, results):
        want = model.generate(torch.tensor([p]), max_new_tokens=6, temperature=0.0)[0, len(p):].tolist()
        assert got == tok.decode([t for t in want if t not in specials])


def test_completions(real, tok, model):
    srv, _ = real
    c = _client(srv)
    ids = tok.encode("The quick brown fox")
    want = _greedy(model, ids, 6, tok.eos_token_id)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=0, echo=True)
    text = r.choices[0].text
    gen = [t for t in want if t not in tok.special_tokens.values()]
    assert text == tok.decode(ids) + tok.decode(gen)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(want) == r.usage.completion_tokens
    assert lp.text_offset[0] == len(tok.decode(ids)) and all(x <= 0 for x in lp.token_logprobs)
    s = list(c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                  stream=True, stream_options={"include_usage": True}))
    assert "".join(k.choices[0].text for k in s if k.choices) == tok.decode(gen)
    assert s[-1].usage.prompt_tokens == len(ids)
    batch = c.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=3, temperature=0)
    assert [x.index for x in batch.choices] == [0, 1]


def test_models_health_metrics(real):
    srv, _ = real
    c = _client(srv)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0)
    text = httpx.get(srv.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("k3:num_requests_running", "k3:num_requests_waiting", "k3:kv_cache_usage_perc",
                 "k3:prefix_cache_queries", "k3:prefix_cache_hits", "k3:time_to_first_token_seconds",
                 "k3:inter_token_latency_seconds", "k3:e2e_request_latency_seconds", "k3:generation_tokens"):
        assert name in fams, name

    def value(fam, suffix):
        return sum(s.value for s in fams[fam].samples if s.name == fam + suffix)

    assert value("k3:num_requests_running", "") == 0 and value("k3:num_requests_waiting", "") == 0
    assert value("k3:time_to_first_token_seconds", "_count") >= 1
    assert value("k3:inter_token_latency_seconds", "_count") >= 3
    assert value("k3:prefix_cache_queries", "_total") > 0
    assert 0 < value("k3:prefix_cache_hits", "_total") <= value("k3:prefix_cache_queries", "_total")
    assert value("k3:generation_tokens", "_total") >= 4


TOOL_F = {"type": "function", "function": {"name": "f"}}
BAD_CHAT = [
    ("not json", 400), ("[1, 2]", 400), ({"model": MODEL}, 400), ({"model": MODEL, "messages": []}, 400),
    ({"messages": MSGS}, 400),
    ({"model": "nope", "messages": MSGS}, 404),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400),
    ({"model": MODEL, "messages": MSGS, "temperature": -1}, 400),
    ({"model": MODEL, "messages": MSGS, "temperature": "hot"}, 400),
    ({"model": MODEL, "messages": MSGS, "top_p": 0}, 400),
    ({"model": MODEL, "messages": MSGS, "max_tokens": 0}, 400),
    ({"model": MODEL, "messages": MSGS, "n": 0}, 400),
    ({"model": MODEL, "messages": MSGS, "stop": 7}, 400),
    ({"model": MODEL, "messages": MSGS, "reasoning_effort": "medium"}, 400),
    ({"model": MODEL, "messages": MSGS, "frobnicate": True}, 400),
    ({"model": MODEL, "messages": MSGS, "stream_options": {"include_usage": True}}, 400),
    ({"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 5}, 400),
    ({"model": MODEL, "messages": MSGS, "presence_penalty": 1.0}, 400),
    ({"model": MODEL, "messages": MSGS, "tool_choice": "required"}, 400),
    ({"model": MODEL, "messages": MSGS, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400),
    ({"model": MODEL, "messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * (2 * MAX_LEN)}]}, 400),
    ({"model": MODEL, "messages": MSGS, "max_tokens": MAX_LEN}, 400),
    ({"model": MODEL, "messages": MSGS, "seed": 2 ** 70}, 400),
    ({"model": MODEL, "messages": MSGS, "tools": [TOOL_F], "parallel_tool_calls": False}, 400),
    ({"model": MODEL, "messages": MSGS, "response_format": {"type": "json_schema"}}, 400),
]
BAD_COMPLETION = [
    ({"model": MODEL, "prompt": ""}, 400), ({"model": MODEL, "prompt": []}, 400),
    ({"model": MODEL, "prompt": [1, 99999]}, 400), ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    ({"model": MODEL, "prompt": "x", "logprobs": 3}, 400), ({"model": MODEL, "prompt": "x", "best_of": 3}, 400),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, 400),
    ({"model": MODEL, "prompt": [[1, 2], []]}, 400),
]


def test_malformed_requests_get_openai_errors(real):
    srv, engine = real
    h = httpx.Client(base_url=srv.url, timeout=30)
    cases = [("/v1/chat/completions", b, s) for b, s in BAD_CHAT] + \
            [("/v1/completions", b, s) for b, s in BAD_COMPLETION]
    assert len(cases) >= 20
    for path, body, status in cases:
        content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        r = h.post(path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", body
    r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": MAX_LEN})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert h.post("/v1/chat/completions", content=b"x" * (33 << 20),
                  headers={"Content-Type": "application/json"}).status_code == 413
    assert h.get("/v1/chat/completions").status_code == 405
    r = h.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    # the openai client maps them to its exception types, and the server keeps serving
    c = _client(srv)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=MSGS, temperature=5)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=MSGS)
    assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices[0].finish_reason
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def _wait_idle(engine, timeout=20):
    t0 = time.monotonic()
    while engine.has_unfinished() and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return not engine.has_unfinished()


def test_client_disconnect_aborts(real):
    srv, engine = real
    before = engine.stats()["num_aborted"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 300, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        with h.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(x.startswith("data: ") or x == "" for x in got)
    assert _wait_idle(engine) and engine.stats()["num_aborted"] == before + 1
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=0.5)
    assert _wait_idle(engine) and engine.stats()["num_aborted"] == before + 2


def test_message_forms(real, tok):
    """Content-part lists, the developer role, and a response message object appended to the history."""
    srv, _ = real
    c = _client(srv)
    msgs = [{"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
    # developer renders as system; content parts are encoded as separate pieces (as the official encoder does)
    assert r.usage.prompt_tokens == len(chat.encode(tok, [{"role": "system", "content": "Be terse."}, msgs[1]]))
    follow = msgs + [r.choices[0].message, {"role": "user", "content": "Another."}]
    r2 = c.chat.completions.create(model=MODEL, messages=follow, max_tokens=3, temperature=0)
    m = r.choices[0].message
    want = chat.encode(tok, msgs[:2] + [{"role": "assistant", "content": m.content,
                                           "reasoning_content": m.reasoning_content},
                                          {"role": "user", "content": "Another."}])
    assert r2.usage.prompt_tokens == len(want)


# ----------------------------------------------------------------------------------------------- scripted engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]


def _assistant_ids(tok, msg):
    """The ids a model would generate for `msg` after the (thinking) generation prompt."""
    user = [{"role": "user", "content": "q"}]
    head = chat.encode(tok, user)
    full = chat.encode(tok, user + [msg], add_generation_prompt=False)
    assert full[:len(head)] == head
    return full[len(head):]


def test_streaming_tool_call_round_trip(scripted, tok):
    srv, engine = scripted
    c = _client(srv)
    calls = [{"id": "x", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris \\"centre\\"", "days": 2}'}},
             {"id": "y", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]
    engine.scripts.append(_assistant_ids(tok, {"role": "assistant", "reasoning_content": "I need the weather.",
                                               "content": "Let me check.", "tool_calls": calls}))
    msgs = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    stream = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, stream=True,
                                       stream_options={"include_usage": True})
    reasoning, content, got, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = got.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("I need the weather.", "Let me check.", "tool_calls")
    assert [(g["name"], json.loads(g["arguments"])) for g in (got[0], got[1])] == \
           [("get_weather", {"city": 'Paris "centre"', "days": 2}), ("clock", {})]
    prompt = next(iter(engine.prompts.values()))
    assert prompt == chat.encode(tok, msgs, TOOLS)

    # round trip: the returned calls plus tool results (answered in reverse order) → reordered XTML prompt
    engine.prompts.clear()
    engine.scripts.append(_assistant_ids(tok, {"role": "assistant", "reasoning_content": "",
                                               "content": "Sunny, 9:00."}))
    assistant = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                 "tool_calls": [{"id": got[i]["id"], "type": "function",
                                 "function": {"name": got[i]["name"], "arguments": got[i]["arguments"]}}
                                for i in (0, 1)]}
    follow = msgs + [assistant, {"role": "tool", "tool_call_id": got[1]["id"], "content": "09:00"},
                     {"role": "tool", "tool_call_id": got[0]["id"], "content": "sunny"}]
    r = c.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS)
    assert r.choices[0].message.content == "Sunny, 9:00." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    text = tok.decode(next(iter(engine.prompts.values())))
    i0 = text.index('<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny'
                    '<|close|>message<|sep|><|end_of_msg|>')
    i1 = text.index('<|open|>message role="tool" tool="clock" index="2"<|sep|>09:00'
                    '<|close|>message<|sep|><|end_of_msg|>')
    assert i0 < i1 and text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_reasoning_effort_and_thinking_off(scripted, tok):
    srv, engine = scripted
    c = _client(srv)
    answer = {"role": "assistant", "reasoning_content": "hmm", "content": "ok"}
    for effort in ("low", "high", "max"):
        engine.prompts.clear()
        engine.scripts.append(_assistant_ids(tok, answer))
        r = c.chat.completions.create(model=MODEL, messages=MSGS, reasoning_effort=effort)
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("hmm", "ok")
        assert r.usage.completion_tokens_details.reasoning_tokens > 0
        assert next(iter(engine.prompts.values())) == chat.encode(tok, MSGS, reasoning_effort=effort)
    engine.prompts.clear()
    engine.scripts.append(tok.encode("plain") + chat.encode_segments(tok, [(chat.CLOSE, True), ("response", False),
                                                                           (chat.SEP, True), (chat.END_OF_MSG, True)]))
    r = c.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content == "plain"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert next(iter(engine.prompts.values())) == chat.encode(tok, MSGS, thinking=False)


def test_stop_strings_cut_content_and_abort(scripted, tok):
    srv, engine = scripted
    c = _client(srv)
    ids = _assistant_ids(tok, {"role": "assistant", "reasoning_content": "a STOP in reasoning is kept",
                               "content": "Hello STOP world"})
    for stream in (False, True):
        engine.scripts.append(ids)
        engine.aborted.clear()
        r = c.chat.completions.create(model=MODEL, messages=MSGS, stop=["STOP", "never"], stream=stream)
        if stream:
            chunks = list(r)
            content = "".join(k.choices[0].delta.content or "" for k in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert (content, finish) == ("Hello ", "stop")
        t0 = time.monotonic()
        while not engine.aborted and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert len(engine.aborted) == 1


def test_k3_serve_cli(tmp_path, tok, model, capsys):
    import argparse

    from k3.cli import main
    from k3.serve.cli import add_parser, build_app

    ckpt = tmp_path / "tiny-ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["serve", "--checkpoint", str(ckpt), "--device", "cpu", "--block-size", "64",
                         "--hash-block-size", "16", "--num-pages", "16", "--max-model-len", "256"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    app, engine = build_app(args)
    assert engine.max_model_len == 256
    ids = tok.encode("hello there")
    with _Uvicorn(app) as srv:
        c = _client(srv)
        assert [m.id for m in c.models.list().data] == ["tiny-ckpt"]
        r = c.completions.create(model="tiny-ckpt", prompt=ids, max_tokens=5, temperature=0)
    gen = [t for t in _greedy(model, ids, 5, tok.eos_token_id) if t not in tok.special_tokens.values()]
    assert r.choices[0].text == tok.decode(gen)
    assert main(["serve", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_engine_failure_is_contained(scripted, tok):
    """An exception inside engine.step fails the requests in flight with a 500 error; the server lives on."""
    srv, engine = scripted
    c = _client(srv)
    engine.scripts.append(tok.encode("never seen"))
    engine.fail_next = True
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS)
    assert "injected engine failure" in str(e.value)
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    engine.scripts.append(_assistant_ids(tok, {"role": "assistant", "reasoning_content": "", "content": "fine"}))
    assert c.chat.completions.create(model=MODEL, messages=MSGS).choices[0].message.content == "fine"


def test_stop_checker_random_splits():
    """Text streamed in random pieces is cut before the stop string that completes first (of two ending at the
    same character, the longer), as a per-character scan finds it."""
    import random

    from k3.serve.stop import StopChecker

    g = random.Random(0)
    for _ in range(300):
        text = "".join(g.choice("abcST") for _ in range(g.randint(0, 40)))
        stops = ["".join(g.choice("abcST") for _ in range(g.randint(1, 4))) for _ in range(g.randint(1, 3))]
        ends = [(e, -len(s)) for e in range(1, len(text) + 1) for s in stops if text[:e].endswith(s)]
        hits = min(ends, default=None)
        want = text[:hits[0] + hits[1]] if hits else text
        sc, got, pos = StopChecker(stops), "", 0
        while pos < len(text):
            k = g.randint(1, 5)
            got += sc.feed(text[pos:pos + k])
            pos += k
        if not sc.hit:
            got += sc.flush()
        assert (got, sc.hit) == (want, bool(hits)), (text, stops)


def test_fuzzed_requests_never_500(scripted):
    """Random type/value mutations of valid requests: every answer is a 2xx or an OpenAI-shaped 4xx."""
    import random

    srv, engine = scripted
    g = random.Random(0)
    values = [None, -1, 0, 1, 3, 2.5, -0.5, 1e300, "", "x", "auto", "low", [], [1], ["a"], {}, {"a": 1}, True,
              False, [{"role": "user", "content": "x"}], {"type": "function", "function": {"name": "f"}},
              {"include_usage": True}, {"thinking": False}, 2 ** 64, "x" * 5000]
    chat = {"model": MODEL, "messages": MSGS, "max_tokens": 3, "tools": [TOOL_F], "stream": False}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    keys = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
            "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "reasoning_effort",
            "response_format", "chat_template_kwargs", "ignore_eos", "stop_token_ids", "prompt", "echo", "user",
            "parallel_tool_calls", "model", "bogus"]
    statuses = set()
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for i in range(150):
            path, body = ("/v1/chat/completions", dict(chat)) if i % 3 else ("/v1/completions", dict(comp))
            for _ in range(g.randint(1, 3)):
                body[g.choice(keys)] = g.choice(values)
            if g.random() < 0.3 and isinstance(body.get("messages"), list):
                m = dict(g.choice(body["messages"]))
                m[g.choice(["role", "content", "name", "tool_calls", "tool_call_id"])] = g.choice(values)
                body["messages"] = body["messages"] + [m]
            r = h.post(path, json=body)
            statuses.add(r.status_code)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text[:300])
            if r.status_code != 200:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["type"] == "invalid_request_error"
            elif body.get("stream") is True:
                assert r.text.rstrip().endswith("data: [DONE]")
    assert {200, 400} <= statuses
    assert _wait_idle(engine, 5)
