"""OpenAI-shaped errors.

Every refusal Kiln sends has the body ``{"error": {"message", "type", "param", "code"}}`` so that
the OpenAI SDKs raise the right exception class. Code anywhere in the gateway raises ``ApiError``;
the app turns it into a response in one place.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """The common 400: the request body is wrong in a way the client must fix."""
    return ApiError(400, message, param=param, code=code)
