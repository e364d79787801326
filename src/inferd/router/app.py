"""`inferd router`: an OpenAI-compatible front over several OpenAI-compatible servers.

Per request: parse just enough of the body to route it (the prompt's text: no backend's tokenizer is
needed), pick a live backend with the policy, forward the body untouched. A backend that fails
before the first byte of its answer (connection refused or reset, 502/503/504) costs the request
nothing: it is sent once more, to another backend. Once bytes have gone to the client the answer
is that backend's: a stream that breaks mid-way ends with an SSE error event and [DONE], never a
silent truncation; a plain answer that breaks is a 502. Streams are passed on chunk by chunk as
they arrive; the next chunk is read only when the client took the last, so a slow reader slows
its backend stream, not the router's memory.

`Router` holds the backends, their balancers, the metrics and one HTTP client; each route is one of
its methods, and every request they make of a backend goes through `Router.send`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferd.distributed.policy import Balancer, Pick
from inferd.errors import openai_error
from inferd.router.backends import Pool
from inferd.router.disagg import kv_params_of, prefill_body, route
from inferd.web.assets import HEADERS, PAGES, asset
from inferd.web.feed import events

log = logging.getLogger("inferd")

RETRY_STATUSES = (502, 503, 504)
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-authorization", "proxy-connection", "accept-encoding"}
ANSWER_HEADERS = ("retry-after", "x-request-id")  # of a backend's answer, the ones its client may act on


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    """The router's own failure, its code the HTTP status (as `inferd serve` answers)."""
    return JSONResponse(openai_error(message, type_, code=status), status_code=status, headers=headers)


def headers_named(headers, names) -> dict:
    return {k: v for k, v in headers.items() if k.lower() in names}


def routing_text(body: dict, chat: bool) -> str:
    """What the prefix policy matches on: the prompt as text, or the chat messages in order."""
    if chat:
        parts = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}:{c if isinstance(c, str) else ''}\n")
        return "".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in p)
    return ""


