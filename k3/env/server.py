"""The REST control plane over a `SandboxManager` (E2B/AgentENV-shaped; FastAPI).

    GET    /health                                   {"status": "ok"}            (no auth)
    GET    /tiers                                    {tier: {available, reason}}
    POST   /sandboxes                                {tier, base, snapshot_id, timeout_s, auto_pause, limits, env,
                                                      metadata} → 201 sandbox
    GET    /sandboxes                                [sandbox]
    GET    /sandboxes/{id}                           sandbox
    DELETE /sandboxes/{id}                           204 (kill)
    POST   /sandboxes/{id}/pause | /resume           sandbox
    POST   /sandboxes/{id}/timeout                   {timeout_s} → sandbox
    POST   /sandboxes/{id}/snapshots                 201 snapshot (checkpoint)
    POST   /sandboxes/{id}/fork                      {count} → 201 {snapshot_id, sandboxes: [sandbox]}
    POST   /sandboxes/{id}/exec                      {cmd, timeout, env, cwd, stdin_b64} →
                                                      {stdout, stderr, exit_code, timed_out, duration_s}
    GET    /sandboxes/{id}/files?path=P              raw bytes (application/octet-stream)
    PUT    /sandboxes/{id}/files?path=P[&mode=644]   raw body → 204 (413 beyond the upload limit)
    GET    /sandboxes/{id}/files/list?path=P         [{name, path, is_dir, size}]
    GET    /snapshots | /snapshots/{id}              [snapshot] | snapshot
    DELETE /snapshots/{id}                           204

A sandbox is {sandbox_id, state, tier, base, snapshot_id, parent_snapshot, created_at, timeout_s, auto_pause,
expires_at, limits, metadata, error}; a snapshot is {snapshot_id, sandbox_id, tier, parent, created_at}.

Auth: with an api_key every route but /health needs header `X-API-Key: <key>` (401 otherwise).
Errors: JSON {"error": <class name>, "detail": <message>} with the error's status — k3.env.base errors keep
theirs (400 BadRequest, 404 NotFound, 409 InvalidState, 413 TooLarge, 503 Unavailable); malformed JSON is
400 BadRequest; a POST body not sent as Content-Type application/json is 415 UnsupportedMediaType (which
also keeps web pages from POSTing to a local server cross-site); a body or query that doesn't match the
schema is 422 ValidationError (with "errors": the field-level list); unknown routes 404; 401 Unauthorized;
anything unexpected 500 InternalError.
Every check happens before the manager changes anything, so a failed request changes nothing.

Bodies are bounded while they stream in (Content-Length or chunked alike): a file upload by the sandbox's
upload limit, every other body by MAX_JSON_BODY (413 TooLarge beyond, without reading the rest). Numbers must
be finite (NaN/Infinity are 422). Bases are whatever the tier allows (the process tier: an allow-list).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import logging
import math
from typing import Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .base import BadRequest, SandboxError, TooLarge
from .manager import SandboxManager

log = logging.getLogger("k3.env.server")

MAX_JSON_BODY = 16 * 1024 * 1024  # any request body but a file upload (exec stdin_b64 included)

_HTTP_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
               405: "MethodNotAllowed", 409: "InvalidState", 413: "TooLarge", 415: "UnsupportedMediaType",
               422: "ValidationError", 503: "Unavailable"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LimitsIn(_Model):
    memory_mb: int | None = Field(None, gt=0)
    cpus: float | None = Field(None, gt=0, allow_inf_nan=False)
    pids: int | None = Field(None, gt=0)
    file_mb: int | None = Field(None, gt=0)
    disk_mb: int | None = None  # the old name: passed on so the manager can say what it became
    network: bool | None = None


class CreateIn(_Model):
    tier: str | None = None
    base: str | None = None
    snapshot_id: str | None = None
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    auto_pause: bool = True
    limits: LimitsIn | None = None
    env: dict[str, str] | None = None
    metadata: dict[str, str] | None = None


class TimeoutIn(_Model):
    timeout_s: float | None = Field(..., gt=0, allow_inf_nan=False)


class ForkIn(_Model):
    count: int = 1


class ExecIn(_Model):
    cmd: str | list[str]
    timeout: float = Field(60.0, gt=0, allow_inf_nan=False)
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin_b64: str | None = None


def _error(status: int, name: str, detail: Any, **extra) -> JSONResponse:
    return JSONResponse({"error": name, "detail": detail, **extra}, status_code=status)


def _finite(x: Any) -> Any:
    """`x` with every non-finite float as its string ('nan'): an error that echoes the bad input stays JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class _BodyLimit:
    """Pure ASGI middleware: reads a request body (every route but the file upload, which streams against its own
    cap) up to `limit` bytes as it arrives, Content-Length or chunked, then hands it to the app; one byte more is
    413 at once, so a client cannot make the server buffer more than `limit`."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"] == "PUT" and scope["path"].endswith("/files")):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await _error(400, "BadRequest", "invalid Content-Length")(scope, receive, send)
            if n > self.limit:
                return await self._too_large(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            more = msg.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        resp = _error(413, "TooLarge", f"request body exceeds the limit of {self.limit} bytes")
        resp.headers["connection"] = "close"  # the rest of the body is never read
        await resp(scope, receive, send)


def _validation_message(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


def _has_body(request: Request) -> bool:
    n = request.headers.get("content-length")
    if n is not None:
        return n.strip() not in ("", "0")
    return "transfer-encoding" in request.headers


def create_app(manager: SandboxManager, api_key: str | None = None, shutdown_manager: bool = False,
               max_body: int = MAX_JSON_BODY) -> FastAPI:
    """The ASGI app. `api_key`: require `X-API-Key` on every route but /health. `shutdown_manager`: call
    `manager.shutdown()` (pause running sandboxes) when the ASGI server shuts down (`k3 sandbox serve` does);
    otherwise the manager is left to whoever created it. `max_body`: the cap on every body but a file upload."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_manager:
            await run_in_threadpool(manager.shutdown)

    app = FastAPI(title="k3 sandboxes", version="1", description=__doc__, lifespan=lifespan)
    app.state.manager = manager
    key = api_key.encode() if api_key else None

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if key is not None and request.url.path != "/health":
            given = request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, key):
                return _error(401, "Unauthorized", "missing or invalid X-API-Key header")
        if request.method == "POST" and _has_body(request):
            # JSON bodies must say so: a web page can POST text/plain or form data to a local server without a
            # CORS preflight, never application/json (so this also blocks cross-site requests)
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
                return _error(415, "UnsupportedMediaType",
                              f"request body must be JSON with Content-Type: application/json (got {ctype or 'none'})")
        return await call_next(request)

    app.add_middleware(_BodyLimit, limit=max_body)  # outermost: before auth and routing see the body

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError):
        return _error(exc.status, type(exc).__name__, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx") or {}
            return _error(400, "BadRequest", f"invalid JSON body: {ctx.get('error', bad_json[0].get('msg'))}")
        return _error(422, "ValidationError", _finite(_validation_message(errors)),
                      errors=_finite(jsonable_encoder(errors)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, _HTTP_NAMES.get(exc.status_code, "HTTPError"), exc.detail)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("sandbox server: unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "InternalError", f"{type(exc).__name__}: {exc}")

    m = manager

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/tiers")
    def tiers():
        return m.tier_status()

    # ---- sandboxes ----------------------------------------------------------------------------------
    @app.post("/sandboxes", status_code=201)
    def create(body: CreateIn | None = Body(None)):
        b = body or CreateIn()
        limits = b.limits.model_dump(exclude_none=True) if b.limits else None
        return m.create(tier=b.tier, base=b.base, snapshot_id=b.snapshot_id, timeout_s=b.timeout_s,
                        auto_pause=b.auto_pause, limits=limits, env=b.env, metadata=b.metadata)

    @app.get("/sandboxes")
    def list_sandboxes():
        return m.list()

    @app.get("/sandboxes/{sandbox_id}")
    def get(sandbox_id: str):
        return m.get(sandbox_id)

    @app.delete("/sandboxes/{sandbox_id}", status_code=204)
    def kill(sandbox_id: str):
        m.kill(sandbox_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause")
    def pause(sandbox_id: str):
        return m.pause(sandbox_id)

    @app.post("/sandboxes/{sandbox_id}/resume")
    def resume(sandbox_id: str):
        return m.resume(sandbox_id)

    @app.post("/sandboxes/{sandbox_id}/timeout")
    def set_timeout(sandbox_id: str, body: TimeoutIn):
        return m.set_timeout(sandbox_id, body.timeout_s)

    @app.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    def checkpoint(sandbox_id: str):
        return m.checkpoint(sandbox_id)

    @app.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    def fork(sandbox_id: str, body: ForkIn | None = Body(None)):
        return m.fork(sandbox_id, (body or ForkIn()).count)

    @app.post("/sandboxes/{sandbox_id}/exec")
    def exec_(sandbox_id: str, body: ExecIn):
        stdin = None
        if body.stdin_b64 is not None:
            try:
                stdin = base64.b64decode(body.stdin_b64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise BadRequest(f"stdin_b64 is not valid base64: {e}") from e
        r = m.exec(sandbox_id, body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd, stdin=stdin)
        return r.to_dict()

    # ---- files --------------------------------------------------------------------------------------
    @app.get("/sandboxes/{sandbox_id}/files")
    def read_file(sandbox_id: str, path: str = Query(...)):
        return Response(content=m.read_file(sandbox_id, path), media_type="application/octet-stream")

    @app.put("/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, request: Request, path: str = Query(...), mode: str | None = Query(None)):
        try:
            fmode = int(mode, 8) if mode is not None else 0o644
        except ValueError:
            raise BadRequest(f"mode must be octal digits (e.g. 644), got {mode!r}") from None
        cap = await run_in_threadpool(m.upload_limit, sandbox_id)  # 404 before reading a byte
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise BadRequest("invalid Content-Length") from None
            if n > cap:
                raise TooLarge(f"upload of {n} bytes exceeds the limit of {cap} bytes")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > cap:
                raise TooLarge(f"upload exceeds the limit of {cap} bytes")
        await run_in_threadpool(m.write_file, sandbox_id, path, bytes(buf), fmode)
        return Response(status_code=204)

    @app.get("/sandboxes/{sandbox_id}/files/list")
    def list_files(sandbox_id: str, path: str = Query("/")):
        return [{"name": f.name, "path": f.path, "is_dir": f.is_dir, "size": f.size}
                for f in m.list_files(sandbox_id, path)]

    # ---- snapshots ----------------------------------------------------------------------------------
    @app.get("/snapshots")
    def list_snapshots():
        return m.list_snapshots()

    @app.get("/snapshots/{snapshot_id}")
    def get_snapshot(snapshot_id: str):
        return m.get_snapshot(snapshot_id)

    @app.delete("/snapshots/{snapshot_id}", status_code=204)
    def delete_snapshot(snapshot_id: str):
        m.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    return app


def serve(manager: SandboxManager, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info") -> None:
    """Run the server in the foreground until SIGINT/SIGTERM, then pause running sandboxes (`shutdown`, from
    the app's lifespan: uvicorn re-raises the signal once it has stopped, so code after `run` may never run)."""
    import uvicorn
    try:
        uvicorn.run(create_app(manager, api_key, shutdown_manager=True), host=host, port=port, log_level=log_level)
    finally:
        manager.shutdown()
