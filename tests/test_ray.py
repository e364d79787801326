"""inferd on Ray: which cluster the Ray executor joins (RAY_ADDRESS, the cluster `ray start` left
here, a local one in place of a stale file), tensor-parallel ranks placed by a placement group
across two nodes, and the Ray Serve application (replicas autoscaled, a replica killed,
disaggregated prefill/decode).

The two-node cluster is two network namespaces on this machine joined by a veth pair: the head in
one, a worker node in the other, one CPU each, so Ray's placement decides where each rank runs.

Every Ray process the module starts keeps its files in the module's own temporary directory
(RAY_TMPDIR, and `--temp-dir` for each `ray start`) and authenticates with a token of its own, so
nothing lands in Ray's usual /tmp/ray (the module checks) or ~/.ray, and no `ray_current_cluster`
file is left pointing at a cluster that is gone.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from helpers import TwoHosts, compare_texts, netns_unavailable, run_recording, wait_for_log, wait_until

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'inferd[ray]')")
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of Australia is", "def fibonacci(n):", "The three primary colours are",
           "Once upon a time, in a small village,"]
SMALL_KV = "64MiB"
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def ray_dir() -> str:
    """Ray's temp dir for the environment as it is now (where `ray start` writes ray_current_cluster)."""
    from inferd.distributed.ray_address import current_cluster_file

    return os.path.dirname(current_cluster_file())


def snapshot(d: str):
    """A folder's entries and its ray_current_cluster's text (None where absent)."""
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return None
    try:
        with open(os.path.join(d, "ray_current_cluster")) as f:
            return names, f.read()
    except OSError:
        return names, None


# How long a wait for replicas or a server to come up may take before the test fails (each wait ends
# as soon as its condition holds): 3 replicas loading torch and a model on one CPU each took over
# 3 minutes under make test-stress (2 busy processes beside 2 workers)
STARTUP = 600


@pytest.fixture(scope="module", autouse=True)
def ray_tmp():
    """The module's Ray temp dir: RAY_TMPDIR (short: Ray's unix sockets live under it), a token of the
    module's own, no inherited RAY_ADDRESS. Ray's usual dir is the same after the module as before:
    same entries (no new session_* folder, session_latest untouched) and the same cluster file."""
    real = ray_dir()
    before = snapshot(real)
    base = tempfile.mkdtemp(prefix="inferd-ray-")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_TMPDIR", base)
            mp.setenv("RAY_AUTH_MODE", "token")
            mp.setenv("RAY_AUTH_TOKEN", os.urandom(16).hex())
            mp.delenv("RAY_ADDRESS", raising=False)
            # Ray's memory monitor kills workers when the whole machine's memory is 95% used: on a
            # shared machine that is other people's memory, and a rank killed so fails these tests
            mp.setenv("RAY_memory_monitor_refresh_ms", "0")
            # Serve's controller kills an HTTP proxy that misses 3 readiness checks of 5 s (then health
            # checks of 10 s): under load (make test-stress: 2 busy processes beside 2 workers) a
            # proxy still starting missed them and `serve run` failed on a healthy cluster; a minute
            # a check on a test machine
            mp.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
            mp.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
            mp.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "20")
            yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert snapshot(real) == before, f"{real} changed under the Ray tests: {before} -> {snapshot(real)}"


