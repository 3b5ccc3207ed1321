"""OpenAI-compatible HTTP server over a `k3.serve.Engine` (FastAPI; run it with uvicorn).

    POST /v1/chat/completions   XTML-rendered chat; reasoning_content, tool_calls, SSE streaming
    POST /v1/completions        raw prompts (text or token ids); SSE streaming
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 {"status": "ok"} while the engine thread is alive, else 503
    GET  /metrics               Prometheus text (k3.serve.metrics)

One background thread owns the engine: it applies queued submit / abort commands between `engine.step()`
calls and hands each request's outputs to that request's asyncio queue, so the event loop never blocks
on the model. A client that disconnects (streaming or not) has its requests aborted.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for anything wrong with
the request (unparsable JSON, wrong types, unknown fields, an invalid conversation, a prompt or
max_tokens beyond the context), 404 for an unknown model or route, 405 for a wrong method, 413 for a body
over `max_body_bytes`. 500 is reserved for bugs; the server keeps serving after any of them.

Stop strings are applied by the server to the visible text (chat `content`, not `reasoning_content`; or
the completion text): the output is cut before the stop string, finish_reason is "stop" and the engine
request is aborted. Chat log-probs cover every generated token, XTML markup included (the engine returns
the sampled token's log-prob only, so `top_logprobs` must be 0). `response_format` is passed to the model
as K3's response-format system message; the output is not constrained. `usage.prompt_tokens_details.
cached_tokens` is the engine's prefix-cache hit (a prompt shared by n choices counts once, smallest hit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..post import xtml
from . import api
from .metrics import CONTENT_TYPE, ServerMetrics
from .request import SamplingParams

log = logging.getLogger("k3.serve.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20
_SEED_MOD = 1 << 63


class APIError(Exception):
    """An error answered as an OpenAI-shaped JSON body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        body = api.ErrorResponse(error=api.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                     code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


# ----------------------------------------------------------------------------------------------- engine thread

@dataclass
class _Track:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: int
    arrival: float
    first: float | None = None
    last: float | None = None


class EngineDriver:
    """Runs `engine.step()` in one background thread; every engine call happens on that thread."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.stats: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._cmds: deque = deque()
        self._wake = threading.Event()
        self._tracks: dict[str, _Track] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- control (any thread)
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue, tag: int = 0) -> concurrent.futures.Future:
        """Queue a request; the future resolves once the engine accepted it (or holds its ValueError)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._tracks[rid] = _Track(loop, queue, tag, time.monotonic())
            self._cmds.append(("submit", rid, prompt, params, fut))
        self._wake.set()
        return fut

    def abort(self, rid: str) -> None:
        """Stop a request; no more outputs are delivered for it."""
        with self._lock:
            if self._tracks.pop(rid, None) is None:
                return
            self._cmds.append(("abort", rid))
        self._wake.set()

    # -- engine thread
    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._commands()
            try:
                busy = self.engine.has_unfinished()
            except Exception:  # noqa: BLE001 - a broken engine must not kill the thread
                log.exception("engine.has_unfinished failed")
                busy = False
            if not busy:
                self._wake.wait(0.5)
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001
                log.exception("engine.step failed; failing the requests in flight")
                self._fail_all(e)
                continue
            self._dispatch(outs)
            self._refresh_stats()
        self._fail_all(RuntimeError("the server is shutting down"))

    def _commands(self) -> None:
        while True:
            with self._lock:
                if not self._cmds:
                    break
                cmd = self._cmds.popleft()
            if cmd[0] == "submit":
                _, rid, prompt, params, fut = cmd
                try:
                    self.engine.submit(prompt, params, request_id=rid)
                except Exception as e:  # noqa: BLE001 - reported to the request
                    with self._lock:
                        self._tracks.pop(rid, None)
                    fut.set_exception(e)
                else:
                    fut.set_result(rid)
            else:
                with contextlib.suppress(Exception):
                    self.engine.abort(cmd[1])
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001
            log.exception("engine.stats failed")

    def _dispatch(self, outs) -> None:
        now = time.monotonic()
        m = self.metrics
        for out in outs:
            with self._lock:
                tr = self._tracks.get(out.request_id)
                if tr is not None and out.finished:
                    del self._tracks[out.request_id]
            if tr is None:
                continue
            k = len(out.new_token_ids)
            if m is not None and k:
                m.generation_tokens.inc(k)
                if tr.first is None:   # tokens after the first in that same output have no measurable gap
                    m.ttft.observe(now - tr.arrival)
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                    tr.first = now
                else:
                    for _ in range(k):
                        m.itl.observe((now - tr.last) / k)
                tr.last = now
            if m is not None and out.finished:
                m.e2e.observe(now - tr.arrival)
                m.request_finished(out.finish_reason or "unknown")
            self._put(tr, out)

    def _put(self, tr: _Track, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            tr.loop.call_soon_threadsafe(tr.queue.put_nowait, (tr.tag, item))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            tracks, self._tracks = self._tracks, {}
            cmds, self._cmds = list(self._cmds), deque()
        for cmd in cmds:
            if cmd[0] == "submit":
                cmd[4].set_exception(exc)
        for rid, tr in tracks.items():
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            self._put(tr, exc)
        self._refresh_stats()


# ----------------------------------------------------------------------------------------------- text helpers

class StopChecker:
    """Cuts a text stream before the stop string that completes first (the one an engine checking after
    every token would stop on; of two ending at the same character, the longer), holding back a tail
    that may start one. The result does not depend on how the text is split into pieces."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else text
        self.buf += text
        found = [(i + len(s), i) for s, i in ((s, self.buf.find(s)) for s in self.stops) if i >= 0]
        if found:
            cut = min(found)[1]
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        keep = len(self.buf) - self.hold
        out, self.buf = (self.buf[:keep], self.buf[keep:]) if keep > 0 else ("", self.buf)
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class IncrementalText:
    """Incremental detokenizer (special ids skipped): holds ids that end in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.specials = set(tokenizer.special_tokens.values()) if skip_special else set()
        self.pending: list[int] = []

    def feed(self, ids, final: bool = False) -> str:
        self.pending += [i for i in ids if i not in self.specials]
        text, self.pending = xtml.decode_stable(self.tok, self.pending, final)
        return text


def _token_str(tokenizer, t: int) -> tuple[str, list[int]]:
    try:
        b = tokenizer.decode_bytes([t]) if hasattr(tokenizer, "decode_bytes") else tokenizer.decode([t]).encode()
    except (ValueError, KeyError):
        b = b""
    return b.decode("utf-8", errors="replace"), list(b)


# ----------------------------------------------------------------------------------------------- per choice

@dataclass
class _Choice:
    index: int
    rid: str
    stop: StopChecker
    prompt_index: int = 0
    parser: xtml.XTMLStreamParser | None = None        # chat
    text: IncrementalText | None = None                # completions
    message: xtml.ParsedMessage = field(default_factory=xtml.ParsedMessage)
    completion: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _apply_stop(ch: _Choice, deltas: list[xtml.Delta], final: bool) -> list[xtml.Delta]:
    """Run chat deltas through the stop checker (content only; a content region ends at any other delta)."""
    out: list[xtml.Delta] = []

    def add(kind, text):
        if text:
            if out and out[-1].kind == kind:
                out[-1].text += text
            else:
                out.append(xtml.Delta(kind, text))

    for d in deltas:
        if ch.stop.hit:
            break
        if d.kind == "content":
            add("content", ch.stop.feed(d.text))
        else:
            add("content", ch.stop.flush())
            if d.kind in ("reasoning",):
                add("reasoning", d.text)
            else:
                out.append(d)
    if final and not ch.stop.hit:
        add("content", ch.stop.flush())
    return out


# ----------------------------------------------------------------------------------------------- the app

class _Server:
    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, max_body_bytes: int):
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.driver = EngineDriver(engine)
        self.metrics = self.driver.metrics = ServerMetrics(model_name, lambda: self.driver.stats)
        self.eom = tokenizer.special_tokens[xtml.END_OF_MSG]
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 0) or 0)

    # -- request parsing
    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > self.max_body_bytes:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {self.max_body_bytes} bytes",
                           code="request_too_large")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {self.max_body_bytes} "
                           "bytes", code="request_too_large")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                           code="invalid_json")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unrecognized request argument {loc!r}"
            raise APIError(400, f"{loc + ': ' if loc else ''}{msg}", param=loc or None,
                           code="invalid_value") from None
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param=param, code="invalid_value")

    def _budget(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                           f"{n_prompt} tokens", param="messages" if param != "prompt" else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            return limit - n_prompt
        if n_prompt + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                           f"{n_prompt} tokens and {param}={max_tokens} asks for {n_prompt + max_tokens}",
                           param=param, code="context_length_exceeded")
        return max_tokens

    def _params(self, req: api._Sampling, max_tokens: int, choice: int, extra_stop: tuple[int, ...],
                logprobs: bool) -> SamplingParams:
        stop_ids = tuple(req.stop_token_ids or ())
        self._check_ids(list(stop_ids), "stop_token_ids")
        seed = None if req.seed is None else (req.seed + choice) % _SEED_MOD
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                                  top_k=0 if req.top_k in (None, -1) else req.top_k, seed=seed,
                                  stop_token_ids=stop_ids + extra_stop, logprobs=logprobs, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    # -- running a group of choices
    async def _submit(self, rid0: str, prompts: list[list[int]], params: list[SamplingParams]):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rids = [f"{rid0}-{i}" for i in range(len(params))]
        futs = [self.driver.submit(r, p, sp, loop, queue, tag=i)
                for i, (r, p, sp) in enumerate(zip(rids, prompts, params))]
        try:
            for f in futs:
                await asyncio.wrap_future(f)
        except ValueError as e:
            for r in rids:
                self.driver.abort(r)
            raise APIError(400, str(e), code="invalid_value") from None
        except BaseException:
            for r in rids:
                self.driver.abort(r)
            raise
        return rids, queue

    async def _events(self, choices: list[_Choice], queue: asyncio.Queue):
        """Yield (choice, deltas-or-text, new logprob entries) until every choice is done; aborts on exit."""
        try:
            while not all(c.done for c in choices):
                tag, out = await queue.get()
                if isinstance(out, BaseException):
                    raise APIError(500, f"the engine failed: {out}", code="engine_error")
                ch = choices[tag]
                if ch.done:
                    continue
                ch.cached = out.num_cached_tokens
                new = list(out.new_token_ids)
                ch.token_ids += new
                lp_new: list[tuple[int, float]] = []
                if out.logprobs is not None:
                    lps = out.logprobs[len(ch.logprobs):]
                    ch.logprobs += lps
                    lp_new = list(zip(new[-len(lps):] if lps else [], lps))
                if ch.parser is not None:
                    deltas = ch.parser.feed(new)
                    if out.finished:
                        deltas += ch.parser.finish()
                    payload = _apply_stop(ch, deltas, out.finished)
                    ch.message.apply(payload)
                else:
                    text = ch.stop.feed(ch.text.feed(new, final=out.finished))
                    if out.finished and not ch.stop.hit:
                        text += ch.stop.flush()
                    ch.completion += text
                    payload = text
                if ch.stop.hit:
                    ch.finish_reason = "stop"
                    self.driver.abort(ch.rid)
                elif out.finished:
                    reason = out.finish_reason or "stop"
                    if reason == "stop" and ch.message.tool_calls:
                        reason = "tool_calls"
                    ch.finish_reason = reason
                yield ch, payload, lp_new
        finally:
            for c in choices:
                if not c.done or c.stop.hit:
                    self.driver.abort(c.rid)

    @staticmethod
    async def _drain(request: Request, events) -> None:
        """Run a non-streaming request to the end; if the client goes away first, abort it."""
        async def run():
            async with contextlib.aclosing(events) as ev:
                async for _ in ev:
                    pass

        task = asyncio.ensure_future(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise APIError(499, "the client closed the connection", code="client_closed_request")
        finally:
            if not task.done():
                task.cancel()

    def _usage(self, n_prompt: int, choices: list[_Choice]) -> api.Usage:
        comp = sum(len(c.token_ids) for c in choices)
        reasoning = sum(c.parser.num_reasoning_tokens for c in choices if c.parser is not None)
        per_prompt: dict[int, int] = {}   # a prompt shared by n choices counts once, with its smallest hit
        for c in choices:
            per_prompt[c.prompt_index] = min(per_prompt.get(c.prompt_index, c.cached), c.cached)
        return api.Usage(prompt_tokens=n_prompt, completion_tokens=comp, total_tokens=n_prompt + comp,
                         prompt_tokens_details=api.PromptTokensDetails(cached_tokens=sum(per_prompt.values())),
                         completion_tokens_details=api.CompletionTokensDetails(reasoning_tokens=reasoning))

    def _chat_logprobs(self, pairs) -> api.ChoiceLogprobs:
        items = []
        for t, lp in pairs:
            s, b = _token_str(self.tok, t)
            items.append(api.TokenLogprob(token=s, logprob=lp, bytes=b))
        return api.ChoiceLogprobs(content=items)

    # -- chat
    async def chat(self, request: Request):
        req: api.ChatCompletionRequest = await self._body(request, api.ChatCompletionRequest)
        if req.top_logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} is not supported (the engine returns the "
                           "sampled token's log-prob only; use 0)", param="top_logprobs", code="invalid_value")
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            prompt = await run_in_threadpool(   # tokenizing a long prompt must not stall the event loop
                xtml.render, self.tok, msgs, tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice,
                response_format=req.response_format.model_dump(exclude_none=True, by_alias=True)
                if req.response_format else None,
                reasoning_effort=req.reasoning_effort, thinking=req.thinking)
        except xtml.XTMLError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._budget(len(prompt), req.max_new_tokens(), param)
        extra = () if req.ignore_eos else (self.eom,)
        params = [self._params(req, max_tokens, i, extra, req.logprobs) for i in range(req.n)]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        rids, queue = await self._submit(cid, [prompt] * req.n, params)
        choices = [_Choice(i, rids[i], StopChecker(req.stop_strings()),
                           parser=xtml.XTMLStreamParser(self.tok, thinking=req.thinking)) for i in range(req.n)]
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(self._chat_stream(cid, created, len(prompt), choices, queue, include_usage,
                                               req.logprobs), rids)
        await self._drain(request, self._events(choices, queue))
        out = []
        for c in choices:
            msg = c.message
            calls = [api.ToolCallOut(id=t.id, function=api.FunctionCallOut(name=t.name, arguments=t.arguments))
                     for t in msg.tool_calls]
            out.append(api.ChatChoice(
                index=c.index, finish_reason=c.finish_reason,
                message=api.ChatMessageOut(content=msg.content if (msg.content or not calls) else None,
                                           reasoning_content=msg.reasoning_content if req.thinking else None,
                                           tool_calls=calls or None),
                logprobs=self._chat_logprobs(zip(c.token_ids, c.logprobs)) if req.logprobs else None))
        body = api.ChatCompletionResponse(id=cid, created=created, model=self.model_name, choices=out,
                                          usage=self._usage(len(prompt), choices))
        return JSONResponse(body.model_dump(exclude_none=True))

    async def _chat_stream(self, cid, created, n_prompt, choices, queue, include_usage, logprobs):
        def chunk(index, delta, finish=None, lp=None):
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [c]}

        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async with contextlib.aclosing(self._events(choices, queue)) as ev:
            async for ch, deltas, lps in ev:
                lp = self._chat_logprobs(lps).model_dump() if logprobs and lps else None
                for d in deltas:
                    if d.kind == "reasoning":
                        delta = {"reasoning_content": d.text}
                    elif d.kind == "content":
                        delta = {"content": d.text}
                    elif d.kind == "tool_call":
                        delta = {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                                 "function": {"name": d.name, "arguments": ""}}]}
                    else:
                        delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
                    yield chunk(ch.index, delta, lp=lp)
                    lp = None
                if lp is not None:
                    yield chunk(ch.index, {}, lp=lp)
                if ch.done:
                    yield chunk(ch.index, {}, finish=ch.finish_reason)
        if include_usage:
            yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": self._usage(n_prompt, choices).model_dump()}

    # -- completions
    async def completions(self, request: Request):
        req: api.CompletionRequest = await self._body(request, api.CompletionRequest)
        if req.logprobs:
            raise APIError(400, f"logprobs={req.logprobs} is not supported (the engine returns the sampled "
                           "token's log-prob only; use 0)", param="logprobs", code="invalid_value")
        prompts: list[list[int]] = []
        for j, p in enumerate(req.prompts()):
            if isinstance(p, str):
                prompts.append(await run_in_threadpool(self.tok.encode, p, allow_special=False))
            else:
                self._check_ids(p, "prompt")
                prompts.append(list(p))
            if not prompts[-1]:
                raise APIError(400, f"prompt[{j}] encodes to no tokens", param="prompt", code="invalid_value")
        budgets = [self._budget(len(p), req.max_tokens, "max_tokens") for p in prompts]
        logprobs = req.logprobs is not None
        flat = [(j, k) for j in range(len(prompts)) for k in range(req.n)]
        params = [self._params(req, budgets[j], k, (), logprobs) for j, k in flat]
        cid = f"cmpl-{uuid.uuid4().hex}"
        rids, queue = await self._submit(cid, [prompts[j] for j, _ in flat], params)
        choices = [_Choice(i, rids[i], StopChecker(req.stop_strings()), prompt_index=flat[i][0],
                           text=IncrementalText(self.tok)) for i in range(len(flat))]
        echo = [xtml.safe_decode(self.tok, prompts[j]) if req.echo else "" for j, _ in flat]
        n_prompt = sum(len(p) for p in prompts)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(self._completion_stream(cid, created, n_prompt, choices, queue, include_usage, echo,
                                                     logprobs), rids)
        await self._drain(request, self._events(choices, queue))
        out = [api.CompletionChoice(index=c.index, text=echo[c.index] + c.completion, finish_reason=c.finish_reason,
                                    logprobs=self._completion_logprobs(zip(c.token_ids, c.logprobs),
                                                                       len(echo[c.index])) if logprobs else None)
               for c in choices]
        body = api.CompletionResponse(id=cid, created=created, model=self.model_name, choices=out,
                                      usage=self._usage(n_prompt, choices))
        return JSONResponse(body.model_dump(exclude_none=True))

    def _completion_logprobs(self, pairs, offset: int = 0) -> api.CompletionLogprobs:
        """Log-probs of the generated tokens (none for echoed prompt tokens; offsets count the echo)."""
        r = api.CompletionLogprobs()
        off = offset
        for t, lp in pairs:
            s, _ = _token_str(self.tok, t)
            r.tokens.append(s)
            r.token_logprobs.append(lp)
            r.top_logprobs.append(None)
            r.text_offset.append(off)
            off += len(s)
        return r

    async def _completion_stream(self, cid, created, n_prompt, choices, queue, include_usage, echo, logprobs):
        def chunk(index, text, finish=None, lp=None):
            c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [c]}

        for c in choices:
            if echo[c.index]:
                yield chunk(c.index, echo[c.index])
        async with contextlib.aclosing(self._events(choices, queue)) as ev:
            async for ch, text, lps in ev:
                off = len(echo[ch.index]) + len(ch.completion) - len(text)
                lp = self._completion_logprobs(lps, off).model_dump() if logprobs and lps else None
                if text or lp is not None:
                    yield chunk(ch.index, text, lp=lp)
                if ch.done:
                    yield chunk(ch.index, "", finish=ch.finish_reason)
        if include_usage:
            yield {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": self._usage(n_prompt, choices).model_dump()}

    def _sse(self, gen: AsyncIterator[dict], rids: list[str]) -> StreamingResponse:
        """SSE response; the background task aborts the requests even if the body never started (a client
        that left before the first byte)."""
        def abort_all():
            for r in rids:
                self.driver.abort(r)

        async def body():
            try:
                async with contextlib.aclosing(gen) as g:
                    async for item in g:
                        yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
            except APIError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.type, 'code': e.code}})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(abort_all),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def models(self) -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=self.model_name, created=self.created,
                                                 max_model_len=self.max_model_len)])


def create_app(engine, tokenizer, model_name: str, max_model_len: int, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine` (started and stopped with the app's lifespan)."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    srv = _Server(engine, tokenizer, model_name, max_model_len, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.driver.start()
        try:
            yield
        finally:
            srv.driver.shutdown()

    app = FastAPI(title="k3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        msg = {404: f"no route {request.url.path!r}",
               405: f"method {request.method} is not allowed on {request.url.path!r}"}.get(status, str(exc.detail))
        return APIError(status, msg, code={404: "not_found", 405: "method_not_allowed"}.get(status)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await srv.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completions(request)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(srv.models().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != srv.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {srv.model_name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(srv.models().data[0].model_dump())

    @app.get("/health")
    async def health():
        if not srv.driver.alive:
            return JSONResponse({"status": "engine thread not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    return app
