"""Every error the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse

# OpenAI's error types by status: the clients' own exception classes follow the status, the type is for people
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 415: "invalid_request_error", 500: "server_error",
         503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # OpenAI's clients retry any 5xx twice unless told not to: ours repeat (out of memory, a bug), but a 503's
        self.headers = ({"x-should-retry": "false"} if status == 500 else {}) | (headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down")


def out_of_memory(dropped: bool = False) -> ApiError:
    """Memory ran out answering (in a step, or encoding the prompt); `dropped`: the kept conversations went too."""
    return ApiError(500, "out of memory: try a shorter prompt or fewer tokens"
                    + (" (the conversations kept for reuse were dropped)" if dropped else ""), code="out_of_memory")