def session_pids(leader: int) -> list[int]:
    """Processes of the session `leader` started (Ray's daemons and workers stay in it)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == leader:
                        pids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def kill_session(proc: subprocess.Popen, grace: float = 60):
    """SIGTERM the session leader `proc` (the server stops what it started) and wait up to `grace`
    seconds (0: no SIGTERM), then SIGKILL whatever of its session is left: only this test's
    processes, never every Ray process on the machine as `ray stop` would."""
    if grace and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    killed = set()
    for _ in range(3):  # again, for what a dying daemon started meanwhile
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
    if proc.poll() is None:
        proc.wait(10)
    sweep_after(killed)


def sweep_after(killed: set[int]):
    """Once the killed processes are gone, what their engine helpers left in the temporary directory
    removed, as the next inferd start on the machine would (inferd.distributed.tmpdirs.sweep): a
    killed replica cannot remove its own."""
    from inferd.distributed import tmpdirs

    deadline = time.monotonic() + 30
    while any(tmpdirs.owner_alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    tmpdirs.sweep()


def ray_node(hosts: TwoHosts, ns: str, ip: str, head: str | None, log, env, temp_dir: str):
    """`ray start` in namespace `ns` (blocking until the node is up): the head when `head` is None,
    else a worker joining it. One CPU each, a small object store, no dashboard, files in temp_dir."""
    argv = [RAY, "start", "--node-ip-address", ip, "--num-cpus", "1", "--object-store-memory", str(80 << 20),
            "--disable-usage-stats", "--temp-dir", temp_dir]
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
def two_nodes(tmp_path_factory, ray_tmp):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    hosts = TwoHosts("r")
    log = open(tmp_path_factory.mktemp("ray") / "ray-start.log", "w")
    # the cluster's own token (Ray's token authentication), whatever ~/.ray holds on this machine
    hosts.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex(),
                     RAY_ADDRESS=f"{hosts.ip_a}:6379")
    temp_dir = os.path.join(ray_tmp, "2n", "ray")
    try:
        ray_node(hosts, hosts.a, hosts.ip_a, None, log, hosts.env, temp_dir)
        ray_node(hosts, hosts.b, hosts.ip_b, hosts.env["RAY_ADDRESS"], log, hosts.env, temp_dir)
        hosts.address = hosts.env["RAY_ADDRESS"]
        hosts.cluster_file = os.path.join(temp_dir, "ray_current_cluster")
        yield hosts
    finally:  # every process of the cluster lives in one of the two namespaces: no `ray stop` (seconds) needed
        killed = set()
        for ns in (hosts.b, hosts.a):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
                    killed.add(int(pid))
        hosts.close()
        sweep_after(killed)


# -- which cluster the Ray executor joins ------------------------------------------------------------

JOIN = textwrap.dedent('''
    import logging, ray
    from inferd.distributed.ray_executor import join_cluster
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    join_cluster()
    print("GCS", ray.get_runtime_context().gcs_address, flush=True)
''')


def test_an_unreachable_ray_address_is_one_line_at_once(monkeypatch):
    """RAY_ADDRESS where nothing listens, or where something that is not a Ray GCS does (an HTTP
    server): an InferdError naming the address, before Ray is asked (whose client would retry for
    about two minutes); `inferd serve -tp 2 --distributed-executor-backend ray` exits 2 with that
    one line, before it starts an engine."""
    import http.server
    import threading

    from conftest import free_port
    from inferd.distributed.ray_executor import join_cluster
    from inferd.errors import InferdError

    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with pytest.raises(InferdError, match=f"cannot join the Ray cluster at RAY_ADDRESS={dead}: Connection refused"):
        join_cluster()
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{web.server_port}")
        with pytest.raises(InferdError, match="answered, but not as gRPC: not a Ray GCS port"):
            join_cluster()
    finally:
        web.shutdown()
        web.server_close()
    assert not ray.is_initialized()
    # the guard is Ray's retries (about 120 s); the 10 s bound is test_..._within_10_s (integration)
    out = subprocess.run([sys.executable, "-m", "inferd", "serve", "-tp", "2", "--distributed-executor-backend", "ray",
                          "--kv-cache-memory", SMALL_KV, "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, RAY_ADDRESS=dead))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"inferd: error: cannot join the Ray cluster at RAY_ADDRESS={dead}: Connection refused"], out.stderr


@pytest.mark.integration
def test_an_unreachable_ray_address_fails_within_10_s():
    from conftest import free_port

    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "inferd", "serve", "-tp", "2", "--distributed-executor-backend", "ray",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, RAY_ADDRESS=dead))
    assert out.returncode == 2 and time.monotonic() - t0 < 10, out.stderr


def test_a_stale_cluster_file_gets_one_line_and_a_local_cluster(ray_tmp, tmp_path):
    """ray_current_cluster names a loopback port where nothing listens (a cluster that is gone), no
    RAY_ADDRESS: `inferd serve -tp 2 --distributed-executor-backend ray` says in one line that the
    file is stale, starts a local cluster (its session under RAY_TMPDIR), places both ranks on it
    and answers; at SIGTERM the server takes its cluster down with it (no process of it left)."""
    import httpx

    from conftest import free_port, wait_healthy

    tmpdir = os.path.join(ray_tmp, "stale")
    file = os.path.join(tmpdir, "ray", "ray_current_cluster")
    os.makedirs(os.path.dirname(file))
    dead = f"127.0.0.1:{free_port()}"
    with open(file, "w") as f:
        f.write(dead)
    port, log = free_port(), tmp_path / "serve.log"
    srv = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "-tp", "2", "--distributed-executor-backend", "ray",
                            "--kv-cache-memory", SMALL_KV, "--port", str(port)],
                           stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, RAY_TMPDIR=tmpdir),
                           start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, srv, 300, "inferd serve on a local Ray cluster", lambda: log.read_text()[-3000:])
        r = httpx.post(base + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                       "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(60) == 0
        wait_until(lambda: not session_pids(srv.pid), 30, "the local cluster to go with the server")
    finally:
        kill_session(srv)
    said = [line.split(": ", 1)[1] for line in log.read_text().splitlines() if ": Ray: " in line]
    assert len(said) == 2, said
    assert said[0] == (f"Ray: {file} is stale: the cluster it names at {dead} does not answer (Connection refused); "
                       "starting a local cluster")
    assert said[1].startswith("Ray: started a local cluster (")
    assert "tensor parallel: 2 ranks over shm on 1 node(s), ray executor" in log.read_text()
    assert [n for n in os.listdir(os.path.dirname(file)) if n.startswith("session_2")]  # Ray kept its files here


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


DEPLOYMENTS = ("InferdEngine", "InferdPrefill", "InferdIngress")
# Serve's teardown, waited for: the application deleted (Serve's own call blocks until its
# deployments are gone), then Serve's actors. Not `serve shutdown --address`: it takes the dashboard's
# HTTP address, not the GCS's, and only sends the request (with the GCS address it just printed an
# error and exited 0, and the replicas lived on).
SHUTDOWN = textwrap.dedent('''
    import sys, ray
    from ray import serve
    from ray.serve.exceptions import RayServeException
    ray.init(address=sys.argv[1], logging_level="ERROR")
    try:
        serve.delete("inferd")
    except RayServeException:  # no Serve instance left: `serve run` shut it all down
        sys.exit(0)
    serve.shutdown()
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
        self.shutdown = [*ns, sys.executable, "-c", SHUTDOWN, address]
        self.env = env
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
        """Graceful: SHUTDOWN, Serve's own teardown, waited for; then `serve run` killed and the
        replicas' processes seen gone. (SIGINT to `serve run` does the same teardown, but under load
        it missed its 30 s and, killed, left the replicas holding both nodes' one CPU each: the next
        test's ranks could not be placed.) Else a kill, when the cluster goes next anyway."""
        if graceful:
            t0 = time.monotonic()
            out = subprocess.run(self.shutdown, env=self.env, capture_output=True, text=True, timeout=300)
            took = time.monotonic() - t0
        for p in (self.watch, self.proc):
            if p.poll() is None:
                p.kill()
            p.wait()
        if not graceful:
            return
        deadline = time.monotonic() + 120
        while left := {d: pids for d in DEPLOYMENTS if (pids := engine_replica_pids(d))}:
            assert time.monotonic() < deadline, (f"Serve replicas {left} outlived Serve's shutdown by 2 minutes "
                                                 f"(it took {took:.0f} s, exit {out.returncode}): "
                                                 f"{out.stdout[-1500:]}{out.stderr[-1500:]}\n"
                                                 f"serve run's log: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)


@pytest.fixture
def one_node(ray_tmp):
    """A one-node Ray cluster on loopback with two CPUs (room for two engine replicas), its files in
    a folder of RAY_TMPDIR; yields the environment that joins it (RAY_ADDRESS, its token)."""
    from conftest import free_port

    port = free_port()
    temp_dir = os.path.join(ray_tmp, f"1n{port}", "ray")  # short: Ray's unix sockets live under it
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex(), RAY_ADDRESS=f"127.0.0.1:{port}")
    os.makedirs(temp_dir)
    log = os.path.join(os.path.dirname(temp_dir), "start.log")
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--temp-dir", temp_dir, "--node-ip-address", "127.0.0.1",
                             "--port", str(port), "--num-cpus", "2", "--object-store-memory", str(80 << 20),
                             "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    file = os.path.join(temp_dir, "ray_current_cluster")
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(file):  # written once the node is up
            assert proc.poll() is None and time.monotonic() < deadline, open(log).read()[-2000:]
            time.sleep(0.2)
        yield env
    finally:
        # the whole cluster is this session: SIGKILL at once, as `ray stop --force` would (a
        # graceful stop under a Serve application takes half a minute)
        kill_session(proc, grace=0)


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
        app.wait(lambda: app.running() == 1 and app.running("InferdIngress") == 1, STARTUP, "the application")
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
        app.wait(lambda: app.running() == 2, STARTUP, "a second replica under load")
        first = engine_replica_pids()
        victim = min(first)
        os.kill(victim, 9)
        app.wait(lambda: len(engine_replica_pids() - first) >= 1 and app.running() == 2, STARTUP,
                 "a replica in place of the killed one")
        bench.wait(300)
        res = json.loads((tmp_path / "bench.json").read_text())
        failures = httpx.get(app.base + "/v1/ray/replica_failures", timeout=10).json()["failures"]
        print(f"Ray Serve: {res['completed']} of {n} requests answered, {res['failed']} failed with an error "
              f"(the ingress counted {failures}) after replica {victim} was killed")
        assert res["completed"] + res["failed"] == n and res["completed"] > 0
        assert res["failed"] == failures
        app.wait(lambda: app.running() == 1 and not app.statuses[-1]["InferdEngine"].get("STOPPING"), STARTUP,
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


def test_the_cluster_ray_start_left_here_is_joined_from_its_file(two_nodes):
    """On the head's host, no RAY_ADDRESS: the executor reads the ray_current_cluster `ray start`
    wrote in Ray's temp dir (RAY_TMPDIR here), finds its cluster answering, joins it, and says so
    in one line naming the file (the two-node cluster's head wrote it)."""
    hosts = two_nodes
    env = {k: v for k, v in hosts.env.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = os.path.dirname(os.path.dirname(hosts.cluster_file))
    out = subprocess.run(["ip", "netns", "exec", hosts.a, sys.executable, "-c", JOIN], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(hosts.cluster_file) as f:
        recorded = f.read().strip()
    assert recorded == hosts.address and f"GCS {recorded}" in out.stdout
    said = [line for line in out.stderr.splitlines() if line.startswith(("INFO Ray: ", "WARNING Ray: "))]
    assert said == [f"INFO Ray: joined the running cluster at {recorded} (from {hosts.cluster_file})"], out.stderr


def test_disaggregated_prefill_and_decode_deployments_on_two_nodes(two_nodes, default_gguf_path, tmp_path):
    """The application with a `prefill` deployment: its replica and the decode replica land on the
    two nodes (one CPU each), the greedy texts are a colocated engine's, every request took the
    disaggregated path, and the decode replica computed 1 prompt token of each (the rest came over
    the network connector: cached_tokens = prompt_tokens - 1)."""
    from inferd.engine.engine import LLMEngine

    hosts = two_nodes
    eng = LLMEngine(model=default_gguf_path, quantization="none", dtype="float32", kv_cache_memory=SMALL_KV, threads=1)
    tok = eng.tokenizer
    ref = run_recording(eng, [(tok.encode(p), 12) for p in PROMPTS])
    eng.close()
    app = ServeApp({"engine": {"kv_cache_memory": SMALL_KV, "quantization": "none", "dtype": "float32"}, "prefill": {},
                    "enable_prompt_tokens_details": True},
                   tmp_path, hosts.address, hosts.env, ns=["ip", "netns", "exec", hosts.a])
    try:
        app.wait(lambda: app.running() == 1 and app.running("InferdPrefill") == 1
                 and app.running("InferdIngress") == 1, STARTUP, "the prefill, decode and ingress deployments")
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
    import json, sys, httpx, openai
    base, address, prompts, dev = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, sys.argv[5])
    from helpers import wait_up
    wait_up(base, 600)  # the test's STARTUP

    def veth():  # bytes across this namespace's veth end, both ways
        import subprocess
        st = json.loads(subprocess.check_output(["ip", "-j", "-s", "link", "show", dev]))[0]["stats64"]
        return st["rx"]["bytes"] + st["tx"]["bytes"]

    # where the ranks run, as the engine records its executor's placement (not Ray's placement-group
    # table, which came back empty in some full-suite runs though the ranks ran on both nodes)
    tp = httpx.get(base + "/v1/engine/state", timeout=30).json()["engines"][0]["paths"]["tensor_parallel"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    before = veth()
    texts = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in prompts]
    moved = veth() - before
    print(json.dumps({"tp": tp, "texts": texts, "moved": moved}), flush=True)
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


def line_while_alive(client: subprocess.Popen, server: subprocess.Popen, timeout: float) -> bytes:
    """The client's next line, or b"" as soon as the server it talks to has exited (the client would
    wait out its own bound for a server that is gone) or `timeout` passes."""
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([client.stdout], [], [], 1.0)[0]:
            return client.stdout.readline()
        if server.poll() is not None:
            break
    client.kill()
    return b""


def test_tensor_parallel_ranks_on_two_ray_nodes(two_nodes, default_gguf_path, tmp_path):
    """`inferd serve -tp 2 --distributed-executor-backend ray` on a two-node cluster (one CPU each):
    1. the server joined RAY_ADDRESS (its one line says so), and the engine's record of the Ray placement
       (GET /v1/engine/state) has rank 0 on
       the head and rank 1 on the worker node;
    2. the greedy texts are TP=1's (near-tie rule), and the all-reduces crossed the veth (bytes
       counted on it, at least 61 all-reduces of one row a token);
    3. the worker node's raylet killed under a stream: the stream ends with an error event naming
       the rank, and the server exits 3 by itself, with no traceback."""
    from inferd.engine.engine import LLMEngine

    hosts = two_nodes
    eng = LLMEngine(model=default_gguf_path, quantization="none", dtype="float32", kv_cache_memory=SMALL_KV, threads=1)
    ref = [(ids[:16], logits[:16]) for ids, logits in run_recording(eng, [(eng.tokenizer.encode(p), 16) for p in PROMPTS])]
    tok = eng.tokenizer
    eng.close()
    log_path = tmp_path / "serve.log"
    env = hosts.env
    from conftest import free_port

    port = free_port()  # not Serve's 8000: a Serve test's proxy left behind by its failure takes that
    srv = hosts.run(hosts.a, [sys.executable, "-m", "inferd", "serve", "--model", default_gguf_path, "--quantization", "none", "--dtype", "float32",
                              "-tp", "2", "--distributed-executor-backend", "ray", "--kv-cache-memory", SMALL_KV,
                              "--port", str(port)], open(log_path, "wb"), env=env)
    client = hosts.run(hosts.a, [sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", hosts.address,
                                 json.dumps(PROMPTS), hosts.dev_a, os.path.dirname(os.path.abspath(__file__))],
                       subprocess.PIPE, env=env,
                       stderr=open(tmp_path / "client.log", "wb"))
    first = line_while_alive(client, srv, STARTUP)
    if not first:
        pytest.fail(f"client failed (server exit {srv.poll()}): {(tmp_path / 'client.log').read_text()[-2000:]}\n"
                    f"server log:\n{log_path.read_text()[-3000:]}")
    res = json.loads(first)
    assert res["tp"] == {"backend": "gloo", "executor": "ray", "nodes": 2,
                         "rank_ips": [hosts.ip_a, hosts.ip_b]}, res["tp"]
    log = wait_for_log(log_path.read_text, "tensor parallel: 2 ranks over gloo on 2 node(s), ray executor")
    assert f"Ray: joined RAY_ADDRESS={hosts.address}\n" in log
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
