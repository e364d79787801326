"""Several models behind one server: which are loaded, loading them on demand, unloading idle ones.

Each model is its own engine client (by default its own engine core process: its weights, KV pool
and threads), started by the function `serve` hands in; this module only decides when. A request
names a model (or an alias); `Models.use` waits for it to load if it must, and holds a lease on it
for the request's duration, so that a model with a request between "picked" and "sent to the engine"
is as busy as one with open streams. Busy models are never unloaded.

When a model is unloaded:
- after `keep_alive` seconds without a request (Ollama's keep_alive; None: never);
- to make room for another: past `max_loaded` models, or past `memory_budget` bytes of the engine
  processes' resident memory, the least recently used idle model goes first. If every loaded model
  is busy the request that needed room gets 503 with Retry-After: it is not queued behind requests
  of another model that may never end;
- when an operator asks (`POST /models/unload`): new requests for it wait, its open ones finish.

A model that fails to load fails the requests waiting for it with one error (500) and stays
unloaded; the next request tries again. A loaded model whose engine dies is unloaded the same way
when the server has other models; alone, the server exits so that its supervisor restarts it (the
single-model behaviour, `inferd.server.serve`).

Everything here runs on the server's event loop; loading and shutting an engine down (seconds of
blocking work in another process) run on worker threads.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from inferd.config import lora_module
from inferd.errors import Busy, InferdError
from inferd.server.generation import Served
from inferd.server.protocol import ApiError

log = logging.getLogger("inferd")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
IDLE_CHECK_S = 0.25  # how often idle models are looked at (keep-alive, memory)
RETRY_AFTER_S = 2  # told to a request refused for want of room


@dataclass
class ModelSpec:
    """One model the server offers: its id, the other names it answers to, how to start it."""
    name: str
    config: object  # an EngineConfig: whatever `start` needs
    aliases: set[str] = field(default_factory=set)
    preload: bool = False
    keep_alive: float | None = None  # seconds idle before unloading; None: never
    source_path: str | None = None  # the weights on disk: their size is the first memory estimate


class Entry:
    """A model's place in the server: its state, its engine client once loaded, who uses it."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.state = UNLOADED
        self.served: Served | None = None
        self.leases = 0  # requests between picking this model and finishing with it
        self.last_used = time.monotonic()
        self.task: asyncio.Task | None = None  # the load in progress
        self.gone: asyncio.Event | None = None  # set when an unload in progress ends
        self.error: str | None = None  # why the last load failed
        self.load_seconds: float | None = None
        self.rss: int | None = None  # bytes the engine processes held when last measured
        self.loads = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def busy(self) -> bool:
        return self.leases > 0 or (self.served is not None and self.served.llm.open_requests() > 0)

    def estimate(self, baseline: int = 0) -> int:
        """Bytes this model will hold once loaded: what it held last time, else its files' size plus
        `baseline` (what an engine process holds besides its weights, as measured on others)."""
        if self.rss:
            return self.rss
        return path_bytes(self.spec.source_path) + baseline


