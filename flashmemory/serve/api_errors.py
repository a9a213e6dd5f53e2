"""APIError and the one place that turns any failure into an OpenAI-shaped JSON error response."""

from __future__ import annotations

import re
from http import HTTPStatus

from starlette.responses import JSONResponse

from flashmemory.errors import (
    CapacityError,
    ConfigError,
    FlashMemoryError,
    PromptTooLongError,
    SamplingParamsError,
)

# OpenAI's error "type" per status (what its SDK maps to BadRequestError, AuthenticationError, ...).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# Sampling fields are named as in the Python API; clients know them by their OpenAI names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}


class APIError(Exception):
    """A failure to report to the client: HTTP status plus OpenAI's message / type / param / code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_exception(cls, e: Exception) -> "APIError":
        """Map a typed FlashMemory error (or anything else) to what the client may see: never a traceback."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, PromptTooLongError):
            return cls(400, str(e), param="prompt", code="context_length_exceeded")
        if isinstance(e, SamplingParamsError):
            return cls(400, str(e), param=_PARAM_NAMES.get(e.param, e.param), code="invalid_value")
        if isinstance(e, CapacityError):
            return cls(500, f"the KV cache could not hold this request: {e}", code="kv_capacity")
        if isinstance(e, (ConfigError, FlashMemoryError)):
            return cls(400, str(e), code="invalid_value")
        return cls(500, "internal server error; the server log has the details", code="internal_error")

    @classmethod
    def for_status(cls, status: int, detail: str | None = None) -> "APIError":
        """Errors raised by the framework itself (unknown route, wrong method)."""
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        return cls(status, detail or phrase)


_PATH = re.compile(r"(?<![\w.])(?:~|\.{1,2})?/[^\s'\"():,;]+")


def without_paths(text: str) -> str:
    """`text` with file system paths replaced by "<path>": what the server log may say, a client is not told
    (where the model and the cache live on the host)."""
    return _PATH.sub("<path>", text)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
