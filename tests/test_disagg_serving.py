"""Disaggregated prefill/decode as a user runs it: `inferd serve --role prefill`, `inferd serve
--role decode` (or the JSON --kv-transfer-config), `inferd router --prefill P --decode D`, and the
official openai client; real processes on 127.0.0.1, and across two network namespaces joined by
a veth pair (made here, as root).

The colocated answer every 1P1D answer is held to is the decode worker's own, asked directly
(no kv_transfer_params): the same engine, computing the whole prompt itself.
"""
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

from conftest import ServerProc, free_port
from helpers import TwoHosts, compare_by_gaps, netns_unavailable, top2_gap, wait_until

openai = pytest.importorskip("openai")

WORDS = ("river stone light garden window market paper engine quiet orange winter signal harbor "
         "letter forest silver number circle animal mountain yellow purple kitchen").split()


def prom(base: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include these."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total




def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(n=32, seed=0):
    """Short chats, long prompts (chunked on the producer), prompts sharing a prefix (hits in the
    producer's cache), chats sharing a system prompt; every other one streamed."""
    rng = random.Random(seed)
    shared, system = text(rng, 180), text(rng, 120)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            item = ("chat", [{"role": "user", "content": text(rng, rng.randint(3, 20))}])
        elif kind == 1:
            item = ("completion", text(rng, rng.randint(300, 500)))
        elif kind == 2:
            item = ("completion", shared + " " + text(rng, rng.randint(2, 30)))
        else:
            item = ("chat", [{"role": "system", "content": system},
                             {"role": "user", "content": text(rng, rng.randint(2, 15))}])
        out.append((*item, rng.randint(4, 12), i % 2 == 1))
    return out


async def ask(client, kind, prompt, max_tokens, stream):
    """(token strings, top-2 logprobs per token, usage) of one greedy request."""
    kw = dict(model="m", max_tokens=max_tokens, temperature=0)
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    toks, tops, usage = [], [], None
    if kind == "chat":
        r = await client.chat.completions.create(messages=prompt, logprobs=True, top_logprobs=2, **kw)
        chunks = [r] if not stream else [c async for c in r]
        for c in chunks:
            usage = c.usage or usage
            for ch in c.choices:
                for e in (ch.logprobs.content if ch.logprobs else None) or []:
                    toks.append(e.token)
                    tops.append(sorted((t.logprob for t in e.top_logprobs), reverse=True))
    else:
        r = await client.completions.create(prompt=prompt, logprobs=2, **kw)
        chunks = [r] if not stream else [c async for c in r]
        for c in chunks:
            usage = c.usage or usage
            for ch in c.choices:
                if ch.logprobs:
                    toks += ch.logprobs.tokens
                    tops += [sorted(d.values(), reverse=True) for d in ch.logprobs.top_logprobs]
    return toks, tops, usage


def run_all(base, items):
    async def go():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", timeout=300, max_retries=0) as c:
            return await asyncio.gather(*(ask(c, *it) for it in items))

    return asyncio.run(go())


def assert_same(got, want, *, max_ties: int) -> int:
    """Token equality up to the first position where the colocated run's top-2 are within the
    near-tie rule (helpers.compare_by_gaps, on the logprobs it kept)."""
    return compare_by_gaps([g for g, _, _ in got], [(w, [top2_gap(t) for t in tops]) for w, tops, _ in want],
                           max_ties=max_ties, what="disaggregated vs colocated")


def kv_cfg(role, conn="ZmqConnector", **extra):
    return json.dumps({"kv_connector": conn, "kv_role": role, "kv_connector_extra_config": extra})


def cluster(model_args, prefill_args=(), decode_args=(), conn="SharedMemoryConnector", env=None):
    p = ServerProc([*model_args, "--kv-transfer-config", kv_cfg("kv_producer", conn, lease_timeout_s=3),
                    *prefill_args], env=env)
    d = ServerProc([*model_args, "--kv-transfer-config", kv_cfg("kv_consumer", conn, transfer_timeout_s=3),
                    "--enable-prompt-tokens-details", *decode_args])
    r = ServerProc(["--prefill", p.base, "--decode", d.base, "--health-interval", "0.3"], command="router")
    for s in (p, d, r):
        s.wait_ready()
    # the router's own health checks must have seen both (before that it routes everything colocated)
    wait_until(lambda: prom(r.base, "inferd:router_backends_up") == 2, what="the router to see both workers up")
    return p, d, r


def stop(*procs):
    for s in procs:
        s.stop()


def pool_empty(base) -> bool:
    return (prom(base, "inferd:kv_cache_usage_perc") == 0 and prom(base, "inferd:kv_leased_blocks") == 0
            and prom(base, "inferd:num_requests_running") == 0 and prom(base, "inferd:num_requests_waiting") == 0)


# -- the real model: 1P1D equals colocated ----------------------------------------------------------

def test_1p1d_equals_colocated_on_the_default_model_through_router_and_openai(default_gguf_path):
    """32 concurrent mixed requests, fp32, the shared-memory connector; 0 recomputes, 1 prompt
    token computed per request on the decode worker, 46,080 B per pulled token, every lease
    confirmed and freed."""
    args = ["--model", default_gguf_path, "--quantization", "none", "--dtype", "float32", "--threads", "1", "--max-num-seqs", "32",
            "--num-kv-blocks", "640", "--served-model-name", "m"]
    p, d, r = cluster(args, ["--max-num-batched-tokens", "128"])
    try:
        items = workload(32)
        got = run_all(r.base, items)
        assert all(u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1 for _, _, u in got)
        n_prompt = sum(u.prompt_tokens for _, _, u in got)
        assert prom(d.base, "inferd:kv_transfer_recomputes_total") == 0
        assert prom(d.base, "inferd:kv_transfer_failures_total") == 0
        assert prom(d.base, "inferd:prompt_tokens_computed_total") == len(items)
        tokens = prom(d.base, "inferd:kv_transfer_tokens_total", connector="SharedMemoryConnector")
        hits = prom(d.base, "inferd:prefix_cache_hits_total")
        assert tokens == n_prompt - len(items) - hits
        assert prom(d.base, "inferd:kv_transfer_bytes_total", connector="SharedMemoryConnector") == 46_080 * tokens
        assert prom(p.base, "inferd:prefix_cache_hits_total") > 0  # the shared prefixes hit the producer's cache
        assert prom(r.base, "inferd:router_disagg_requests_total", path="disagg") == len(items)
        wait_until(lambda: prom(p.base, "inferd:kv_lease_confirmed_total") == len(items),
                   what="confirmations")
        assert prom(p.base, "inferd:kv_leases_total") == len(items) and prom(p.base, "inferd:kv_lease_expiries_total") == 0
        wait_until(lambda: pool_empty(p.base) and pool_empty(d.base), what="both pools empty")
        # each worker's dashboard state says what it is and what it did
        sp, sd = (httpx.get(s.base + "/v1/engine/state", timeout=10).json()["engines"][0] for s in (p, d))
        assert (sp["config"]["role"], sd["config"]["role"]) == ("prefill", "decode")
        assert sd["kv_transfer"]["tokens"] == tokens and sd["kv"]["used_blocks"] == sp["kv"]["used_blocks"] == 0
        decode_rows = [dict(zip(sd["finished"]["fields"], r)) for r in sd["finished"]["rows"]]
        assert len(decode_rows) == len(items)
        assert all(r["cached_tokens"] == r["prompt_tokens"] - 1 for r in decode_rows)
        # the router's dashboard state: both workers' engines, numbered across them, each with its backend
        both = httpx.get(r.base + "/v1/engine/state", timeout=10).json()["engines"]
        assert [(e["engine"], e["backend"], e["config"]["role"]) for e in both] == [(0, p.base, "prefill"),
                                                                                    (1, d.base, "decode")]
        assert both[1]["kv_transfer"]["tokens"] == tokens
        want = run_all(d.base, items)  # colocated: the decode worker computes the whole prompt
        assert_same(got, want, max_ties=2)
    finally:
        stop(r, p, d)


# -- tiny model: faults --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tiny_chat_gguf):
    return tiny_chat_gguf


def tiny_args(gguf):
    return ["--model", gguf, "--dtype", "float32", "--threads", "1", "--max-model-len", "2048", "--num-kv-blocks", "512",
            "--served-model-name", "m"]


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    """Two producers (one whose KV server drops every fetch: transfers that never arrive), two
    decode workers, all started at once; routers are cheap and made per test."""
    a = tiny_args(tiny_gguf)
    procs = {"p": ServerProc([*a, "--kv-transfer-config", kv_cfg("kv_producer", lease_timeout_s=2)]),
             "p_mute": ServerProc([*a, "--kv-transfer-config", kv_cfg("kv_producer", lease_timeout_s=2)],
                                  env={"INFERD_INJECT_FAULT": "kv_fetch@1+"}),
             "d": ServerProc([*a, "--kv-transfer-config", kv_cfg("kv_consumer", transfer_timeout_s=2),
                              "--enable-prompt-tokens-details"]),
             "d_spare": ServerProc([*a, "--role", "decode"])}
    try:
        for s in procs.values():
            s.wait_ready()
        yield procs
    finally:
        stop(*procs.values())


def router(prefill: str, decode: str) -> ServerProc:
    return ServerProc(["--prefill", prefill, "--decode", decode, "--health-interval", "0.3"], command="router")


def long_body(n_words=200, max_tokens=400):
    rng = random.Random(1)
    return {"prompt": text(rng, n_words), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_client_disconnects_in_either_phase_leave_both_pools_empty(tiny):
    p, d = tiny["p"], tiny["d"]
    r = router(p.base, d.base).wait_ready()
    try:
        # the client leaves during the decode phase (mid-stream) ...
        with httpx.stream("POST", r.base + "/v1/completions", json={**long_body(), "stream": True}, timeout=60) as s:
            for i, _ in enumerate(s.iter_lines()):
                if i > 6:
                    break
        # ... and during the prefill phase: the request is sent, the connection closed at once
        import socket

        body = json.dumps({**long_body(1500, 8), "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", r.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: prom(p.base, "inferd:kv_leases_total") == 2, what="both prompts prefilled")
        wait_until(lambda: pool_empty(p.base) and pool_empty(d.base), what="both pools empty after disconnects")
    finally:
        r.stop()


def test_a_decode_worker_killed_mid_decode_ends_the_stream_with_an_error(tiny):
    p, d = tiny["p"], tiny["d_spare"]
    r = router(p.base, d.base).wait_ready()
    try:
        events = []
        with httpx.stream("POST", r.base + "/v1/completions", json={**long_body(max_tokens=1500), "stream": True},
                          timeout=60) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:
                    d.proc.send_signal(signal.SIGKILL)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        wait_until(lambda: pool_empty(p.base), what="the producer's pool empty")  # its lease was confirmed
    finally:
        r.stop()


def test_a_producer_killed_mid_transfer_means_recompute_and_a_correct_200(tiny):
    """The producer's KV server drops fetches (the transfer never arrives), then the producer is
    killed while the decode worker waits: the decode worker recomputes and answers as colocated."""
    p, d = tiny["p_mute"], tiny["d"]
    body = {"prompt": text(random.Random(2), 120), "max_tokens": 12, "temperature": 0}
    pre = httpx.post(p.base + "/v1/completions", timeout=60,
                     json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    kvp = pre["kv_transfer_params"]
    assert kvp["remote_num_tokens"] == pre["usage"]["prompt_tokens"]
    before = prom(d.base, "inferd:kv_transfer_recomputes_total")

    def pulling() -> bool:  # the decode worker holds the request, its KV not there yet
        return httpx.get(d.base + "/v1/engine/state", params={"steps": 0}, timeout=10).json()["engines"][0][
            "num_waiting"] == 1

    async def decode_while_killing():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(d.base + "/v1/completions", json={**body, "kv_transfer_params": kvp}))
            # polled every 0.1 s against the 2 s the decode worker waits (transfer_timeout_s)
            await asyncio.to_thread(wait_until, pulling, 60, "the decode worker to wait for the prompt's KV")
            p.proc.send_signal(signal.SIGKILL)
            return await task

    got = asyncio.run(decode_while_killing())
    assert got.status_code == 200
    want = httpx.post(d.base + "/v1/completions", json=body, timeout=60).json()
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert prom(d.base, "inferd:kv_transfer_recomputes_total") == before + 1
    wait_until(lambda: pool_empty(d.base), what="the decode worker's pool empty")


def test_router_falls_back_when_no_prefill_worker_answers(tiny):
    d = tiny["d"]
    r = router(f"http://127.0.0.1:{free_port()}", d.base).wait_ready()
    try:
        body = {"prompt": "a b c d e f g", "max_tokens": 5, "temperature": 0}
        got = httpx.post(r.base + "/v1/completions", json=body, timeout=60)
        want = httpx.post(d.base + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200 and got.json()["choices"] == want.json()["choices"]
        assert prom(r.base, "inferd:router_disagg_requests_total", path="fallback") == 1
    finally:
        r.stop()


def test_a_malformed_transfer_config_is_one_line_at_start():
    for cfg, words in [("{oops", "not valid JSON"), ('{"kv_connector": "nixl"}', "unknown kv_connector")]:
        out = subprocess.run([sys.executable, "-m", "inferd", "serve", "--kv-transfer-config", cfg],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and words in out.stderr and out.stderr.count("\n") == 1, out.stderr
    out = subprocess.run([sys.executable, "-m", "inferd", "router", "--prefill", "http://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "go together" in out.stderr


# -- across hosts: two network namespaces, the network connector ----------------------------------

CLIENT = textwrap.dedent('''
    import json, sys, time, httpx
    sys.path.insert(0, sys.argv[1])
    from helpers import wait_up
    from test_disagg_serving import run_all, workload, prom
    router, decode, producer = sys.argv[2:5]
    for base in (producer, decode, router):
        wait_up(base)
    for _ in range(100):  # the router's own health checks must have seen both workers (else: colocated)
        if prom(router, "inferd:router_backends_up") == 2:
            break
        time.sleep(0.1)
    else:
        sys.exit("the router never saw both workers up")
    items = workload(12, seed=5)
    got = run_all(router, items)
    m = {k: prom(decode, "inferd:kv_transfer_bytes_total", connector=k) for k in ("ZmqConnector", "SharedMemoryConnector")}
    m["recomputes"] = prom(decode, "inferd:kv_transfer_recomputes_total")
    m["tokens"] = prom(decode, "inferd:kv_transfer_tokens_total")
    m["computed"] = prom(decode, "inferd:prompt_tokens_computed_total")
    for _ in range(100):  # an idle producer publishes its counters when it frees the confirmed leases
        m["sent"] = prom(producer, "inferd:kv_transfer_bytes_sent_total")
        if m["sent"] == m["ZmqConnector"] and prom(producer, "inferd:kv_leased_blocks") == 0:
            break
        time.sleep(0.1)
    want = run_all(decode, items)
    print(json.dumps({"got": [[g[0], g[1]] for g in got], "want": [[w[0], w[1]] for w in want],
                      "cached": [g[2].prompt_tokens_details.cached_tokens for g in got],
                      "prompt": [g[2].prompt_tokens for g in got], "metrics": m}))
''')


def test_1p1d_across_two_network_namespaces_over_the_network_connector(tiny_gguf, tmp_path):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    hosts = TwoHosts("d")
    na, nb, ip_a = hosts.a, hosts.b, hosts.ip_a
    logs = {k: open(tmp_path / f"{k}.log", "wb") for k in ("p", "d", "r")}
    try:
        hp, hd, hr = 8801, 8802, 8800  # each namespace has its own ports
        py = [sys.executable, "-m", "inferd"]
        hosts.run(na, [*py, "serve", *tiny_args(tiny_gguf), "--host", ip_a, "--port", str(hp), "--kv-transfer-config",
                       json.dumps({"kv_connector": "ZmqConnector", "kv_role": "kv_producer", "kv_ip": ip_a})], logs["p"])
        hosts.run(nb, [*py, "serve", *tiny_args(tiny_gguf), "--port", str(hd), "--role", "decode",
                       "--enable-prompt-tokens-details"], logs["d"])
        hosts.run(nb, [*py, "router", "--port", str(hr), "--prefill", f"http://{ip_a}:{hp}",
                       "--decode", f"http://127.0.0.1:{hd}", "--health-interval", "0.3"], logs["r"])
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["ip", "netns", "exec", nb, sys.executable, str(script), tests_dir,
                              f"http://127.0.0.1:{hr}", f"http://127.0.0.1:{hd}", f"http://{ip_a}:{hp}"],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            tails = {k: (tmp_path / f"{k}.log").read_text()[-2000:] for k in logs}
            pytest.fail(f"client failed: {out.stderr[-3000:]}\n{tails}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        m = res["metrics"]
        assert m["recomputes"] == 0 and m["SharedMemoryConnector"] == 0
        assert m["ZmqConnector"] == m["tokens"] * 512 == m["sent"] > 0  # 2 layers x 2 x 2 heads x 16 x 4 B
        assert m["computed"] == len(res["got"])
        assert all(c == p - 1 for c, p in zip(res["cached"], res["prompt"]))
        assert_same([(*g, None) for g in res["got"]], [(*w, None) for w in res["want"]], max_ties=1)
    finally:
        hosts.close()
        for f in logs.values():
            f.close()
