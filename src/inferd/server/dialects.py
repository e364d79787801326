"""Which API dialect a request speaks, by its path, and its errors in that dialect's own shape.

One `ApiError` is raised wherever a request fails (the schemas, the routes, the engine client);
the one place it becomes a body is here, so a client of each API reads the error its own SDK
parses: OpenAI's `{"error": {message, type, param, code}}`, Anthropic's
`{"type": "error", "error": {type, message}}`, Ollama's `{"error": message}`.
"""
from __future__ import annotations

from inferd.server.protocol import ApiError

OPENAI, ANTHROPIC, OLLAMA = "openai", "anthropic", "ollama"

# Anthropic's error types by status (its API reference); the rest are api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 431: "request_too_large",
                    503: "overloaded_error", 529: "overloaded_error"}


def dialect_of(path: str) -> str:
    if path.startswith("/api/"):
        return OLLAMA
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    return OPENAI


def anthropic_error(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def ollama_error(message: str) -> dict:
    return {"error": message}


def error_body(err: ApiError, dialect: str) -> dict:
    if dialect == ANTHROPIC:
        return anthropic_error(err.message, err.status)
    if dialect == OLLAMA:
        return ollama_error(err.message)
    return err.body()


def route_of(path: str) -> str:
    """A path as a metrics label: the route's template, so that ids in paths add no series."""
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}" + ("/input_items" if path.endswith("/input_items") else "")
    return path if path in KNOWN_ROUTES else "other"


KNOWN_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/models", "/tokenize", "/detokenize", "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps",
    "/api/version", "/api/pull", "/api/push", "/api/create", "/api/delete", "/api/copy", "/v1/embeddings",
    "/api/embed", "/api/embeddings",
})
