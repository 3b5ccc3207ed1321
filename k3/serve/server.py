"""OpenAI-compatible HTTP server over a `k3.serve.Engine` (FastAPI; run it with uvicorn): the routes.

    POST /v1/chat/completions   chat (rendered by k3.serve.output); reasoning_content, tool_calls, SSE streaming
    POST /v1/completions        raw prompts (text or token ids); SSE streaming
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 {"status": "ok"} while the engine thread is alive, else 503
    GET  /metrics               Prometheus text (k3.serve.metrics)

The engine runs on one background thread (k3.serve.driver); raw requests pass `RequestGuard` (API key,
JSON content type, body size) before a route reads them; k3.serve.output turns engine outputs into text.
A client that disconnects (streaming or not) has its requests aborted.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for anything wrong with
the request (unparsable or too deeply nested JSON, wrong types, unknown fields, an invalid conversation, a
prompt or max_tokens beyond the context, more than `max_choices_per_request` prompts × n), 401 without the
API key, 404 for an unknown model or route, 405 for a wrong method, 413 for a body over `max_body_bytes`,
415 for a body that is not application/json, 429 (with Retry-After) while `max_pending` engine requests
are in flight. 500 is reserved for bugs and for a request the engine could not finish (that request alone);
the server keeps serving after any of them.

Stop strings are applied by the server to the visible text (chat `content`, not `reasoning_content`; or
the completion text): the output is cut before the stop string, finish_reason is "stop" and the engine
request is aborted. Chat log-probs cover every generated token, chat markup included (the engine returns
the sampled token's log-prob only, so `top_logprobs` must be 0). `response_format` is passed to the model
as K3's response-format system message; the output is not constrained. `usage.prompt_tokens_details.
cached_tokens` is the engine's prefix-cache hit (a prompt shared by n choices counts once, smallest hit).
Fairness: the choices of one request form one scheduling group, admitted round-robin against other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import api
from .driver import EngineDriver
from .errors import APIError
from .guard import RequestGuard
from .json_body import DEFAULT_MAX_DEPTH, parse_json, validate
from .metrics import CONTENT_TYPE, ServerMetrics
from .output import ChatFormatError, Choice, decode_text, end_of_message_id, render_chat, token_str
from .request import SamplingParams

log = logging.getLogger("k3.serve.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20
_SEED_MOD = 1 << 63


@dataclass
class ServerLimits:
    """Per-server limits. max_body_bytes: request body size (413); max_json_depth: JSON nesting (400);
    max_choices_per_request: prompts × n of one request (400); max_pending: engine requests in flight
    (choices of all requests; a request that would exceed it gets 429 with `Retry-After: retry_after_s`)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_DEPTH
    max_choices_per_request: int = 64
    max_pending: int = 1024
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_body_bytes", "max_json_depth", "max_choices_per_request", "max_pending", "retry_after_s"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerLimits.{name} must be an integer >= 1, got {v!r}")
        if self.max_choices_per_request > self.max_pending:
            raise ValueError(f"ServerLimits.max_choices_per_request ({self.max_choices_per_request}) must not "
                             f"exceed max_pending ({self.max_pending})")


