"""What one request may cost the server, and the plain-ASGI front that enforces it before any
route runs: the body size (413, counted as it arrives, so a body is never read whole past the
limit), the header size (431), a body that trickles in (408), a draining server (503), and the
API key (401, compared in constant time; as `Authorization: Bearer KEY`, or as Anthropic's clients
send it, `x-api-key: KEY`). Its refusals are in the shape of the dialect the path speaks
(dialects.py). Counts inside a request (prompts, messages, stop strings, n, logit_bias) are bounds
of the request schema (protocol.py)."""
from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from inferd.server.dialects import dialect_of, error_body, route_of
from inferd.server.generation import ARRIVAL
from inferd.server.protocol import ApiError
from inferd.web.assets import is_public


@dataclass
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    body_timeout_s: float = 30.0  # longest wait for the next piece of a request body
    stall_timeout_s: float = 30.0  # longest a stream may wait for its client to read before it is aborted

    @classmethod
    def from_args(cls, args) -> Limits:
        return cls(args.max_request_body_bytes, args.max_request_header_bytes, args.request_body_timeout,
                   args.stream_stall_timeout)


class Front:
    """The outermost ASGI layer. `state.draining` (set on SIGTERM) turns new requests into 503."""

    def __init__(self, app, api_key: str | None, limits: Limits, state, on_response=None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.expected_x = api_key.encode() if api_key else None
        self.limits = limits
        self.state = state
        self.on_response = on_response  # (route, dialect, status): the metrics' request counter

    def key_ok(self, headers) -> bool:
        """Each credential the request carries is compared (in constant time); one must match."""
        bearer = next((v for k, v in headers if k == b"authorization"), None)
        x_key = next((v for k, v in headers if k == b"x-api-key"), None)
        ok = False
        if bearer is not None or x_key is None:
            ok |= hmac.compare_digest(bearer or b"", self.expected)
        if x_key is not None:
            ok |= hmac.compare_digest(x_key, self.expected_x)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ARRIVAL.set(time.monotonic())
        lim = self.limits
        err = None
        if getattr(self.state, "draining", False) and scope["path"] != "/metrics":
            err = ApiError("server is shutting down", status=503, type_="server_error", code="shutting_down",
                           headers={"Connection": "close", "Retry-After": "1"})
        elif sum(len(k) + len(v) for k, v in scope["headers"]) > lim.max_header_bytes:
            err = ApiError(f"request headers are larger than the limit of {lim.max_header_bytes} bytes",
                           status=431, code="headers_too_large")
        elif (self.expected is not None and not scope["path"].startswith(("/health", "/metrics"))
              and not is_public(scope["path"])):
            if not self.key_ok(scope["headers"]):
                err = ApiError("invalid or missing API key", status=401, type_="authentication_error",
                               code="invalid_api_key")
        if err is None:
            length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            if length is not None and (not length.isdigit() or int(length) > lim.max_body_bytes):
                err = too_large(lim.max_body_bytes)
        if self.on_response is not None:
            send = self._counted(scope["path"], send)
        if err is not None:
            body = error_body(err, dialect_of(scope["path"]))
            return await JSONResponse(body, status_code=err.status, headers=err.headers)(scope, receive, send)
        await self.app(scope, bounded_receive(receive, lim), send)

    def _counted(self, path: str, send):
        async def counted(msg):
            if msg["type"] == "http.response.start":
                self.on_response(route_of(path), dialect_of(path), msg["status"])
            await send(msg)

        return counted


def too_large(limit: int) -> ApiError:
    return ApiError(f"request body is larger than the limit of {limit} bytes (--max-request-body-bytes)",
                    status=413, code="request_too_large")


def bounded_receive(receive, lim: Limits):
    """receive() that counts the body as it comes (413 past the limit, also for chunked bodies
    without a length) and waits at most body_timeout_s for each piece (408). Once the body is
    complete it passes through untouched: a stream listens on it for the client's disconnect."""
    seen = 0
    done = False

    async def inner():
        nonlocal seen, done
        if done:
            return await receive()
        try:
            msg = await asyncio.wait_for(receive(), lim.body_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPException(408, f"the request body did not arrive within {lim.body_timeout_s:g} s") from None
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > lim.max_body_bytes:
                raise HTTPException(413, too_large(lim.max_body_bytes).message)
            done = not msg.get("more_body", False)
        else:
            done = True
        return msg

    return inner
