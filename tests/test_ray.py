"""inferd on Ray: tensor-parallel ranks placed by a placement group across two nodes, and the Ray
Serve application (replicas autoscaled, a replica killed, disaggregated prefill/decode).

The two-node cluster is two network namespaces on this machine joined by a veth pair: the head in
one, a worker node in the other, one CPU each, so Ray's placement decides where each rank runs.
"""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import TwoHosts, compare_texts, netns_unavailable, run_recording

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'inferd[ray]')")
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of Australia is", "def fibonacci(n):", "The three primary colours are",
           "Once upon a time, in a small village,"]
SMALL_KV = "64MiB"
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def ray_node(hosts: TwoHosts, ns: str, ip: str, head: str | None, log, env):
    """`ray start` in namespace `ns` (blocking until the node is up): the head when `head` is None,
    else a worker joining it. One CPU each, a small object store, no dashboard."""
    argv = [RAY, "start", "--node-ip-address", ip, "--num-cpus", "1", "--object-store-memory", str(80 << 20),
            "--disable-usage-stats"]
    argv += ["--head", "--port", "6379", "--include-dashboard=false"] if head is None else ["--address", head]
    out = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=120, env=env)
    log.write(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-2000:]


def ray_pids(name: bytes, ns: str) -> list[int]:
    """Processes of namespace `ns` whose command line holds `name` (e.g. the worker node's raylet)."""
    inside = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    pids = []
    for p in inside:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if name in f.read():
                    pids.append(int(p))
        except OSError:
            pass
    return pids


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    hosts = TwoHosts("r")
    log = open(tmp_path_factory.mktemp("ray") / "ray-start.log", "w")
    # the cluster's own token (Ray's token authentication), whatever ~/.ray holds on this machine
    hosts.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex(),
                     RAY_ADDRESS=f"{hosts.ip_a}:6379")
    try:
        ray_node(hosts, hosts.a, hosts.ip_a, None, log, hosts.env)
        ray_node(hosts, hosts.b, hosts.ip_b, hosts.env["RAY_ADDRESS"], log, hosts.env)
        hosts.address = hosts.env["RAY_ADDRESS"]
        yield hosts
    finally:  # every process of the cluster lives in one of the two namespaces: no `ray stop` (seconds) needed
        for ns in (hosts.b, hosts.a):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
        hosts.close()


# -- the Ray Serve application ----------------------------------------------------------------------

def test_the_kuberay_manifest_builds_the_application():
    """deploy/kuberay/rayservice.yaml on paper: a RayService whose serveConfigV2 names the builder and
    args this module tests, which build (options checked, no model loaded); bad args are one line."""
    import yaml

    from inferd.errors import InferdError
    from inferd.ray.serve import build_app

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "deploy", "kuberay", "rayservice.yaml")) as f:
        svc = yaml.safe_load(f)
    assert svc["kind"] == "RayService" and svc["apiVersion"] == "ray.io/v1"
    apps = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    assert [a["import_path"] for a in apps] == ["inferd.ray.serve:build_app"]
    build_app(apps[0]["args"])
    for bad, words in (({"engine": {"kv_cache_memroy": "1GiB"}}, "unknown option 'kv_cache_memroy'"),
                       ({"routing": "random"}, "routing"), ({"replicas": 2}, "unknown option 'replicas'"),
                       ({"prefill": {"engine": {}, "nodes": 1}}, "prefill: unknown option 'nodes'")):
        with pytest.raises(InferdError, match=words):
            build_app(bad)


STATUS = textwrap.dedent('''
    import json, sys, time, ray
    from ray import serve
    ray.init(address=sys.argv[1], logging_level="ERROR")
    while True:
        app = serve.status().applications.get("inferd")
        deps = app.deployments if app else {}
        print(json.dumps({d: dict(s.replica_states) for d, s in deps.items()}), flush=True)
        time.sleep(0.3)
''')


