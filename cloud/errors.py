"""The one error type of the cloud: a refusal that carries its gRPC status and a message a person can act on."""

from __future__ import annotations

import grpc


class CloudError(Exception):
    """A frame or call the cloud refuses; the stream, the session and every other session stay usable.

    On a Session stream it becomes an Error frame (`code` as its number); on a unary or server-streaming
    call the call ends with the status.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> CloudError:
    return CloudError(grpc.StatusCode.INVALID_ARGUMENT, message)
