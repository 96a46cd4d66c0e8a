"""Errors shared by every layer; the HTTP ingress maps each class to one status code."""


class LoraLandError(Exception):
    """Base class; the message says what was wrong and what to do."""


class InvalidRequest(LoraLandError, ValueError):
    """Bad input from a caller (HTTP 400)."""


class UnknownAdapter(LoraLandError, KeyError):
    """An adapter, version, chain stage or merge term that does not exist (HTTP 404)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else ""


class InvalidAdapter(LoraLandError, ValueError):
    """An adapter folder that cannot be served: bad format, wrong shapes, unsafe files (HTTP 400/422)."""


class AdapterUnavailable(LoraLandError):
    """The adapter's source cannot be reached right now; retrying later may work (HTTP 503)."""


class QueueFull(LoraLandError):
    """The replica's waiting queue is full (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(LoraLandError):
    """A tenant or adapter is over a quota at the ingress (HTTP 429 with Retry-After from its bucket)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InternalError(LoraLandError):
    """A fault inside the server, not the caller's (HTTP 500); unlike an unexpected exception, its message is
    written for the caller and travels as it is."""


class CatalogUnavailable(LoraLandError):
    """Redis cannot be reached; the message names the URL."""
