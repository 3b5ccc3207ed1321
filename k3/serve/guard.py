"""`RequestGuard`: a pure ASGI middleware that checks raw HTTP requests before any route reads them.

    401  a missing or wrong API key (`Authorization: Bearer <key>`, as OpenAI clients send it), unless the
         path is open (/health)
    415  a request body whose Content-Type is not application/json (a browser page can post text/plain or
         form bodies to a local server without a CORS preflight; it cannot post application/json)
    413  a body over `max_body_bytes`: refused from its Content-Length, else counted while it streams in
         (chunked transfer encoding included), so at most `max_body_bytes` + one chunk is ever read
"""

from __future__ import annotations

import hmac

from .errors import APIError

_BODY_METHODS = {"POST", "PUT", "PATCH"}


def _too_large(n: str | int, limit: int) -> APIError:
    return APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes", code="request_too_large")


class RequestGuard:
    def __init__(self, app, *, max_body_bytes: int, api_key: str | None = None,
                 open_paths: tuple[str, ...] = ("/health",)):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key must be a non-empty string (or None for no authentication)")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._key = None if api_key is None else api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            receive = self._check(scope, receive)
        except APIError as e:
            return await e.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check(self, scope, receive):
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        if self._key is not None and scope.get("path") not in self.open_paths:
            got = headers.get(b"authorization", b"")
            scheme, _, token = got.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'"
                               if got else "missing API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope.get("method") not in _BODY_METHODS:
            return receive
        ctype = headers.get(b"content-type", b"").decode("latin-1")
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise APIError(415, f"Content-Type {ctype or '(none)'!r} is not supported; send application/json",
                           code="unsupported_media_type")
        n = headers.get(b"content-length", b"").decode("latin-1").strip()
        if n.isdigit() and int(n) > self.max_body_bytes:
            raise _too_large(n, self.max_body_bytes)
        return self._counting(receive)

    def _counting(self, receive):
        limit = self.max_body_bytes
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _too_large(f"more than {limit}", limit)
            return msg
        return counted
