"""How the gateway refuses: in OpenAI's error shape (``OpenAIError``), or with vLLM's own answer
as vLLM sent it (``UpstreamRefusal``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class UpstreamRefusal(Exception):
    """vLLM answered another status than 200: relayed to the client as vLLM sent it."""

    def __init__(self, status: int, payload: bytes):
        super().__init__(f"vLLM answered {status}")
        self.status, self.payload = status, payload


class OpenAIError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param
        self.retry_after_s = retry_after_s  # sent as Retry-After (a busy refusal)

    def response(self) -> JSONResponse:
        response = JSONResponse(
            {
                "error": {
                    "message": str(self),
                    "type": self.kind,
                    "param": self.param,
                    "code": self.status,
                }
            },
            status_code=self.status,
        )
        if self.retry_after_s is not None:
            response.headers["Retry-After"] = str(self.retry_after_s)
        return response