def engine_replica_pids(deployment: str = "InferdEngine") -> set[int]:
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f"ServeReplica:inferd:{deployment}".encode() in f.read():
                        pids.add(int(d))
            except OSError:
                pass
    return pids


class ServeApp:
    """`serve run` of a config over a Ray cluster, the statuses Serve reports as they change, and
    the HTTP root of the application."""

    def __init__(self, args: dict, tmp_path, address: str, env: dict, ns: list[str] = (), port: int = 8000):
        import yaml

        cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
               "applications": [{"name": "inferd", "route_prefix": "/", "import_path": "inferd.ray.serve:build_app",
                                 "args": args}]}
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
        self.base, self.log = f"http://127.0.0.1:{port}", tmp_path / "serve-run.log"
        serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
        self.proc = subprocess.Popen([*ns, serve_cli, "run", "--address", address, str(tmp_path / "serve.yaml")],
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env)
        self.statuses: list[dict] = []
        self.watch = subprocess.Popen([*ns, sys.executable, "-c", STATUS, address], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, text=True)
        import threading

        def read():
            for line in self.watch.stdout:
                self.statuses.append(json.loads(line))
        threading.Thread(target=read, daemon=True).start()

    def running(self, deployment: str = "InferdEngine") -> int:
        return self.statuses[-1].get(deployment, {}).get("RUNNING", 0) if self.statuses else 0

    def wait(self, predicate, timeout: float, what: str):
        t0 = time.monotonic()
        while not predicate():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}; statuses {self.statuses[-3:]}; "
                                     f"log: {self.log.read_text()[-3000:]}")
            if self.proc.poll() is not None:
                raise AssertionError(f"serve run exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def close(self, graceful: bool = True):
        """SIGINT: `serve run` deletes the application (its replicas give their CPUs back); else a
        kill, when the cluster goes next anyway."""
        for p in (self.watch, self.proc):
            if p.poll() is None:
                p.send_signal(2 if graceful else 9)
        for p in (self.watch, self.proc):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def one_node(tmp_path):
    """A one-node Ray cluster on loopback with two CPUs (room for two engine replicas)."""
    from conftest import free_port

    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex(), RAY_ADDRESS=f"127.0.0.1:{port}")
    out = subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                          "--object-store-memory", str(80 << 20), "--include-dashboard=false", "--disable-usage-stats"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        yield env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=60, env=env)


