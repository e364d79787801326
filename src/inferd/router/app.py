"""`inferd router`: an OpenAI-compatible front over several OpenAI-compatible servers.

Per request: parse just enough of the body to route it (the prompt's text: no backend's tokenizer is
needed), pick a live backend with the policy, forward the body untouched. A backend that fails
before the first byte of its answer (connection refused or reset, 502/503/504) costs the request
nothing: it is sent once more, to another backend. Once bytes have gone to the client the answer
is that backend's: a stream that breaks mid-way ends with an SSE error event and [DONE], never a
silent truncation; a plain answer that breaks is a 502. Streams are passed on chunk by chunk as
they arrive; the next chunk is read only when the client took the last, so a slow reader slows
its backend stream, not the router's memory.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferd.distributed.policy import Balancer
from inferd.errors import openai_error
from inferd.router.backends import Pool
from inferd.router.disagg import kv_params_of, prefill_body, route
from inferd.web.assets import HEADERS, PAGES, asset
from inferd.web.feed import events

log = logging.getLogger("inferd")

RETRY_STATUSES = (502, 503, 504)
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-authorization", "proxy-connection", "accept-encoding"}


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400) -> dict:
    return openai_error(message, type_, code=code)


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
        for u in urls:
            self.requests.labels(backend=u)
            self.up.labels(backend=u).set(0)
            self.inflight.labels(backend=u).set(0)


def create_router_app(urls: list[str], policy: str = "prefix", health_interval: float = 2.0,
                      request_timeout: float = 600.0, max_body_bytes: int = 4 << 20, chunk_chars: int = 64,
                      cache_chunks: int = 1 << 16, balance_abs: float = 4, balance_rel: float = 1.5,
                      cache_threshold: float = 0.5, prefill_urls: list[str] | None = None,
                      disagg_min_chars: int = 0) -> Starlette:
    """`urls` are the backends requests are answered by (with prefill_urls: the decode workers)."""
    import httpx

    prefill_urls = list(prefill_urls or [])
    metrics = RouterMetrics(prefill_urls + urls)

    def balancer_for(targets):
        return Balancer(targets, policy, chunk=chunk_chars, capacity=cache_chunks, cache_threshold=cache_threshold,
                        balance_abs=balance_abs, balance_rel=balance_rel)

    balancer = balancer_for(urls)
    pbalancer = balancer_for(prefill_urls) if prefill_urls else None
    state: dict = {}

    def on_change(b, up: bool):
        metrics.up.labels(backend=b.url).set(1 if up else 0)
        metrics.backends_up.set(len(pool.live()))
        for bal in (balancer, pbalancer):
            if bal is not None and b.url in bal.targets:
                bal.forget(b.url)  # down: whatever it cached may be gone when it is back

    timeout = httpx.Timeout(connect=5.0, read=request_timeout, write=30.0, pool=30.0)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=4096,
                                                                     max_keepalive_connections=256))
    pool = Pool(prefill_urls + urls, client, health_interval, on_change)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.gather(*(pool.check(b) for b in pool.backends.values()))
        state["health"] = asyncio.create_task(pool.run())
        try:
            yield
        finally:
            state["health"].cancel()
            await client.aclose()

    def unavailable(msg: str) -> JSONResponse:
        return JSONResponse(error_body(msg, "service_unavailable", 503), status_code=503,
                            headers={"Retry-After": str(max(1, int(health_interval)))})

    async def read_body(request: Request) -> bytes | Response:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            return JSONResponse(error_body(f"request body over {max_body_bytes} bytes", code=413), status_code=413)
        data = bytearray()
        try:
            async for part in request.stream():
                data += part
                if len(data) > max_body_bytes:
                    return JSONResponse(error_body(f"request body over {max_body_bytes} bytes", code=413),
                                        status_code=413)
        except ClientDisconnect:
            return Response(status_code=400)
        return bytes(data)

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        raw = await read_body(request)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return JSONResponse(error_body("request body is not valid JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("request body must be a JSON object"), status_code=400)
        text = routing_text(body, chat)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if pbalancer is not None:
            path = route(body, chat, text, disagg_min_chars)
            if path == "disagg":
                got = await prefill(request.url.path, body, chat, text, headers)
                if isinstance(got, Response):
                    return got  # the prefill worker's 4xx: the client's answer
                if got is None:
                    path = "fallback"
                else:
                    raw = json.dumps({**body, "kv_transfer_params": got}).encode()
            metrics.disagg.labels(path=path).inc()
        tried: list[str] = []
        last_error = ""
        for attempt in range(2):  # the first choice, then once more elsewhere if it failed before answering
            live = [u for u in pool.live() if u not in tried and u in balancer.targets]
            if not live:
                break
            pick = balancer.pick(text, pool.loads(), live)
            url = pick.target
            tried.append(url)
            metrics.decisions.labels(reason=pick.reason).inc()
            metrics.requests.labels(backend=url).inc()
            if attempt:
                metrics.retries.labels(backend=url).inc()
            b = pool.backends[url]
            b.inflight += 1
            metrics.inflight.labels(backend=url).inc()
            b.sent += 1
            released = False

            def release(b=b, url=url):
                nonlocal released
                if not released:
                    released = True
                    b.inflight -= 1
                    metrics.inflight.labels(backend=url).dec()

            try:
                req = client.build_request("POST", url + request.url.path, content=raw, headers=headers)
                resp = await client.send(req, stream=True)
            except httpx.HTTPError as e:
                release()
                last_error = f"{url}: {type(e).__name__}"
                pool.mark(b, False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                continue
            if resp.status_code in RETRY_STATUSES and attempt == 0 and len(pool.live()) > 1:
                await resp.aclose()
                release()
                last_error = f"{url}: {resp.status_code}"
                continue
            return await relay(resp, release, url)
        metrics.failed.labels(reason="no_backend").inc()
        if last_error:
            return JSONResponse(error_body(f"no backend could take the request (last: {last_error})",
                                           "service_unavailable", 503), status_code=503,
                                headers={"Retry-After": str(max(1, int(health_interval)))})
        return unavailable("no healthy backend")

    async def prefill(path: str, body: dict, chat: bool, text: str, headers: dict):
        """Phase 1 on a prefill worker: its kv_transfer_params, None if no worker could give them,
        or the worker's 4xx answer."""
        pbody = json.dumps(prefill_body(body, chat)).encode()
        tried: list[str] = []
        for _ in range(2):
            live = [u for u in pool.live() if u in pbalancer.targets and u not in tried]
            if not live:
                break
            url = pbalancer.pick(text, pool.loads(), live).target
            tried.append(url)
            b = pool.backends[url]
            b.inflight += 1
            b.sent += 1
            metrics.requests.labels(backend=url).inc()
            metrics.inflight.labels(backend=url).inc()
            try:
                resp = await client.post(url + path, content=pbody, headers=headers)
            except httpx.HTTPError as e:
                pool.mark(b, False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                metrics.prefill_failed.labels(backend=url).inc()
                continue
            finally:
                b.inflight -= 1
                metrics.inflight.labels(backend=url).dec()
            if 400 <= resp.status_code < 500:
                keep = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"), headers=keep)
            try:
                kvp = kv_params_of(resp.json()) if resp.status_code == 200 else None
            except ValueError:
                kvp = None
            if kvp is not None:
                return kvp
            metrics.prefill_failed.labels(backend=url).inc()
            log.warning("prefill worker %s answered %d without kv_transfer_params", url, resp.status_code)
        return None

    async def close(resp):
        # shielded: a client that disconnected cancels this task, and an unshielded await in a
        # cancelled anyio scope raises at once, leaving the backend's stream (and its KV) open
        with anyio.CancelScope(shield=True):
            await resp.aclose()

    async def relay(resp, release, url: str) -> Response:
        ctype = resp.headers.get("content-type", "application/json")
        keep = {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after", "x-request-id")}
        if not ctype.startswith("text/event-stream"):
            try:
                data = await resp.aread()
            except httpx.HTTPError as e:
                metrics.failed.labels(reason="broken_answer").inc()
                return JSONResponse(error_body(f"backend {url} broke off its answer ({type(e).__name__})",
                                               "bad_gateway", 502), status_code=502)
            finally:
                release()
                await close(resp)
            return Response(data, status_code=resp.status_code, media_type=ctype, headers=keep)

        async def chunks():
            try:
                async for part in resp.aiter_raw():
                    yield part
            except httpx.HTTPError as e:
                metrics.failed.labels(reason="broken_stream").inc()
                msg = f"backend {url} broke off the stream ({type(e).__name__})"
                yield b"data: " + json.dumps(error_body(msg, "bad_gateway", 502)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:  # also when the client left: closing the upstream stream aborts it at the backend
                release()
                await close(resp)

        return StreamingResponse(chunks(), status_code=resp.status_code, media_type=ctype, headers=keep)

    async def models(request: Request) -> Response:
        seen, data = set(), []
        for url in pool.live():
            try:
                r = await client.get(url + "/v1/models", headers={k: v for k, v in request.headers.items()
                                                                  if k.lower() == "authorization"})
                items = r.json().get("data", []) if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            for m in items:
                if isinstance(m, dict) and m.get("id") not in seen:
                    seen.add(m.get("id"))
                    data.append(m)
        if not data and not pool.live():
            return unavailable("no healthy backend")
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        live = pool.live()
        body = {"status": "ok" if live else "error", "backends_up": len(live), "backends": len(pool.backends)}
        return JSONResponse(body, status_code=200 if live else 503,
                            headers=None if live else {"Retry-After": str(max(1, int(health_interval)))})

    async def prom(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- the pages, and the dashboard's state of every backend's engines ---------------------------
    async def page(request: Request) -> Response:
        name = PAGES.get(request.url.path) or request.path_params.get("name", "")
        found = asset(name)
        if found is None:
            return JSONResponse(error_body("no such file", "not_found_error", 404), status_code=404)
        return Response(found[0], media_type=found[1], headers=HEADERS)

    engine_counts: dict[str, int] = {}  # engines per backend at its last answer: indexes stay put while one is down

    async def backend_states(request: Request) -> tuple[list[dict], str | None] | Response:
        """Every backend's engines, numbered across backends in their order (prefill workers first)."""
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def one(url):
            try:
                r = await client.get(url + "/v1/engine/state", headers=auth, timeout=10.0)
            except httpx.HTTPError as e:
                return url, None, f"unreachable: {type(e).__name__}"
            if r.status_code != 200:
                return url, r, f"/v1/engine/state answered {r.status_code}"
            try:
                return url, r.json(), None
            except ValueError:
                return url, None, "/v1/engine/state answered no JSON"

        answers = await asyncio.gather(*(one(u) for u in pool.backends))
        out, model = [], None
        for url, body, err in answers:
            if err is not None and body is not None and body.status_code == 401:
                return JSONResponse(body.json() if body.headers.get("content-type", "").startswith(
                    "application/json") else error_body("invalid or missing API key", "authentication_error", 401),
                    status_code=401)
            if err is not None:
                for i in range(engine_counts.get(url, 1)):
                    out.append({"backend": url, "backend_engine": i, "dead": err})
                continue
            model = model or body.get("model")
            engine_counts[url] = len(body.get("engines", []))
            out.extend({**st, "backend": url, "backend_engine": st.get("engine", 0)} for st in body.get("engines", []))
        for i, st in enumerate(out):
            st["engine"] = i
        return out, model

    def state_document(engines: list[dict], model) -> dict:
        return {"object": "engine.state", "model": model, "time": time.time(),
                "draining": bool(getattr(app.state, "draining", False)), "engines": engines}

    async def engine_state(request: Request) -> Response:
        got = await backend_states(request)
        if isinstance(got, Response):
            return got
        return JSONResponse(state_document(*got))

    async def engine_state_stream(request: Request) -> Response:
        try:
            interval = float(request.query_params.get("interval", "0.25"))
        except ValueError:
            interval = -1.0
        if not 0.1 <= interval <= 10:
            return JSONResponse(error_body("interval: a number of seconds from 0.1 to 10"), status_code=400)
        got = await backend_states(request)
        if isinstance(got, Response):
            return got
        model = got[1]

        async def fetch():
            nonlocal model
            again = await backend_states(request)
            if isinstance(again, Response):
                raise RuntimeError("a backend refused the API key")
            model = again[1] or model
            return again[0]

        body = events(fetch, lambda engines: state_document(engines, model), interval,
                      lambda: getattr(request.app.state, "draining", False),
                      lambda e: error_body(str(e), "server_error", 503))
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        kind = "not_found_error" if code == 404 else "invalid_request_error"
        return JSONResponse(error_body("no such route" if code == 404 else "method not allowed", kind, code),
                            status_code=code)

    routes = [Route("/v1/completions", generate, methods=["POST"]),
              Route("/v1/chat/completions", generate, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prom, methods=["GET"]),
              Route("/", page, methods=["GET"]),
              Route("/dashboard", page, methods=["GET"]),
              Route("/static/{name}", page, methods=["GET"]),
              Route("/v1/engine/state", engine_state, methods=["GET"]),
              Route("/v1/engine/state/stream", engine_state_stream, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.pool, app.state.balancer, app.state.metrics = pool, balancer, metrics
    return app