class _Server:
    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, limits: ServerLimits):
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        self.limits = limits
        self.created = int(time.time())
        self.driver = EngineDriver(engine)
        self.metrics = self.driver.metrics = ServerMetrics(model_name, lambda: self.driver.stats)
        self.eom = end_of_message_id(tokenizer)
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 0) or 0)

    # -- request parsing
    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()   # RequestGuard bounds it (413) while it streams in
        req = validate(parse_json(raw, self.limits.max_json_depth), model)
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param=param, code="invalid_value")

    def _check_choices(self, n_prompts: int, n: int) -> None:
        cap = self.limits.max_choices_per_request
        if n_prompts * n > cap:
            raise APIError(400, f"this server allows at most {cap} choices per request (prompts × n); got "
                           f"{n_prompts} × {n} = {n_prompts * n}", param="n", code="too_many_choices")

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
                                  stop_token_ids=stop_ids + extra_stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
                                  output_kind="delta")  # the choices accumulate; no O(length) copy per token
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    # -- running a group of choices
    async def _submit(self, rid0: str, prompts: list[list[int]], params: list[SamplingParams]):
        lim = self.limits
        pending = self.driver.pending
        if pending + len(params) > lim.max_pending:   # no await between this check and the submits below
            raise APIError(429, f"the server is at capacity ({pending} requests in flight, limit "
                           f"{lim.max_pending}); retry after {lim.retry_after_s} s", code="rate_limit_exceeded",
                           type="rate_limit_error", headers={"Retry-After": str(lim.retry_after_s)})
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rids = [f"{rid0}-{i}" for i in range(len(params))]
        futs = [self.driver.submit(r, p, sp, loop, queue, tag=i, group=rid0)
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

    async def _events(self, choices: list[Choice], queue: asyncio.Queue):
        """Yield (choice, deltas-or-text, new logprob entries) until every choice is done; aborts on exit."""
        try:
            while not all(c.done for c in choices):
                tag, out = await queue.get()
                if isinstance(out, BaseException):
                    raise APIError(500, f"the engine failed: {out}", code="engine_error")
                ch = choices[tag]
                if ch.done:
                    continue
                payload, lp_new = ch.update(out)
                if ch.stop_hit:
                    self.driver.abort(ch.rid)
                yield ch, payload, lp_new
        finally:
            for c in choices:
                if not c.done or c.stop_hit:
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

    def _usage(self, n_prompt: int, choices: list[Choice]) -> api.Usage:
        comp = sum(len(c.token_ids) for c in choices)
        reasoning = sum(c.reasoning_tokens for c in choices)
        per_prompt: dict[int, int] = {}   # a prompt shared by n choices counts once, with its smallest hit
        for c in choices:
            per_prompt[c.prompt_index] = min(per_prompt.get(c.prompt_index, c.cached), c.cached)
        return api.Usage(prompt_tokens=n_prompt, completion_tokens=comp, total_tokens=n_prompt + comp,
                         prompt_tokens_details=api.PromptTokensDetails(cached_tokens=sum(per_prompt.values())),
                         completion_tokens_details=api.CompletionTokensDetails(reasoning_tokens=reasoning))

    def _chat_logprobs(self, pairs) -> api.ChoiceLogprobs:
        items = []
        for t, lp in pairs:
            s, b = token_str(self.tok, t)
            items.append(api.TokenLogprob(token=s, logprob=lp, bytes=b))
        return api.ChoiceLogprobs(content=items)

    # -- chat
    async def chat(self, request: Request):
        req: api.ChatCompletionRequest = await self._body(request, api.ChatCompletionRequest)
        if req.top_logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} is not supported (the engine returns the "
                           "sampled token's log-prob only; use 0)", param="top_logprobs", code="invalid_value")
        self._check_choices(1, req.n)
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            prompt = await run_in_threadpool(   # tokenizing a long prompt must not stall the event loop
                render_chat, self.tok, msgs,
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice,
                response_format=req.response_format.model_dump(exclude_none=True, by_alias=True)
                if req.response_format else None,
                reasoning_effort=req.reasoning_effort, thinking=req.thinking)
        except ChatFormatError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._budget(len(prompt), req.max_new_tokens(), param)
        extra = () if req.ignore_eos else (self.eom,)
        params = [self._params(req, max_tokens, i, extra, req.logprobs) for i in range(req.n)]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        rids, queue = await self._submit(cid, [prompt] * req.n, params)
        choices = [Choice.for_chat(self.tok, i, rids[i], req.stop_strings(), thinking=req.thinking)
                   for i in range(req.n)]
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
        raw_prompts = req.prompts()
        self._check_choices(len(raw_prompts), req.n)
        prompts: list[list[int]] = []
        for j, p in enumerate(raw_prompts):
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
        stops = req.stop_strings()
        choices = [Choice.for_completion(self.tok, i, rids[i], stops, flat[i][0]) for i in range(len(flat))]
        echo = [decode_text(self.tok, prompts[j]) if req.echo else "" for j, _ in flat]
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
            s, _ = token_str(self.tok, t)
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


def create_app(engine, tokenizer, model_name: str, max_model_len: int, *, limits: ServerLimits | None = None,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (started and stopped with the app's lifespan). With `api_key`, every
    route but /health needs `Authorization: Bearer <api_key>`."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    limits = limits or ServerLimits()
    srv = _Server(engine, tokenizer, model_name, max_model_len, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.driver.start()
        try:
            yield
        finally:
            srv.driver.shutdown()

    app = FastAPI(title="k3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(RequestGuard, max_body_bytes=limits.max_body_bytes, api_key=api_key)

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
