"""`inferd router` (inferd.router): the shared policy as pure functions, then real processes on
127.0.0.1 -- mock servers for faults (killed and restarted backends, a stream cut mid-way, no
backend at all), tiny inferd servers for what prefix routing buys: the prefix-cache hit rate the
backends themselves count."""
import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ServerProc, free_port
from helpers import wait_until
from inferd.router.backends import parse_backends, parse_load
from inferd.distributed.policy import Balancer, PrefixIndex, chunk_hashes

# -- the policy ---------------------------------------------------------------------------------


def test_chunk_hashes_chain_over_the_prefix():
    a, b = chunk_hashes("x" * 64 + "y" * 64 + "z" * 10, 64), chunk_hashes("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and len(b) == 2  # whole chunks only
    assert a[0] == b[0] and a[1] != b[1]
    # a chunk's hash depends on everything before it, not on its own text alone
    assert chunk_hashes("q" * 64 + "y" * 64, 64)[1] != a[1]
    assert chunk_hashes([1, 2, 3, 4], 2) == chunk_hashes([1, 2, 3, 4, 5], 2)


def test_prefix_index_is_lru_bounded():
    idx = PrefixIndex(capacity=4)
    first, second = chunk_hashes("a" * 12, 4), chunk_hashes("b" * 12, 4)
    idx.insert(first)
    assert idx.match(first) == 3
    idx.insert(second)  # 6 chunks into 4: the oldest of the first go
    assert len(idx) == 4 and idx.match(second) == 3 and idx.match(first) == 0


def test_balancer_follows_prefixes_spreads_families_and_caps_load():
    bal = Balancer(["a", "b"], "prefix", chunk=8, cache_threshold=0.5, balance_abs=2, balance_rel=1.5)
    fams = [f"family {i}: ".ljust(64, chr(ord("A") + i)) for i in range(4)]
    homes = {f: bal.pick(f + "question 0", {"a": 0, "b": 0}).target for f in fams}
    assert sorted(homes.values()) == ["a", "a", "b", "b"], "new families alternate (smaller index wins ties)"
    assert {bal.pick("short", {"a": 0, "b": 0}).target for _ in range(4)} == {"a", "b"}  # no chunk: ties rotate
    for f in fams:  # the same family goes home while loads are even
        p = bal.pick(f + "question 1", {"a": 1, "b": 1})
        assert (p.target, p.reason) == (homes[f], "prefix") and p.matched >= 7
    busy = next(f for f in fams if homes[f] == "a")
    p = bal.pick(busy + "question 2", {"a": 9, "b": 1})  # uneven: the cap wins over the cache
    assert (p.target, p.reason) == ("b", "balance")
    with pytest.raises(LookupError):
        bal.pick("x", {}, live=[])


def test_round_robin_and_least_loaded_skip_dead_targets():
    rr = Balancer(["a", "b", "c"], "round_robin")
    assert [rr.pick("", {}, live=["a", "c"]).target for _ in range(4)] == ["a", "c", "a", "c"]
    ll = Balancer(["a", "b", "c"], "least_loaded")
    assert ll.pick("", {"a": 3, "b": 0, "c": 1}, live=["a", "c"]).target == "c"


def test_parse_load_reads_one_family_of_gauges():
    from inferd.server.metrics import Metrics
    from inferd.engine.engine import EngineSnapshot

    m = Metrics("tiny", engines=2)
    m.on_step(EngineSnapshot(running=3, waiting=2, kv_used=1, kv_total=4), 0)
    m.on_step(EngineSnapshot(running=1, waiting=0, kv_used=1, kv_total=4), 1)
    text = m.render().decode()
    assert "vllm:num_requests_running" in text  # both names present; counted once
    assert parse_load(text) == 6
    assert parse_load("llamacpp:requests_processing 2\nllamacpp:requests_deferred 5\n") == 7
    assert parse_load('sglang:num_running_reqs{x="1"} 1\nsglang:num_queue_reqs{x="1"} 1\n') == 2
    assert parse_load("# nothing here\nother_metric 3\n") is None


def test_parse_backends(tmp_path):
    assert parse_backends(["http://127.0.0.1:1/v1/", "http://127.0.0.1:2"], None) == [
        "http://127.0.0.1:1", "http://127.0.0.1:2"]
    f = tmp_path / "b.yaml"
    f.write_text("backends:\n  - url: http://127.0.0.1:3\n  - http://127.0.0.1:4\n")
    assert parse_backends(None, str(f)) == ["http://127.0.0.1:3", "http://127.0.0.1:4"]
    from inferd.errors import InferdError

    for bad in (["localhost:1"], ["http://127.0.0.1:1", "http://127.0.0.1:1"], []):
        with pytest.raises(InferdError):
            parse_backends(bad, None)


# -- processes: mock backends -------------------------------------------------------------------

def mock(port: int, tpot_ms: float = 2, output_len: int = 8) -> ServerProc:
    return ServerProc(["--ttft-ms", "5", "--tpot-ms", str(tpot_ms), "--output-len", str(output_len)],
                      command="mock-server", port=port)


def router(backends: list[str], *extra: str) -> ServerProc:
    args = [a for b in backends for a in ("--backend", b)]
    return ServerProc([*args, "--health-interval", "0.3", *extra], command="router")


def all_seen_up(rt: ServerProc, n: int):
    """Wait until the router's own health checks have seen n backends up (its /health is 200 at one)."""
    wait_until(lambda: prom(rt.base).get("inferd:router_backends_up") == n,
               what=f"the router to see {n} backends up")


def prom(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def stream_events(base: str, body: dict, timeout: float = 60) -> list:
    events = []
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events




@pytest.fixture()
def pair():
    """Two mock backends and a router over them plus one port nothing listens on."""
    ports = [free_port(), free_port()]
    mocks = [mock(p) for p in ports]
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [m.base for m in mocks]
    rt = router([*urls, dead])
    try:
        for m in mocks:
            m.wait_ready()
        rt.wait_ready()
        all_seen_up(rt, 2)
        yield rt, mocks, urls, dead
    finally:
        for p in (rt, *mocks):
            p.stop()


def test_router_passes_answers_through_and_survives_a_killed_backend(pair):
    rt, mocks, urls, dead = pair
    body = {"model": "mock", "prompt": "hello " * 40, "max_tokens": 6}
    direct = httpx.post(urls[0] + "/v1/completions", json=body, timeout=30).json()
    via = httpx.post(rt.base + "/v1/completions", json=body, timeout=30)
    assert via.status_code == 200 and via.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    ev = stream_events(rt.base, body)
    assert ev[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in ev[:-1] if e.get("choices")) == \
        direct["choices"][0]["text"]
    assert httpx.get(rt.base + "/v1/models", timeout=10).json()["data"][0]["id"] == "mock"
    log = rt.log_text()
    assert len(re.findall(rf"{re.escape(dead)} is unreachable", log)) == 1, log  # one line, not one per check
    assert prom(rt.base)[f'inferd:router_backend_up{{backend="{dead}"}}'] == 0

    # kill one backend under load: every request ends in 200 or a clear error, none hangs
    async def load(n: int) -> list:
        async with httpx.AsyncClient(base_url=rt.base, timeout=30) as c:
            async def one(i):
                try:
                    r = await c.post("/v1/completions", json={**body, "prompt": f"req {i} " * 20})
                    return r.status_code
                except httpx.HTTPError as e:
                    return repr(e)
            sem = asyncio.Semaphore(4)

            async def gated(i):
                async with sem:
                    return await one(i)
            return await asyncio.gather(*(gated(i) for i in range(n)))

    before = prom(rt.base)
    killer = mocks[0]
    task_codes: list = []
    sent0 = f'inferd:router_requests_total{{backend="{urls[0]}"}}'

    async def run():
        t = asyncio.create_task(load(60))
        # under load means once the load has reached it, however slowly the machine runs
        await asyncio.to_thread(wait_until, lambda: prom(rt.base).get(sent0, 0) >= before.get(sent0, 0) + 2, 60,
                                "the load to reach the backend about to be killed")
        killer.proc.kill()
        task_codes.extend(await t)
    asyncio.run(run())
    assert all(c in (200, 502, 503) for c in task_codes), task_codes
    assert task_codes.count(200) >= 55, task_codes  # a request in flight at the kill may fail; later ones not
    wait_until(lambda: prom(rt.base)[f'inferd:router_backend_up{{backend="{urls[0]}"}}'] == 0,
               what="the kill to show")
    mid = prom(rt.base)
    for i in range(6):  # nothing new goes to the dead one
        assert httpx.post(rt.base + "/v1/completions", json={**body, "prompt": f"after {i} " * 20},
                          timeout=30).status_code == 200
    after = prom(rt.base)
    key0, key1 = (f'inferd:router_requests_total{{backend="{u}"}}' for u in urls)
    assert after[key0] == mid[key0] and after[key1] == mid[key1] + 6
    assert after[key1] > before[key1]

    # restarted on the same port: up again, and used again (the killed one's log removed first)
    killer.stop()
    mocks[0] = mock(int(urls[0].rsplit(":", 1)[1])).wait_ready()
    wait_until(lambda: prom(rt.base)[f'inferd:router_backend_up{{backend="{urls[0]}"}}'] == 1, what="the restart")
    for i in range(8):
        httpx.post(rt.base + "/v1/completions", json={**body, "prompt": f"back {i} " * 20}, timeout=30)
    assert prom(rt.base)[key0] > after[key0]
    assert re.search(rf"{re.escape(urls[0])} is up again", rt.log_text())


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    slow = mock(free_port(), tpot_ms=50, output_len=400)
    rt = router([slow.base])
    try:
        slow.wait_ready()
        rt.wait_ready()
        events = []
        with httpx.stream("POST", rt.base + "/v1/completions", timeout=30,
                          json={"model": "mock", "prompt": "x", "max_tokens": 400, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    slow.proc.kill()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert "error" in err and "broke off the stream" in err["error"]["message"]
        assert len(events) < 100  # cut, not finished
    finally:
        rt.stop()
        slow.stop()


def test_no_healthy_backend_is_a_503_with_retry_after():
    nobody = f"http://127.0.0.1:{free_port()}"
    rt = router([nobody])
    try:
        deadline = time.monotonic() + 60
        while True:  # up once it answers at all (its /health is 503 by design)
            try:
                h = httpx.get(rt.base + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and rt.alive(), rt.log_text()
                time.sleep(0.2)
        assert h.status_code == 503 and h.json()["backends_up"] == 0
        r = httpx.post(rt.base + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "service_unavailable"
        r = httpx.post(rt.base + "/v1/chat/completions", content=b"{not json", timeout=10)
        assert r.status_code == 400 and "error" in r.json()
        assert rt.alive()  # an unreachable backend is not fatal: it keeps checking
    finally:
        rt.stop()
    r = subprocess.run([sys.executable, "-m", "inferd", "router", "--backend", nobody, "--require-all-backends",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unreachable" in r.stderr, r.stderr


# -- processes: inferd backends, what prefix routing buys -----------------------------------------

FAMILIES, SYSTEM_TOKENS, REQUESTS = 8, 256, 160


def hit_rate(backends: list[ServerProc]) -> float:
    hits = queries = 0.0
    for b in backends:
        m = prom(b.base)
        hits += sum(v for k, v in m.items() if k.startswith("inferd:prefix_cache_hits_total"))
        queries += sum(v for k, v in m.items() if k.startswith("inferd:prefix_cache_queries_total"))
    return hits / queries


@pytest.mark.slow
def test_prefix_routing_finds_what_round_robin_evicts(tiny_chat_gguf):
    from inferd.bench.datasets import build_prompts
    from inferd.tokenizer import Tokenizer

    # each family's system prompt is 16 blocks: 8 families need 128; each pool holds 72 (56 %)
    common = ["--model", tiny_chat_gguf, "--threads", "1", "--num-kv-blocks", "72", "--max-num-seqs", "4",
              "--max-model-len", "2048"]
    backends = {p: [ServerProc(common), ServerProc(common)] for p in ("round_robin", "prefix")}
    routers = {p: router([b.base for b in bs], "--policy", p) for p, bs in backends.items()}
    try:
        tok = Tokenizer.load(tiny_chat_gguf)
        prompts, _ = build_prompts("prefix-families", REQUESTS, tok, str(SYSTEM_TOKENS), "2", seed=0,
                                   families=FAMILIES, question_len="24")
        for bs in backends.values():
            for b in bs:
                b.wait_ready()
        rates, shares = {}, {}
        for policy, rt in routers.items():
            rt.wait_ready()
            all_seen_up(rt, 2)  # else the first requests all go to the one backend seen so far

            async def drive(base=rt.base):
                async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                    sem = asyncio.Semaphore(4)

                    async def one(p):
                        async with sem:
                            r = await c.post("/v1/completions", json={"prompt": p.prompt, "max_tokens": 2,
                                                                      "temperature": 0})
                            assert r.status_code == 200, r.text
                    await asyncio.gather(*(one(p) for p in prompts))
            asyncio.run(drive())
            rates[policy] = hit_rate(backends[policy])
            sent = [v for k, v in prom(rt.base).items() if k.startswith("inferd:router_requests_total")]
            shares[policy] = max(sent) / sum(sent)
        print(f"prefix-cache hit rate: prefix {rates['prefix']:.3f}, round_robin {rates['round_robin']:.3f} "
              f"({rates['prefix'] / rates['round_robin']:.2f}x); largest backend share {shares}")
        # a 4-4 split of the families fits each pool (about 1.8x); a 5-3 split leaves the five-family
        # backend thrashing a little (0.73 vs 0.42 = 1.76x in one CI run): both are far from round robin
        assert rates["prefix"] >= 1.5 * rates["round_robin"]
        # 8 families on 2 backends: a 5-3 split of the families (0.625) is placement, not piling up
        assert shares["prefix"] <= 0.68

        # a client leaving a routed stream aborts it at the backend: its KV blocks come back, and
        # the backend generated far fewer than the 700 tokens asked for
        rt = routers["prefix"]

        def generated():
            return sum(v for b in backends["prefix"] for k, v in prom(b.base).items()
                       if k.startswith("inferd:generation_tokens_total"))

        def finished(aborted=False):
            return sum(v for b in backends["prefix"] for k, v in prom(b.base).items()
                       if k.startswith("inferd:request_success_total")
                       and ('finished_reason="abort"' in k) == aborted)
        gen0, fin0, ab0 = generated(), finished(), finished(aborted=True)
        with httpx.stream("POST", rt.base + "/v1/completions", timeout=60,
                          json={"prompt": prompts[0].prompt, "max_tokens": 700, "ignore_eos": True,
                                "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break

        def idle():
            ms = [prom(b.base) for b in backends["prefix"]]
            return all(v == 0 for m in ms for k, v in m.items()
                       if k.startswith(("inferd:num_requests_running", "inferd:kv_cache_usage_perc")))
        wait_until(idle, what="the backend to abort the abandoned stream")
        assert generated() - gen0 < 700 and finished() == fin0  # cut short, never finished
        assert finished(aborted=True) == ab0 + 1  # counted as vLLM counts it: finished_reason="abort"
        assert prom(rt.base)[f'inferd:router_requests_in_flight{{backend="{backends["prefix"][0].base}"}}'] == 0
    finally:
        for p in [*routers.values(), *(b for bs in backends.values() for b in bs)]:
            p.stop()


def test_prefix_workloads_share_what_they_say():
    from inferd.bench.datasets import build_prompts
    from inferd.gguf_file import default_model_path
    from inferd.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    fam, _ = build_prompts("prefix-families", 24, tok, "64", "4", seed=1, families=3, question_len="8")
    systems = {p.prompt.split("\n", 1)[0] for p in fam}
    assert len(systems) == 3 and all(p.output_len == 4 for p in fam)
    assert all(abs(p.prompt_len - (64 + 1 + 8)) <= 3 for p in fam)  # system + newline + question
    conv, _ = build_prompts("multi-turn", 12, tok, "32", "6", seed=1, families=3, question_len="8")
    for c in range(3):  # turn t+1 of a conversation extends turn t's prompt (and its answer)
        turns = [p.prompt for p in conv[c::3]]
        assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(turns, turns[1:]))
    assert conv[0].prompt_len < conv[9].prompt_len
