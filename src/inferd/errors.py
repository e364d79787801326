"""The errors that cross a boundary.

InferdError is every user-facing failure: the CLI prints its message on one line and exits 2; the
server maps it to HTTP 400. EngineDead and Overloaded are what an engine client raises to the
server (503s); they live here, below the engine, because the data-parallel group in
inferd.distributed raises them too (inferd.engine.client re-exports them beside the protocol).
openai_error is the body every HTTP layer (server, router, mock server) answers a failure with."""


class InferdError(Exception):
    pass


class Busy(InferdError):
    """Refused because something is in use (an adapter with requests in flight): the caller answers 409."""


class Overloaded(Exception):
    """More requests waiting than --max-waiting: the caller answers 503."""


class EngineDead(RuntimeError):
    """The engine cannot go on (its loop raised, or its process died): every request fails with 503."""


def openai_error(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: int | str | None = None) -> dict:
    """OpenAI's error JSON, as clients parse it: all four fields present, null where unknown."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