def test_serve_app_autoscales_answers_the_openai_client_and_replaces_a_killed_replica(one_node, tmp_path):
    """The Ray Serve application, min 1 and max 2 engine replicas:
    1. the official openai client gets the same greedy text streamed and not;
    2. under a sustained `inferd bench` load Serve's status shows 2 replicas running;
    3. one replica SIGKILLed mid-load: a new replica process takes its place, every request of the
       load is answered or failed with a clear error (no hang), and the failures the bench counts are
       the ones the ingress counted;
    4. idle again, Serve's status goes back to 1 replica;
    5. a client that leaves a stream: its request is aborted in the replica (no request running, no
       KV block held) long before its 4000 tokens would end."""
    import httpx
    import openai

    from conftest import free_port

    port = free_port()
    # dense fp32 weights: a slower engine, so that a short load lasts past a scale-up and a replacement
    app = ServeApp({"engine": {"kv_cache_memory": SMALL_KV, "quantization": "none", "dtype": "float32"},
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                           "upscale_delay_s": 0.5, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
                                           "look_back_period_s": 1}},
                   tmp_path, one_node["RAY_ADDRESS"], one_node, port=port)
    try:
        app.wait(lambda: app.running() == 1 and app.running("InferdIngress") == 1, 120, "the application")
        client = openai.OpenAI(base_url=app.base + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                          temperature=0).choices[0].text
        parts = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                          temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in parts) == whole and whole
        n = 32
        bench = subprocess.Popen([sys.executable, "-m", "inferd", "bench", "--base-url", app.base, "--dataset", "random",
                                  "--input-len", "32", "--output-len", "48", "--num-prompts", str(n),
                                  "--max-concurrency", "8", "--timeout", "120", "--no-progress", "--no-server-metrics",
                                  "--result-json", str(tmp_path / "bench.json")],
                                 stdout=open(tmp_path / "bench.log", "wb"), stderr=subprocess.STDOUT)
        app.wait(lambda: app.running() == 2, 90, "a second replica under load")
        first = engine_replica_pids()
        victim = min(first)
        os.kill(victim, 9)
        app.wait(lambda: len(engine_replica_pids() - first) >= 1 and app.running() == 2, 90,
                 "a replica in place of the killed one")
        bench.wait(300)
        res = json.loads((tmp_path / "bench.json").read_text())
        failures = httpx.get(app.base + "/v1/ray/replica_failures", timeout=10).json()["failures"]
        print(f"Ray Serve: {res['completed']} of {n} requests answered, {res['failed']} failed with an error "
              f"(the ingress counted {failures}) after replica {victim} was killed")
        assert res["completed"] + res["failed"] == n and res["completed"] > 0
        assert res["failed"] == failures
        app.wait(lambda: app.running() == 1 and not app.statuses[-1]["InferdEngine"].get("STOPPING"), 90,
                 "scaling back to one replica when idle")
        assert any(s.get("InferdEngine", {}).get("RUNNING") == 2 for s in app.statuses)
        with httpx.stream("POST", app.base + "/v1/completions", timeout=60, json={  # a client that leaves
                "model": model, "prompt": "Count to a thousand:", "max_tokens": 4000, "ignore_eos": True,
                "temperature": 0, "stream": True}) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k == 6:
                    break

        def idle():
            e = httpx.get(app.base + "/v1/engine/state", params={"steps": 0}, timeout=10).json()["engines"][0]
            return e["num_running"] == 0 and e["kv"]["used_blocks"] == 0
        app.wait(idle, 20, "the abandoned stream's request to be aborted in its replica (4000 tokens otherwise)")
        assert all("engine replica failed: ActorDiedError" in e for e in res["errors"]), res["errors"]
    finally:
        app.close(graceful=False)


PD_CLIENT = textwrap.dedent('''
    import json, sys, httpx, openai
    base, prompts = sys.argv[1], json.loads(sys.argv[2])
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = []
    for p in prompts:
        r = client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
        out.append([r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens])
    print(json.dumps({"out": out, "ingress": httpx.get(base + "/v1/ray/replica_failures").json()}), flush=True)
''')


