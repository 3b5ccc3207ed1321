"""`APIError`: an error answered as an OpenAI-shaped JSON body, `{"error": {"message", "type", "param",
"code"}}`, with its HTTP status (and headers such as Retry-After or WWW-Authenticate)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from . import api


class APIError(Exception):
    """4xx: `type` "invalid_request_error"; 5xx: "server_error" (unless given)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return api.ErrorResponse(error=api.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                     code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
