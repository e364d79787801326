"""inferd on Ray: tensor-parallel ranks placed by a placement group across two nodes, and the Ray
Serve application (replicas autoscaled, a replica killed, disaggregated prefill/decode).

The two-node cluster is two network namespaces on this machine joined by a veth pair: the head in
one, a worker node in the other, one CPU each, so Ray's placement decides where each rank runs.
"""
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
    finally:
        for ns in (hosts.b, hosts.a):
            subprocess.run(["ip", "netns", "exec", ns, RAY, "stop", "--force"], capture_output=True, timeout=60,
                           env=hosts.env)
        hosts.close()


CLIENT = textwrap.dedent('''
    import json, sys, time, httpx, openai, ray
    base, address, prompts, dev = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    for _ in range(900):
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        sys.exit("the server never came up")

    def veth():
        return sum(int(open(f"/sys/class/net/{dev}/statistics/{k}_bytes").read()) for k in ("rx", "tx"))

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
    srv = hosts.run(hosts.a, [sys.executable, "-m", "inferd", "serve", "--model", default_gguf_path, "--dtype", "float32",
                              "-tp", "2", "--distributed-executor-backend", "ray", "--kv-cache-memory", SMALL_KV,
                              "--port", "8000"], open(log_path, "wb"), env=env)
    client = hosts.run(hosts.a, [sys.executable, "-c", CLIENT, "http://127.0.0.1:8000", hosts.address,
                                 json.dumps(PROMPTS), hosts.dev_a], subprocess.PIPE, env=env,
                       stderr=open(tmp_path / "client.log", "wb"))
    first = client.stdout.readline()
    if not first:
        pytest.fail(f"client failed: {(tmp_path / 'client.log').read_text()[-2000:]}\n"
                    f"server log:\n{log_path.read_text()[-3000:]}")
    res = json.loads(first)
    assert res["placed"] == [[hosts.ip_a, hosts.ip_b]], res["placed"]
    log = log_path.read_text()
    assert "tensor parallel: 2 ranks over gloo on 2 node(s), ray executor" in log
    assert compare_texts(dict(enumerate(res["texts"])), ref, tok) <= 1
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