def test_disaggregated_prefill_and_decode_deployments_on_two_nodes(two_nodes, default_gguf_path, tmp_path):
    """The application with a `prefill` deployment: its replica and the decode replica land on the
    two nodes (one CPU each), the greedy texts are a colocated engine's, every request took the
    disaggregated path, and the decode replica computed 1 prompt token of each (the rest came over
    the network connector: cached_tokens = prompt_tokens - 1)."""
    from inferd.engine.engine import LLMEngine

    hosts = two_nodes
    eng = LLMEngine(model=default_gguf_path, dtype="float32", kv_cache_memory=SMALL_KV, threads=1)
    tok = eng.tokenizer
    ref = run_recording(eng, [(tok.encode(p), 12) for p in PROMPTS])
    eng.close()
    app = ServeApp({"engine": {"kv_cache_memory": SMALL_KV, "quantization": "none", "dtype": "float32"}, "prefill": {},
                    "enable_prompt_tokens_details": True},
                   tmp_path, hosts.address, hosts.env, ns=["ip", "netns", "exec", hosts.a])
    try:
        app.wait(lambda: app.running() == 1 and app.running("InferdPrefill") == 1
                 and app.running("InferdIngress") == 1, 180, "the prefill, decode and ingress deployments")
        nodes = {d: {subprocess.run(["ip", "netns", "identify", str(p)], capture_output=True, text=True).stdout.strip()
                     for p in engine_replica_pids(d)} for d in ("InferdPrefill", "InferdEngine")}
        assert nodes["InferdPrefill"] | nodes["InferdEngine"] == {hosts.a, hosts.b}, nodes
        out = subprocess.run(["ip", "netns", "exec", hosts.a, sys.executable, "-c", PD_CLIENT, app.base,
                              json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300, env=hosts.env)
        assert out.returncode == 0, out.stderr[-3000:] + app.log.read_text()[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        texts = {i: t for i, (t, _, _) in enumerate(res["out"])}
        compare_texts(texts, ref, tok, max_ties=1)
        assert all(cached == prompt - 1 for _, prompt, cached in res["out"]), res["out"]
        assert res["ingress"]["paths"] == {"disagg": len(PROMPTS), "fallback": 0, "ineligible": 0}
        print(f"disaggregated on Ray: prefill on {nodes['InferdPrefill']}, decode on {nodes['InferdEngine']}; "
              f"{sum(p for _, p, _ in res['out'])} prompt tokens, {len(PROMPTS)} computed by the decode replica")
    finally:
        app.close()


# -- tensor parallelism over two nodes (last: it kills the worker node) ------------------------------

CLIENT = textwrap.dedent('''
    import json, sys, httpx, openai, ray
    base, address, prompts, dev = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, sys.argv[5])
    from helpers import wait_up
    wait_up(base, 180)

    def veth():  # bytes across this namespace's veth end, both ways
        import subprocess
        st = json.loads(subprocess.check_output(["ip", "-j", "-s", "link", "show", dev]))[0]["stats64"]
        return st["rx"]["bytes"] + st["tx"]["bytes"]

    ray.init(address=address, logging_level="ERROR")  # Ray's own record of where each bundle went
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    placed = [[nodes[g["bundles_to_node_id"][i]] for i in sorted(g["bundles_to_node_id"])] for g in groups]
    ray.shutdown()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    before = veth()
    texts = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in prompts]
    moved = veth() - before
    print(json.dumps({"placed": placed, "texts": texts, "moved": moved}), flush=True)
    # then a stream the test breaks by killing the worker node's raylet
    events = []
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": "Count to a thousand:", "max_tokens": 2000,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    print("KILL", flush=True)
    print(json.dumps({"events": events[-3:], "n": len(events)}), flush=True)
''')


def test_tensor_parallel_ranks_on_two_ray_nodes(two_nodes, default_gguf_path, tmp_path):
    """`inferd serve -tp 2 --distributed-executor-backend ray` on a two-node cluster (one CPU each):
    1. Ray's placement group put rank 0 on the head and rank 1 on the worker node;
    2. the greedy texts are TP=1's (near-tie rule), and the all-reduces crossed the veth (bytes
       counted on it, at least 61 all-reduces of one row a token);
    3. the worker node's raylet killed under a stream: the stream ends with an error event naming
       the rank, and the server exits 3 by itself, with no traceback."""
    from inferd.engine.engine import LLMEngine

    hosts = two_nodes
    eng = LLMEngine(model=default_gguf_path, dtype="float32", kv_cache_memory=SMALL_KV, threads=1)
    ref = [(ids[:16], logits[:16]) for ids, logits in run_recording(eng, [(eng.tokenizer.encode(p), 16) for p in PROMPTS])]
    tok = eng.tokenizer
    eng.close()
    log_path = tmp_path / "serve.log"
    env = hosts.env
    srv = hosts.run(hosts.a, [sys.executable, "-m", "inferd", "serve", "--model", default_gguf_path, "--quantization", "none", "--dtype", "float32",
                              "-tp", "2", "--distributed-executor-backend", "ray", "--kv-cache-memory", SMALL_KV,
                              "--port", "8000"], open(log_path, "wb"), env=env)
    client = hosts.run(hosts.a, [sys.executable, "-c", CLIENT, "http://127.0.0.1:8000", hosts.address,
                                 json.dumps(PROMPTS), hosts.dev_a, os.path.dirname(os.path.abspath(__file__))],
                       subprocess.PIPE, env=env,
                       stderr=open(tmp_path / "client.log", "wb"))
    first = client.stdout.readline()
    if not first:
        pytest.fail(f"client failed: {(tmp_path / 'client.log').read_text()[-2000:]}\n"
                    f"server log:\n{log_path.read_text()[-3000:]}")
    res = json.loads(first)
    assert res["placed"] == [[hosts.ip_a, hosts.ip_b]], res["placed"]
    log = log_path.read_text()
    assert "tensor parallel: 2 ranks over gloo on 2 node(s), ray executor" in log
    compare_texts(dict(enumerate(res["texts"])), ref, tok, max_ties=1)
    tokens = 16 * len(PROMPTS)
    assert res["moved"] > tokens * 61 * 576 * 4, res["moved"]  # each decode token: >= 61 all-reduces of a row
    assert client.stdout.readline().strip() == b"KILL"
    raylets = ray_pids(b"raylet", hosts.b)
    assert raylets
    killed = time.monotonic()
    for p in raylets:
        os.kill(p, 9)
    out = json.loads(client.stdout.readline())
    client.wait(60)
    assert out["events"][-1] == "[DONE]"
    err = json.loads(out["events"][-2])["error"]["message"]
    assert "tensor-parallel" in err and ("rank 1" in err or f"[{hosts.ip_b}]" in err), err
    srv.wait(90)
    print(f"rank 1's node lost: the stream ended after {out['n']} events, the server exited "
          f"{time.monotonic() - killed:.1f} s after the kill; {res['moved'] / 1e6:.1f} MB crossed the veth "
          f"for {tokens} tokens")
    assert srv.returncode == 3
    assert "Traceback" not in log_path.read_text()


def test_the_prefix_router_keeps_a_prefix_on_its_replica_and_balances_the_rest():
    """PrefixRouter as Serve calls it (choose_replicas over the live replicas, then the routed and
    completed hooks): requests sharing a 64-token prefix go to one replica while loads allow; new
    prefixes go where the load is; a replica that comes up joins; a non-generate call goes to the
    least loaded."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve.request_router import PendingRequest

    from inferd.ray.router import PrefixRouter

    def replica(name):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))
    router = PrefixRouter.__new__(PrefixRouter)  # no Serve router around it: the policy alone
    router.initialize_state()
    a, b, c = replica("a"), replica("b"), replica("c")

    async def route(args, live):
        req = PendingRequest(args=[args], kwargs={}, metadata=None)
        first = (await router.choose_replicas(live, req))[0][0]
        router.on_request_routed(req, first.replica_id, None)
        return first.replica_id.unique_id

    async def run():
        shared = list(range(64))
        homes = [await route(shared + [1000 + i], [a, b]) for i in range(4)]  # 4 open requests of one family
        assert len(set(homes)) == 1
        other = ({"a", "b"} - set(homes)).pop()
        fresh = [await route([5000 + 100 * i + j for j in range(64)], [a, b]) for i in range(4)]
        assert fresh == [other] * 4  # new prefixes go where the load is
        for _ in range(8):  # the family's replica finishes its requests
            router.on_request_completed(replica(homes[0]).replica_id, "x")
        assert await route(shared + [2000], [a, b, c]) == homes[0]
        assert await route([9000 + j for j in range(64)], [a, b, c]) == "c"  # the replica that just came up
        assert await route(100, [a, b, c]) in {homes[0], "c"}  # not a generate call: the least loaded
    asyncio.run(run())
    assert router.picks == {"new": 6, "prefix": 4}
