"""The one place that maps LoRA-Land's error classes (and Ray's) to HTTP status codes and OpenAI error bodies.

A replica's in-band `Failure` (app/protocol.py) arrives as the exception it names (the replica client raises
`Failure.to_exception()`), so it maps through the same table. OpenAI's shape:
{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}. The middleware in Serve's own
HTTP proxy, which answers for an ingress replica that died, is app/router/http/middleware.py.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from app.errors import (
    AdapterUnavailable,
    CatalogUnavailable,
    InvalidAdapter,
    InvalidRequest,
    LoraLandError,
    QueueFull,
    QuotaExceeded,
    UnknownAdapter,
)

# (status, OpenAI error type, code); the first matching class wins, so subclasses come first.
_TABLE: list[tuple[type[BaseException], int, str, str]] = [
    (UnknownAdapter, 404, "invalid_request_error", "model_not_found"),
    (InvalidAdapter, 400, "invalid_request_error", "invalid_adapter"),
    (InvalidRequest, 400, "invalid_request_error", "invalid_value"),
    (QueueFull, 429, "rate_limit_error", "queue_full"),
    (QuotaExceeded, 429, "rate_limit_error", "quota_exceeded"),
    (AdapterUnavailable, 503, "service_unavailable", "adapter_unavailable"),
    (CatalogUnavailable, 503, "service_unavailable", "catalog_unavailable"),
]

# "field: what was wrong" is the project's convention for naming the offending field in a message.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


class HTTPFailure(Exception):
    """An error the ingress answers directly (auth, routing); carries its own status and OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param, self.retry_after_s = param, retry_after_s


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict
    headers: dict[str, str]

    @property
    def retryable(self) -> bool:
        return self.status in (429, 502, 503, 504)


def _unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a replica's exception in RayTaskError; its cause is what we map. (Only RayTaskError:
    an ActorDiedError's cause is why the actor died, and the death is what the caller must hear about.)"""
    if "ray" not in sys.modules:  # no Ray in this process, so no Ray exception (and no 1-2 s import stall)
        return exc
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - ray is a dependency
        return exc
    for _ in range(5):
        cause = getattr(exc, "cause", None)
        if not isinstance(exc, RayTaskError) or not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return exc


def _ray_failure(exc: BaseException) -> HTTPFailure | None:
    """Replica deaths, timeouts and Serve back-pressure: retryable, and said so."""
    if isinstance(exc, TimeoutError):
        return HTTPFailure(
            504,
            "the model replica did not answer in time; retry, or lower max_tokens",
            type="service_unavailable",
            code="timeout",
            retry_after_s=1.0,
        )
    if "ray" not in sys.modules:
        return None
    try:
        from ray import exceptions as rex
        from ray.serve import exceptions as sex
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if isinstance(exc, sex.BackPressureError):
        return HTTPFailure(
            429,
            "too many requests are queued for the model replicas; retry after the Retry-After delay",
            type="rate_limit_error",
            code="queue_full",
            retry_after_s=getattr(exc, "retry_after_s", None) or 1.0,
        )
    died = (rex.RayActorError, rex.WorkerCrashedError, rex.ObjectLostError, sex.DeploymentUnavailableError)
    if isinstance(exc, died):
        return HTTPFailure(
            503,
            "the model replica serving this request stopped; the request was not completed, retry it",
            type="service_unavailable",
            code="replica_unavailable",
            retry_after_s=1.0,
        )
    return None


def error_reply(exc: BaseException) -> ErrorReply:
    """Status, OpenAI body and headers for any exception (unknown ones are 500 without internals)."""
    exc = _unwrap(exc)
    failure = exc if isinstance(exc, HTTPFailure) else _ray_failure(exc)
    if failure is None:
        for cls, status, etype, code in _TABLE:
            if isinstance(exc, cls):
                message = str(exc)
                param = getattr(exc, "param", None)
                if param is None and isinstance(exc, InvalidRequest):
                    m = _FIELD_PREFIX.match(message)
                    param = m.group(1) if m else None
                retry = getattr(exc, "retry_after_s", None) if status in (429, 503) else None
                failure = HTTPFailure(
                    status, message, type=etype, code=code, param=param, retry_after_s=retry
                )
                break
    if failure is None:
        internal = isinstance(exc, LoraLandError)
        failure = HTTPFailure(
            500,
            str(exc) if internal else f"internal error ({type(exc).__name__}); see the server log",
            type="server_error",
            code="internal_error",
        )
    headers = {}
    if failure.retry_after_s is not None or failure.status in (429, 503, 504):
        # Every retryable status says when to retry; clients (the openai package too) honour it.
        headers["Retry-After"] = str(max(1, round(failure.retry_after_s or 1)))
    body = {
        "error": {
            "message": failure.message,
            "type": failure.type,
            "param": failure.param,
            "code": failure.code,
        }
    }
    return ErrorReply(failure.status, body, headers)


def replica_failed(exc: BaseException) -> bool:
    """True when the replica died under the request (safe to retry: generation has no side effects)."""
    failure = _ray_failure(_unwrap(exc))
    return failure is not None and failure.code == "replica_unavailable"