class Models:
    """The served models. `start(spec) -> EngineClient` loads one (blocking; run on a thread);
    `served(spec, client) -> Served` wraps a loaded one for the endpoints."""

    def __init__(self, specs: list[ModelSpec], start: Callable, served: Callable, max_loaded: int = 0,
                 memory_budget: int | None = None, on_change: Callable | None = None):
        if not specs:
            raise ValueError("no models")
        self.entries = [Entry(s) for s in specs]
        self.by_name: dict[str, Entry] = {}
        # LoRA adapter name -> (its base model, its folder): the engine of that model holds it, and
        # its config lists it, so that the model loaded again loads it too
        self.adapters: dict[str, tuple[Entry, str]] = {}
        for e in self.entries:
            for spec in getattr(e.spec.config, "lora_modules", None) or []:
                name, path = lora_module(spec)
                if name in self.adapters:
                    raise InferdError(f"two LoRA adapters are named {name!r}")
                self.adapters[name] = (e, path)
        self._index()
        self.start, self.make_served = start, served
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.on_change = on_change or (lambda entry, event: None)
        self._watch: asyncio.Task | None = None

    def _index(self):
        """Names -> entries (again after a load: a model served alone is named by its weights)."""
        self.by_name = {}
        for e in self.entries:
            for n in [e.name, *sorted(e.spec.aliases)]:
                self.by_name.setdefault(n, e)
        for n in self.adapters:
            if n in self.by_name:
                raise InferdError(f"LoRA adapter {n!r} has the name of a model")

    @property
    def default(self) -> Entry:
        return self.entries[0]

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    # -- finding and using a model -----------------------------------------------------------------
    def find(self, name: str | None) -> Entry:
        """A base model by name (not an adapter)."""
        if name is None:
            return self.default
        e = self.by_name.get(name)
        if e is None:
            raise self._not_found(name)
        return e

    def resolve(self, name: str | None) -> tuple[Entry, str | None]:
        """A request's `model`: a base model, or a LoRA adapter (its base model, its name)."""
        if name is not None and name in self.adapters:
            return self.adapters[name][0], name
        return self.find(name), None

    def _not_found(self, name: str) -> ApiError:
        avail = ", ".join(self.names() + sorted(self.adapters))
        return ApiError(f"The model `{name}` does not exist. Available: {avail}.", status=404, param="model",
                        code="model_not_found", type_="not_found_error")

    @contextlib.asynccontextmanager
    async def use(self, name: str | None):
        """The Served of the named model (or adapter), loaded, with a lease for the body of the
        `async with`."""
        e, adapter = self.resolve(name)
        e.leases += 1
        try:
            await self.ensure_loaded(e)
            e.last_used = time.monotonic()
            yield e.served if adapter is None else e.served.with_adapter(adapter)
        finally:
            e.leases -= 1
            e.last_used = time.monotonic()

    def loaded_served(self) -> list[tuple[Entry, Served]]:
        return [(e, e.served) for e in self.entries if e.state == LOADED and e.served is not None]

    # -- loading -------------------------------------------------------------------------------------
    async def ensure_loaded(self, e: Entry):
        while True:
            if e.state == LOADED:
                return
            if e.state == LOADING:
                await asyncio.shield(e.task)
                continue
            if e.state == UNLOADING:
                await e.gone.wait()
                continue
            await self._make_room(e)
            if e.state == UNLOADED:  # nobody started it while room was made
                e.state = LOADING
                e.task = asyncio.get_running_loop().create_task(self._load(e))

    async def _load(self, e: Entry):
        t0 = time.monotonic()
        e.error = None
        self.on_change(e, "loading")
        try:
            client = await asyncio.to_thread(self.start, e.spec)
            self._adopt(e, client, t0)
        except BaseException as exc:  # noqa: BLE001 - becomes every waiting request's error
            raise self._failed(e, exc) from None

    def load_now(self, e: Entry):
        """Load on this thread (at start, before the server listens); a failure is raised as is."""
        t0 = time.monotonic()
        e.state = LOADING
        self.on_change(e, "loading")
        try:
            self._adopt(e, self.start(e.spec), t0)
        except BaseException as exc:
            self._failed(e, exc)
            raise

    def _adopt(self, e: Entry, client, t0: float):
        try:
            e.served = self.make_served(e.spec, client)
        except BaseException:
            client.shutdown()
            raise
        e.load_seconds = time.monotonic() - t0
        e.loads += 1
        e.state, e.task = LOADED, None
        e.last_used = time.monotonic()
        e.rss = engine_rss(client)
        self._index()
        log.info("model %s loaded in %.1f s (engine resident %.0f MiB)", e.name, e.load_seconds, (e.rss or 0) / 2**20)
        self.on_change(e, "loaded")

    def _failed(self, e: Entry, exc: BaseException) -> ApiError:
        e.state, e.task, e.served = UNLOADED, None, None
        e.error = str(exc) or type(exc).__name__
        log.error("model %s failed to load: %s", e.name, e.error)
        self.on_change(e, "failed")
        return ApiError(f"model `{e.name}` failed to load: {e.error}", status=500, type_="server_error",
                        code="model_load_failed")

    async def _make_room(self, want: Entry):
        """Unload least recently used idle models until `want` fits; 503 if it cannot."""
        while True:
            held = [e for e in self.entries if e is not want and e.state in (LOADED, LOADING, UNLOADING)]
            over_count = self.max_loaded and len(held) >= self.max_loaded
            base = self.baseline()
            over_memory = (self.memory_budget is not None and held
                           and sum(e.estimate(base) for e in held) + want.estimate(base) > self.memory_budget)
            if not over_count and not over_memory:
                return
            going = [e for e in held if e.state == UNLOADING]
            if going:  # an unload in progress frees room: wait for it rather than evict another
                await going[0].gone.wait()
                continue
            idle = [e for e in held if e.state == LOADED and not e.busy()]
            if not idle:
                why = (f"--max-loaded-models {self.max_loaded}" if over_count
                       else f"the models' memory budget ({self.memory_budget / 2**30:.1f} GiB)")
                raise ApiError(f"model `{want.name}` is not loaded and every loaded model is busy ({why}): "
                               "retry later", status=503, type_="server_overloaded", code="models_busy",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            victim = min(idle, key=lambda e: e.last_used)
            log.info("unloading model %s (least recently used) to load %s", victim.name, want.name)
            await self.unload(victim, "evicted")

    def baseline(self) -> int:
        """What an engine process holds besides its model's files: the least any measured one did."""
        seen = [e.rss - path_bytes(e.spec.source_path) for e in self.entries if e.rss]
        return max(0, min(seen)) if seen else 0

    # -- unloading -----------------------------------------------------------------------------------
    async def unload(self, e: Entry, reason: str, wait_s: float | None = None) -> bool:
        """Unload `e` once its requests finish (new ones wait for the unload, then load it again).
        With `wait_s`, give up after that long and keep it loaded: False."""
        if e.state == LOADING:
            with contextlib.suppress(ApiError):
                await asyncio.shield(e.task)
        if e.state == UNLOADING:
            await e.gone.wait()
            return True
        if e.state != LOADED:
            return True
        e.state, e.gone = UNLOADING, asyncio.Event()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while e.served is not None and e.served.llm.open_requests() > 0:
            if deadline is not None and time.monotonic() > deadline:
                e.state = LOADED
                e.gone.set()
                return False
            await asyncio.sleep(0.05)
        served, e.served = e.served, None
        try:
            await asyncio.to_thread(served.llm.shutdown)
            del served
            await asyncio.sleep(0)  # the client's sockets close on this loop (EngineCoreClient.shutdown)
            release_memory()
        finally:
            e.state = UNLOADED
            e.gone.set()
            log.info("model %s unloaded (%s)", e.name, reason)
            self.on_change(e, reason)
        return True

    def engine_failed(self, e: Entry, reason: str):
        """On the loop: a loaded model's engine died (its open requests already failed)."""
        if e.state == LOADED:
            log.error("model %s: engine failed (%s): unloaded; the next request loads it again", e.name, reason)
            asyncio.get_running_loop().create_task(self.unload(e, "failed"))

    # -- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) ------------
    async def load_adapter(self, name: str, path: str, base: str | None = None) -> dict:
        if not name or not path:
            raise ApiError("lora_name and lora_path are required", param="lora_name")
        if name in self.adapters or name in self.by_name:
            raise ApiError(f"the name {name!r} is taken (a model or a loaded LoRA adapter)", param="lora_name")
        e = self.find(base)
        async with self.use(e.name) as srv:
            try:
                got = await srv.llm.control("load_lora", name=name, path=path)
            except InferdError as err:
                raise ApiError(str(err), param="lora_path") from None
        cfg = e.spec.config
        cfg.lora_modules = [*(cfg.lora_modules or []), f"{name}={path}"]
        cfg.enable_lora = True
        self.adapters[name] = (e, path)
        return {"lora_name": name, "model": e.name, **(got or {})}

    async def unload_adapter(self, name: str) -> dict:
        if name not in self.adapters:
            raise ApiError(f"no LoRA adapter {name!r} is loaded", status=404, param="lora_name",
                           code="model_not_found", type_="not_found_error")
        e, _ = self.adapters[name]
        if e.state == LOADED:
            try:
                await e.served.llm.control("unload_lora", name=name)
            except Busy as err:
                raise ApiError(str(err), status=409, type_="conflict_error", code="adapter_busy") from None
            except InferdError as err:
                raise ApiError(str(err), param="lora_name") from None
        cfg = e.spec.config
        cfg.lora_modules = [m for m in cfg.lora_modules or [] if lora_module(m)[0] != name]
        del self.adapters[name]
        return {"lora_name": name, "model": e.name}

    # -- the idle watch ------------------------------------------------------------------------------
    def watch(self):
        """Start unloading models idle past their keep-alive (call on the running loop)."""
        if self._watch is None and any(e.spec.keep_alive is not None for e in self.entries):
            self._watch = asyncio.get_running_loop().create_task(self._idle_loop())

    async def _idle_loop(self):
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now = time.monotonic()
            for e in self.entries:
                if e.state != LOADED:
                    continue
                if e.busy():
                    e.last_used = now
                    continue
                e.rss = engine_rss(e.served.llm) or e.rss
                ka = e.spec.keep_alive
                if ka is not None and now - e.last_used >= ka:
                    await self.unload(e, "keep_alive")

    # -- what the API shows --------------------------------------------------------------------------
    def card(self, e: Entry) -> dict:
        st = {"value": e.state}
        if e.error and e.state == UNLOADED:
            st["failed"], st["error"] = True, e.error
        now = int(time.time())
        card = {"id": e.name, "object": "model", "created": now, "owned_by": "inferd", "status": st,
                # Anthropic's model fields beside OpenAI's: both clients read the same list
                "type": "model", "display_name": e.name, "created_at": rfc3339(now)}
        if e.served is not None:
            card["max_model_len"] = e.served.max_len
        if e.load_seconds is not None:
            card["load_seconds"] = round(e.load_seconds, 3)  # the last load's, start of the engine to ready
        if e.spec.aliases:
            card["aliases"] = sorted(e.spec.aliases)
        return card

    def set_keep_alive(self, e: Entry, seconds: float | None):
        """Ollama's per-request keep_alive: how long the model stays loaded once idle from now on
        (None: for ever; 0: unloaded as soon as its requests finish)."""
        e.spec.keep_alive = seconds
        e.last_used = time.monotonic()
        if seconds is not None:
            self.watch()

    def expires_at(self, e: Entry) -> float | None:
        """When an idle model will be unloaded (Unix time), or None if never."""
        ka = e.spec.keep_alive
        if ka is None:
            return None
        return time.time() + max(0.0, e.last_used + ka - time.monotonic())

    def adapter_cards(self) -> list[dict]:
        out = []
        for name, (e, path) in sorted(self.adapters.items()):
            out.append({"id": name, "object": "model", "created": int(time.time()), "owned_by": "inferd",
                        "parent": e.name, "root": path, "status": {"value": e.state}})
        return out

    @property
    def dead(self) -> str | None:
        """Why the server cannot serve: its only model's engine died (with several, a dead engine is
        unloaded and loaded again)."""
        if len(self.entries) == 1 and self.default.served is not None:
            return self.default.served.llm.dead
        return None

    async def state(self, steps: int) -> list[dict]:
        """The loaded models' engines' dashboard states; with several models each carries its model
        and a server-wide engine number."""
        loaded = self.loaded_served()
        parts = await asyncio.gather(*(s.llm.state(steps) for _, s in loaded))
        if len(self.entries) == 1:
            return [st for part in parts for st in part]
        out = []
        for (e, _), part in zip(loaded, parts):
            for st in part:
                out.append({**st, "model": e.name, "engine": len(out)})
        return out

    def open_requests(self) -> int:
        return sum(s.llm.open_requests() for _, s in self.loaded_served())

    def shutdown(self):
        if self._watch is not None:
            self._watch.cancel()
        for e in self.entries:
            if e.served is not None:
                e.served.llm.shutdown()
                e.served, e.state = None, UNLOADED


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def release_memory():
    """Give the unloaded model's share of this process back to the OS: its tokenizer and client
    are garbage now, but glibc keeps freed pages in its arenas unless asked (RSS would stay up by
    about a tokenizer per model ever loaded)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def engine_pids(client) -> list[int]:
    return [c.info.pid for c in getattr(client, "clients", [client]) if c is not None and c.info is not None]


def engine_rss(client) -> int | None:
    """Resident bytes of a client's engine processes (None if it runs in this process)."""
    pids = [p for p in engine_pids(client) if p != os.getpid()]
    if not pids:
        return None
    return sum(process_rss(p) for p in pids)


def process_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def path_bytes(path: str | None) -> int:
    if not path:
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total
