"""What can go wrong running a request, said without HTTP: the API room (coordinator/api/openai_errors.py) gives each
kind its status. Malformed requests and engine failures keep amoe's own errors (amoe.errors: RequestError,
EngineDeadError, RequestFailed), which the API maps too."""

from __future__ import annotations

from amoe.errors import AmoeError


class RequestsError(AmoeError):
    """A request the coordinator could not run to its end."""


class Overloaded(RequestsError):
    """The waiting queue is full, or the server is shutting down: retry later."""


class TimedOut(RequestsError):
    """The request waited past its deadline (for KV space, or in all) or its stream stalled."""


class InternalError(RequestsError):
    """A bug hit this one request while it was admitted or ran (logged where it happened, with the request's id);
    the request fails alone."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