class RouterMetrics:
    def __init__(self, urls: list[str]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("inferd:router_requests", "Requests sent to each backend (retries included).",
                                ["backend"], registry=r)
        self.retries = Counter("inferd:router_retries", "Requests sent again after their backend failed "
                               "before answering.", ["backend"], registry=r)
        self.failed = Counter("inferd:router_failed", "Requests that got no answer from any backend, or whose "
                              "backend broke mid-answer.", ["reason"], registry=r)
        self.up = Gauge("inferd:router_backend_up", "1 if the backend passes its health check.", ["backend"],
                        registry=r)
        self.backends_up = Gauge("inferd:router_backends_up", "Backends passing their health check.", registry=r)
        self.inflight = Gauge("inferd:router_requests_in_flight", "Requests open at each backend.", ["backend"],
                              registry=r)
        self.disagg = Counter("inferd:router_disagg_requests", "Requests by path with prefill workers (disagg: "
                              "prefilled then decoded; short, ineligible: straight to a decode worker; fallback: "
                              "no prefill worker could take it).", ["path"], registry=r)
        self.prefill_failed = Counter("inferd:router_prefill_failures", "Prefill requests that got no "
                                      "kv_transfer_params (transport error, 5xx, not a producer).", ["backend"],
                                      registry=r)
        self.decisions = Counter("inferd:router_decisions", "Routing decisions by reason (prefix: followed the "
                                 "cache; balance: load overrode it; new: no backend had the prefix).",
                                 ["reason"], registry=r)
        self.kv_blocks = Gauge("inferd:router_kv_event_blocks", "kv_events policy: prefix blocks each backend's "
                               "pool holds, as its KV events say.", ["backend"], registry=r)
        self.kv_batches = Gauge("inferd:router_kv_event_batches", "kv_events policy: KV event batches received "
                                "from each backend (replayed ones included).", ["backend"], registry=r)
        for u in urls:
            self.requests.labels(backend=u)
            self.up.labels(backend=u).set(0)
            self.inflight.labels(backend=u).set(0)


@dataclass
class Answer:
    """What one request to one backend got: its response, or the transport error that stopped it."""
    url: str
    path: str
    release: Callable[[], None]  # a client's request stops counting in the backend's load (idempotent)
    resp: httpx.Response | None = None
    error: httpx.HTTPError | None = None

    @property
    def status(self) -> int | None:
        return None if self.resp is None else self.resp.status_code

    def document(self) -> tuple[dict | None, str]:
        """A read answer's JSON object if it is a 200 with one; else None and why not."""
        if self.error is not None:
            return None, f"unreachable: {type(self.error).__name__}"
        if self.resp.status_code != 200:
            return None, f"{self.path} answered {self.resp.status_code}"
        try:
            doc = self.resp.json()
        except ValueError:
            doc = None
        return (doc, "") if isinstance(doc, dict) else (None, f"{self.path} answered no JSON")

    def passed_on(self, content: bytes) -> Response:
        """The backend's whole answer as the client's."""
        return Response(content, status_code=self.resp.status_code,
                        media_type=self.resp.headers.get("content-type", "application/json"),
                        headers=headers_named(self.resp.headers, ANSWER_HEADERS))

    async def close(self):
        self.release()
        if self.resp is not None:
            # shielded: a client that disconnected cancels this task, and an unshielded await in a
            # cancelled anyio scope raises at once, leaving the backend's stream (and its KV) open
            with anyio.CancelScope(shield=True):
                await self.resp.aclose()


class Router:
    """The front: `urls` answer requests (with `prefill_urls`: the decode workers); `app` serves it."""

    def __init__(self, urls: list[str], policy: str = "prefix", health_interval: float = 2.0,
                 request_timeout: float = 600.0, max_body_bytes: int = 4 << 20, chunk_chars: int = 64,
                 cache_chunks: int = 1 << 16, balance_abs: float = 4, balance_rel: float = 1.5,
                 cache_threshold: float = 0.5, prefill_urls: list[str] | None = None, disagg_min_chars: int = 0,
                 kv_events: dict | None = None, tokenizer=None, block_size: int = 16):
        prefill_urls = list(prefill_urls or [])
        # kv_events: url -> (events endpoint, replay endpoint); the tokenizer turns a request into the
        # token ids its backend will hash (block_size tokens a block)
        self.kv_index = self.tokenizer = None
        self.block_size = block_size
        matcher = None
        if policy == "kv_events":
            from inferd.router.kv_index import KVEventIndex

            self.kv_index = KVEventIndex(kv_events)
            self.tokenizer = tokenizer
            matcher = self.kv_index.match
        self.max_body_bytes = max_body_bytes
        self.disagg_min_chars = disagg_min_chars
        self.retry_after = {"Retry-After": str(max(1, int(health_interval)))}  # when a backend may be back
        self.metrics = RouterMetrics(prefill_urls + urls)

        def balancer_for(targets):
            return Balancer(targets, policy, chunk=chunk_chars, capacity=cache_chunks,
                            cache_threshold=cache_threshold, balance_abs=balance_abs, balance_rel=balance_rel,
                            matcher=matcher)

        self.balancer = balancer_for(urls)
        self.pbalancer = balancer_for(prefill_urls) if prefill_urls else None
        timeout = httpx.Timeout(connect=5.0, read=request_timeout, write=30.0, pool=30.0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=4096,
                                                                              max_keepalive_connections=256))
        self.pool = Pool(prefill_urls + urls, self.client, health_interval, self.on_change)
        self.engine_counts: dict[str, int] = {}  # engines per backend at its last answer: indexes stay put
        self.app = self.starlette()

    def starlette(self) -> Starlette:
        routes = [Route("/v1/completions", self.generate, methods=["POST"]),
                  Route("/v1/chat/completions", self.generate, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prom, methods=["GET"]),
                  Route("/", self.page, methods=["GET"]),
                  Route("/dashboard", self.page, methods=["GET"]),
                  Route("/static/{name}", self.page, methods=["GET"]),
                  Route("/v1/engine/state", self.engine_state, methods=["GET"]),
                  Route("/v1/engine/state/stream", self.engine_state_stream, methods=["GET"])]
        app = Starlette(routes=routes, lifespan=self.lifespan,
                        exception_handlers={404: self.not_found, 405: self.not_found})
        app.state.pool, app.state.balancer, app.state.metrics = self.pool, self.balancer, self.metrics
        return app

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await asyncio.gather(*(self.pool.check(b) for b in self.pool.backends.values()))
        health = asyncio.create_task(self.pool.run())
        try:
            yield
        finally:
            health.cancel()
            await self.client.aclose()
            if self.kv_index is not None:
                self.kv_index.close()

    def on_change(self, b, up: bool):
        self.metrics.up.labels(backend=b.url).set(1 if up else 0)
        self.metrics.backends_up.set(len(self.pool.live()))
        for bal in (self.balancer, self.pbalancer):
            if bal is not None and b.url in bal.targets:
                bal.forget(b.url)  # down: whatever it cached may be gone when it is back
        if self.kv_index is not None and not up:
            self.kv_index.forget(b.url)

    # -- sending to a backend -------------------------------------------------------------------
    def choices(self, balancer: Balancer, text: str) -> Iterator[tuple[int, Pick]]:
        """The policy's pick among the live backends; asked again (the pick failed before answering),
        once more among the others."""
        tried: list[str] = []
        for attempt in range(2):
            live = [u for u in self.pool.live() if u in balancer.targets and u not in tried]
            if not live:
                return
            pick = balancer.pick(text, self.pool.loads(), live)
            tried.append(pick.target)
            yield attempt, pick

    def count(self, url: str, hashes: list[int] | None = None) -> Callable[[], None]:
        """Count a client's request as open at `url` (with the kv_events policy, its prefix blocks as
        coming there); the function returned uncounts it, once."""
        b = self.pool.backends[url]
        unreserve = self.kv_index.reserve(url, hashes) if self.kv_index is not None and hashes else None
        b.inflight += 1
        b.sent += 1
        self.metrics.requests.labels(backend=url).inc()
        self.metrics.inflight.labels(backend=url).inc()
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                if unreserve is not None:
                    unreserve()
                b.inflight -= 1
                self.metrics.inflight.labels(backend=url).dec()

        return release

    async def send(self, url: str, path: str, headers: dict, content: bytes | None = None, stream: bool = False,
                   timeout=httpx.USE_CLIENT_DEFAULT, hashes: list[int] | None = None) -> Answer:
        """POST a client's request (`content`) to a backend, or GET the router's own question of it.

        Never raises for the backend's failures: a transport error is the answer's `error`. A
        client's request counts in the backend's load until its answer is read (`stream`: until
        `Answer.close`), and a backend it cannot reach is marked down at once, not at its next
        health check. The router's own questions (the dashboard's, the model list) count nowhere
        and mark nothing down: a slow dashboard is no reason to stop routing there.
        """
        ans = Answer(url, path, self.count(url, hashes) if content is not None else (lambda: None))
        try:
            req = self.client.build_request("GET" if content is None else "POST", url + path, content=content,
                                            headers=headers, timeout=timeout)
            ans.resp = await self.client.send(req, stream=stream)
        except httpx.HTTPError as e:
            ans.error = e
            if content is not None:
                self.pool.mark(self.pool.backends[url], False, f"{type(e).__name__}: {e}" if str(e)
                               else type(e).__name__)
        finally:
            if ans.resp is None or not stream:  # a stream's reader releases it
                ans.release()
        return ans

    async def relay(self, ans: Answer) -> Response:
        """A backend's streamed answer, passed on as it arrives (`send(..., stream=True)`)."""
        resp = ans.resp
        ctype = resp.headers.get("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                data = await resp.aread()
            except httpx.HTTPError as e:
                self.metrics.failed.labels(reason="broken_answer").inc()
                return error_response(502, f"backend {ans.url} broke off its answer ({type(e).__name__})",
                                      "bad_gateway")
            finally:
                await ans.close()
            return ans.passed_on(data)

        async def chunks():
            try:
                async for part in resp.aiter_raw():
                    yield part
            except httpx.HTTPError as e:
                self.metrics.failed.labels(reason="broken_stream").inc()
                msg = f"backend {ans.url} broke off the stream ({type(e).__name__})"
                yield b"data: " + json.dumps(openai_error(msg, "bad_gateway", code=502)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:  # also when the client left: closing the upstream stream aborts it at the backend
                await ans.close()

        return StreamingResponse(chunks(), status_code=resp.status_code, media_type=ctype,
                                 headers=headers_named(resp.headers, ANSWER_HEADERS))

    def unavailable(self, msg: str) -> JSONResponse:
        return error_response(503, msg, "service_unavailable", self.retry_after)

    # -- generation -----------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes | Response:
        too_large = f"request body over {self.max_body_bytes} bytes"
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            return error_response(413, too_large)
        data = bytearray()
        try:
            async for part in request.stream():
                data += part
                if len(data) > self.max_body_bytes:
                    return error_response(413, too_large)
        except ClientDisconnect:
            return Response(status_code=400)
        return bytes(data)

    async def generate(self, request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        raw = await self.read_body(request)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        text = routing_text(body, chat)
        hashes = self.block_hashes(body, chat) if self.kv_index is not None else None
        key = (hashes, text) if hashes is not None else text
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.pbalancer is not None:
            path = route(body, chat, text, self.disagg_min_chars)
            if path == "disagg":
                got = await self.prefill(request.url.path, body, chat, text, headers)
                if isinstance(got, Response):
                    return got  # the prefill worker's 4xx: the client's answer
                if got is None:
                    path = "fallback"
                else:
                    raw = json.dumps({**body, "kv_transfer_params": got}).encode()
            self.metrics.disagg.labels(path=path).inc()
        last_error = ""
        for attempt, pick in self.choices(self.balancer, key):
            self.metrics.decisions.labels(reason=pick.reason).inc()
            if attempt:
                self.metrics.retries.labels(backend=pick.target).inc()
            ans = await self.send(pick.target, request.url.path, headers, raw, stream=True,
                                  hashes=hashes)
            if ans.error is not None:
                last_error = f"{ans.url}: {type(ans.error).__name__}"
                continue
            if ans.status in RETRY_STATUSES and attempt == 0 and len(self.pool.live()) > 1:
                await ans.close()
                last_error = f"{ans.url}: {ans.status}"
                continue
            return await self.relay(ans)
        self.metrics.failed.labels(reason="no_backend").inc()
        return self.unavailable(f"no backend could take the request (last: {last_error})" if last_error
                                else "no healthy backend")

    def block_hashes(self, body: dict, chat: bool) -> list[int]:
        """The request's prefix-cache block hashes, as its backend will compute them: the prompt's
        token ids (the chat template's, for chat) hashed a block at a time. A body the tokenizer
        cannot read routes as a new prefix (the backend gives the client its error)."""
        from inferd.distributed.kv_events import hash_chain

        tok = self.tokenizer
        try:
            if chat:
                # as the server renders them: developer is OpenAI's newer name of system
                msgs = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                        for m in body.get("messages") or []]
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            else:
                p = body.get("prompt")
                if isinstance(p, list) and p and isinstance(p[0], int):
                    ids = p
                else:
                    ids = tok.encode(p if isinstance(p, str) else p[0] if isinstance(p, list) and p else "")
        except Exception:  # noqa: BLE001
            return []
        # the base model's chain (an adapter's starts elsewhere: its requests route as new prefixes);
        # the last token is never a cached block's (match_prefix leaves it to compute)
        return hash_chain(list(ids)[:-1], self.block_size)

    async def prefill(self, path: str, body: dict, chat: bool, text: str, headers: dict):
        """Phase 1 on a prefill worker: its kv_transfer_params, None if no worker could give them,
        or the worker's 4xx answer."""
        pbody = json.dumps(prefill_body(body, chat)).encode()
        for _, pick in self.choices(self.pbalancer, text):
            ans = await self.send(pick.target, path, headers, pbody)
            if ans.status is not None and 400 <= ans.status < 500:
                return ans.passed_on(ans.resp.content)
            kvp = kv_params_of(ans.document()[0])
            if kvp is not None:
                return kvp
            self.metrics.prefill_failed.labels(backend=ans.url).inc()
            if ans.error is None:
                log.warning("prefill worker %s answered %d without kv_transfer_params", ans.url, ans.status)
        return None

    # -- the rest of the API --------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        seen, data = set(), []
        auth = headers_named(request.headers, ("authorization",))
        for url in self.pool.live():
            doc, _ = (await self.send(url, "/v1/models", auth)).document()
            items = doc.get("data", []) if doc is not None else []
            for m in items if isinstance(items, list) else []:
                if isinstance(m, dict) and m.get("id") not in seen:
                    seen.add(m.get("id"))
                    data.append(m)
        if not data and not self.pool.live():
            return self.unavailable("no healthy backend")
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        live = self.pool.live()
        body = {"status": "ok" if live else "error", "backends_up": len(live), "backends": len(self.pool.backends)}
        return JSONResponse(body, status_code=200 if live else 503, headers=None if live else self.retry_after)

    async def prom(self, request: Request) -> Response:
        if self.kv_index is not None:
            for url, blocks in self.kv_index.blocks.items():
                self.metrics.kv_blocks.labels(backend=url).set(len(blocks))
                self.metrics.kv_batches.labels(backend=url).set(self.kv_index.counts[url]["batches"])
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(self, request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        kind = "not_found_error" if code == 404 else "invalid_request_error"
        return error_response(code, "no such route" if code == 404 else "method not allowed", kind)

    # -- the pages, and the dashboard's state of every backend's engines ---------------------------
    async def page(self, request: Request) -> Response:
        name = PAGES.get(request.url.path) or request.path_params.get("name", "")
        found = asset(name)
        if found is None:
            return error_response(404, "no such file", "not_found_error")
        return Response(found[0], media_type=found[1], headers=HEADERS)

    async def backend_states(self, request: Request) -> tuple[list[dict], str | None] | Response:
        """Every backend's engines, numbered across backends in their order (prefill workers first)."""
        auth = headers_named(request.headers, ("authorization",))
        answers = await asyncio.gather(*(self.send(u, "/v1/engine/state", auth, timeout=10.0)
                                         for u in self.pool.backends))
        out, model = [], None
        for ans in answers:
            if ans.status == 401:  # the API key is the backends' to check
                if ans.resp.headers.get("content-type", "").startswith("application/json"):
                    return ans.passed_on(ans.resp.content)
                return error_response(401, "invalid or missing API key", "authentication_error")
            body, err = ans.document()
            if body is None:
                for i in range(self.engine_counts.get(ans.url, 1)):
                    out.append({"backend": ans.url, "backend_engine": i, "dead": err})
                continue
            model = model or body.get("model")
            self.engine_counts[ans.url] = len(body.get("engines", []))
            out.extend({**st, "backend": ans.url, "backend_engine": st.get("engine", 0)}
                       for st in body.get("engines", []))
        for i, st in enumerate(out):
            st["engine"] = i
        return out, model

    def state_document(self, engines: list[dict], model) -> dict:
        return {"object": "engine.state", "model": model, "time": time.time(),
                "draining": bool(getattr(self.app.state, "draining", False)), "engines": engines}

    async def engine_state(self, request: Request) -> Response:
        got = await self.backend_states(request)
        if isinstance(got, Response):
            return got
        return JSONResponse(self.state_document(*got))

    async def engine_state_stream(self, request: Request) -> Response:
        try:
            interval = float(request.query_params.get("interval", "0.25"))
        except ValueError:
            interval = -1.0
        if not 0.1 <= interval <= 10:
            return error_response(400, "interval: a number of seconds from 0.1 to 10")
        got = await self.backend_states(request)
        if isinstance(got, Response):
            return got
        model = got[1]

        async def fetch():
            nonlocal model
            again = await self.backend_states(request)
            if isinstance(again, Response):
                raise RuntimeError("a backend refused the API key")
            model = again[1] or model
            return again[0]

        body = events(fetch, lambda engines: self.state_document(engines, model), interval,
                      lambda: getattr(request.app.state, "draining", False),
                      lambda e: openai_error(str(e), "server_error", code=503))
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_router_app(urls: list[str], policy: str = "prefix", health_interval: float = 2.0,
                      request_timeout: float = 600.0, max_body_bytes: int = 4 << 20, chunk_chars: int = 64,
                      cache_chunks: int = 1 << 16, balance_abs: float = 4, balance_rel: float = 1.5,
                      cache_threshold: float = 0.5, prefill_urls: list[str] | None = None,
                      disagg_min_chars: int = 0, kv_events: dict | None = None, tokenizer=None,
                      block_size: int = 16) -> Starlette:
    """`urls` are the backends requests are answered by (with prefill_urls: the decode workers)."""
    return Router(urls, policy, health_interval, request_timeout, max_body_bytes, chunk_chars, cache_chunks,
                  balance_abs, balance_rel, cache_threshold, prefill_urls, disagg_min_chars, kv_events, tokenizer,
                  block_size).app
