"""The one error type of the cloud: a refusal that carries its gRPC status and a message a person can act on."""

from __future__ import annotations

import grpc

from common import wire
from common.errors import SprinterError


class CloudError(SprinterError):
    """A frame or call the cloud refuses; the stream, the session and every other session stay usable.

    On a Session stream it becomes an Error frame (`code` as its number, `retry_after_ms` as is); on a
    unary or server-streaming call the call ends with the status and, when there is a hint, trailing
    metadata `retry-after-ms`. `retry_after_ms` > 0 says when a retry may succeed; 0: no retry will.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return wire.retry_hint_metadata(self.retry_after_ms)


def invalid(message: str) -> CloudError:
    return CloudError(grpc.StatusCode.INVALID_ARGUMENT, message)


def exhausted(message: str, retry_after_ms: int = 0) -> CloudError:
    return CloudError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_ms)
