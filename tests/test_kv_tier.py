"""KV beyond one pool: the second KV tier (inferd.engine.kv_tier over inferd.worker.kv_store) and the
KV events in vLLM's format (inferd.distributed.kv_events), on the tiny model in process, then
through real servers (data-parallel replicas sharing a tier, a restart, the router's kv_events
policy)."""
import os
import random
import shutil
import subprocess
import sys

import httpx
import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from conftest import free_port, make_tiny_model, running_server
from helpers import compare, reference_outputs, wait_until
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams

BS = 16


def families(seed=0, n_fam=5, n=20, prefix_blocks=6, vocab=512):
    """n requests over n_fam shared prefixes of prefix_blocks full blocks, each with its own tail."""
    rng = random.Random(seed)
    pres = [[rng.randrange(1, vocab) for _ in range(prefix_blocks * BS)] for _ in range(n_fam)]
    order = [i % n_fam for i in range(n)]
    rng.shuffle(order)
    return [(pres[f] + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 20))], 6) for f in order]


def one_by_one(eng, reqs):
    """Each request alone, in order: every later request of a family finds what the earlier ones left."""
    outs = []
    for prompt, n in reqs:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0))
        got = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id == rid:
                    got.extend(o.new_token_ids)
        outs.append(got)
    return outs


def engine(loaded, tier=None, blocks=16, **kw):
    return LLMEngine(loaded=loaded, dtype="float32", num_kv_blocks=blocks, block_size=BS, kv_tier=tier, **kw)


def assert_drained(eng):
    bm = eng.block_manager
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks and not eng.requests and not eng.tier.loading


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


@pytest.fixture(scope="module")
def work(tiny):
    reqs = families()
    return reqs, reference_outputs(tiny.model, reqs)


def test_tier_loads_overflowed_prefixes_instead_of_recomputing(tiny, work, tmp_path):
    """A pool of 16 blocks holds two of five 6-block prefixes: without the tier most repeats are
    recomputed; with it they load, and every prompt token is either computed, found in the pool or
    loaded from the tier, counted exactly."""
    reqs, ref = work
    base = engine(tiny, None)
    compare(one_by_one(base, reqs), ref, max_ties=1)
    eng = engine(tiny, str(tmp_path / "tier"))
    compare(one_by_one(eng, reqs), ref, max_ties=1)
    t = eng.tier.view()
    prompt = sum(len(p) for p, _ in reqs)
    bm = eng.block_manager
    assert t["hit_tokens"] > 0 and t["loaded_blocks"] * BS == t["hit_tokens"]
    assert eng.stats.prefill_tokens + bm.hits + t["hit_tokens"] == prompt
    assert eng.stats.prefill_tokens < base.stats.prefill_tokens - t["hit_tokens"] // 2
    assert t["stored_blocks"] > 0
    assert t["truncated"] == t["corrupt"] == t["mismatch"] == 0
    assert_drained(eng)
    eng.close()
    base.close()


def test_tier_survives_restart_and_is_shared(tiny, work, tmp_path):
    """A new engine on the same directory (a restart) computes only each prompt's uncached tail; two
    engines open on one directory at once load each other's blocks."""
    reqs, ref = work
    d = str(tmp_path / "tier")
    a = engine(tiny, d, blocks=64)
    one_by_one(a, reqs[:3])
    a.close()  # waits for its writes: what a graceful restart leaves
    b = engine(tiny, d, blocks=64)
    c = engine(tiny, d, blocks=64)
    prompt, n = reqs[0]
    compare(one_by_one(b, [(prompt, n)]), [ref[0]], max_ties=1)
    loaded = b.tier.view()["hit_tokens"]
    assert loaded == (len(prompt) - 1) // BS * BS
    assert b.stats.prefill_tokens == len(prompt) - loaded
    # b writes a prefix c never saw; c loads it
    new = [(reqs[5][0][:BS * 6] + [7, 8, 9], 4)]
    one_by_one(b, new)
    b.close()  # its writes are on disk
    one_by_one(c, new)
    assert c.tier.view()["hit_tokens"] == BS * 6
    assert_drained(c)
    c.close()


def test_an_int8_cache_goes_through_the_tier_as_it_is(tiny, work, tmp_path):
    """An int8 pool's blocks (codes and their scales) are written to the tier and loaded back as they
    are: a restarted int8 engine loads the prefix and gives the tokens the first one gave, with no
    tokens recomputed but the tail; a bf16 engine on the same directory sees none of them."""
    reqs, ref = work
    d = str(tmp_path / "tier")
    a = engine(tiny, d, blocks=64, kv_cache_dtype="int8")
    first = one_by_one(a, reqs[:2])
    compare(first, ref[:2], max_ties=1)
    a.close()
    b = engine(tiny, d, blocks=64, kv_cache_dtype="int8")
    prompt, n = reqs[0]
    assert one_by_one(b, [(prompt, n)]) == first[:1]
    loaded = b.tier.view()["hit_tokens"]
    assert b.cache_info()["dtype"] == "int8" and loaded == (len(prompt) - 1) // BS * BS
    assert b.stats.prefill_tokens == len(prompt) - loaded
    assert_drained(b)
    b.close()
    bf = engine(tiny, d, blocks=16, kv_cache_dtype="bfloat16")
    one_by_one(bf, reqs[:1])
    assert bf.tier.view()["hit_tokens"] == 0
    bf.close()


def test_tier_faults_are_misses(tiny, work, tmp_path):
    """A truncated block, a flipped byte, a block of another model under this model's name, a tier
    of another KV dtype: each a miss (counted, the file deleted), the outputs still the reference's."""
    reqs, ref = work
    d = str(tmp_path / "tier")
    a = engine(tiny, d, blocks=64)
    one_by_one(a, reqs)
    a.close()
    ns = a.tier.store
    fams = []
    for p, _ in reqs:
        if p[:BS * 6] not in [f[:BS * 6] for f in fams]:
            fams.append(p)
    h = [a.block_manager.extend_hashes(r, 1)[0] for r in (_req(a, f) for f in fams[:3])]
    path = [ns.path(x) for x in h]
    with open(path[0], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(path[0]) // 2)
    with open(path[1], "r+b") as f:  # one flipped byte in the payload
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 1]))
    other = engine(make_tiny_model(seed=1), str(tmp_path / "other"), blocks=64)  # another model's block ...
    one_by_one(other, [(fams[2], 1)])
    other.close()
    shutil.copy(other.tier.store.path(other.block_manager.extend_hashes(_req(other, fams[2]), 1)[0]), path[2])
    b2 = engine(tiny, d, blocks=16)
    compare(one_by_one(b2, reqs), ref, max_ties=1)
    t = b2.tier.view()
    assert (t["truncated"], t["corrupt"], t["mismatch"]) == (1, 1, 1), t
    assert t["hit_tokens"] > 0
    assert_drained(b2)
    b2.close()
    bf = engine(tiny, d, blocks=16, kv_cache_dtype="bfloat16")  # another KV dtype: another namespace
    one_by_one(bf, reqs[:2])
    assert bf.tier.view()["hit_tokens"] == 0 and bf.tier.store.dir != ns.dir
    bf.close()


def _req(eng, prompt):
    from inferd.engine.request import Request

    return Request("x", prompt, SamplingParams(max_tokens=1))


def test_full_disk_and_size_limit(tiny, work, tmp_path, caplog):
    """A tier on a 64 KiB tmpfs fills up: writes fail with one log line, requests are still answered
    right. A --kv-tier-size below the data keeps the directory under it, least recently used out."""
    reqs, ref = work
    small = engine(tiny, str(tmp_path / "lru"), blocks=16, kv_tier_size=20 * 8300)
    compare(one_by_one(small, reqs), ref, max_ties=1)
    small.close()
    t = small.tier.view()
    assert t["evicted_blocks"] > 0 and small.tier.store.size()[1] <= 20 * 8300
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        with caplog.at_level("WARNING", logger="inferd"):
            full = engine(tiny, str(mnt), blocks=16)
            compare(one_by_one(full, reqs), ref, max_ties=1)
            full.close()
        assert full.tier.view()["store_errors"] > 0
        lines = [r.getMessage() for r in caplog.records if "disk is full" in r.getMessage()]
        assert len(lines) == 1, lines
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- KV events -----------------------------------------------------------------------------------
# The subscriber's types, written from vLLM's documented schema (examples/online_serving/kv_events_subscriber.py)

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """vLLM's subscriber loop: SUB for live batches; a gap (the first batches a late joiner missed)
    is filled from the replay endpoint."""

    def __init__(self, pub: str, replay: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.replay_ep = replay
        self.dec = Decoder(type=KVEventBatch)
        self.last = -1
        self.batches: list[KVEventBatch] = []
        self.raw: list[bytes] = []
        self.replayed = 0

    def poll(self, timeout=0):
        while self.sub.poll(timeout):
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.last + 1 and self.replay_ep:
                self.replay(self.last + 1, seq)
            self.batches.append(self.dec.decode(payload))
            self.raw.append(payload)
            self.last = seq

    def replay(self, first, upto):
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay_ep)
        d.send_multipart((b"", first.to_bytes(8, "big")))
        while d.poll(5000):
            _, seq_b, payload = d.recv_multipart()
            if not payload:
                break
            seq = int.from_bytes(seq_b, "big")
            if self.last < seq < upto:
                self.batches.append(self.dec.decode(payload))
                self.last = seq
                self.replayed += 1
        d.close(linger=0)

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


def test_kv_events_match_the_block_counters(tiny, request):
    """200 requests through a pool too small for them (evictions and preemptions): every batch
    decodes with vLLM's schema, the stored and removed hashes equal the engine's counters, and
    replaying the events gives exactly the blocks the prefix cache holds at the end."""
    p1, p2 = free_port(), free_port()
    cfg = {"endpoint": f"tcp://127.0.0.1:{p1}", "replay_endpoint": f"tcp://127.0.0.1:{p2}", "topic": "kv-events"}
    eng = engine(tiny, None, blocks=24, kv_events_config=cfg, max_num_seqs=16)
    sub = Subscriber(cfg["endpoint"], cfg["replay_endpoint"])
    request.addfinalizer(sub.close)  # and the engine's publisher: never a zmq context left to the GC
    request.addfinalizer(eng.close)
    reqs = families(seed=3, n_fam=12, n=200, prefix_blocks=3)
    for p, n in reqs:
        eng.add_request(p, SamplingParams(max_tokens=n + 10, temperature=0))
    while eng.has_unfinished():
        eng.step()
        sub.poll()
    bm = eng.block_manager
    assert eng.stats.preemptions > 0 and bm.removed > 0
    published = eng.publisher
    wait_until(lambda: published.queue.empty() and (sub.poll(50) or sub.last == published.published - 1),
               what="every batch received")
    stored, removed, held, ever = 0, 0, set(), set()
    for batch in sub.batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.medium == "CPU" and ev.block_size == BS and ev.lora_id is None
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                assert ev.parent_block_hash is None or ev.parent_block_hash in ever
                stored += len(ev.block_hashes)
                held.update(ev.block_hashes)
                ever.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                removed += len(ev.block_hashes)
                held.difference_update(ev.block_hashes)
    assert (stored, removed) == (bm.stored, bm.removed)
    assert held == {bm.hash_of[b] for b in bm.cached.values()}
    assert published.dropped == 0


def test_tier_events_and_cli_errors(tiny, tmp_path, request):
    """The tier's own writes are events of its medium; bad --kv-events-config / --kv-tier are one line, exit 2."""
    p1 = free_port()
    cfg = {"endpoint": f"tcp://127.0.0.1:{p1}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    eng = engine(tiny, str(tmp_path / "t"), blocks=16, kv_events_config=cfg)
    sub = Subscriber(cfg["endpoint"], cfg["replay_endpoint"])
    request.addfinalizer(sub.close)
    one_by_one(eng, families(n=4))
    eng.close()
    wait_until(lambda: sub.poll(50) or sub.last == eng.publisher.published - 1, what="every batch received")
    disk = sum(len(e.block_hashes) for b in sub.batches for e in b.events
               if isinstance(e, BlockStored) and e.medium == "DISK")
    assert disk == eng.tier.view()["stored_blocks"] > 0
    for args, msg in ((["--kv-events-config", "{nope"], "not valid JSON"),
                      (["--kv-events-config", '{"publisher": "kafka"}'], "publisher"),
                      (["--kv-tier", str(tmp_path), "--no-prefix-caching"], "prefix caching")):
        r = subprocess.run([sys.executable, "-m", "inferd", "serve", "--port", "0", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- through real servers ---------------------------------------------------------------------------

def two_free_ports() -> int:
    """A port p with p + 1 free too."""
    import socket

    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def metric(base: str, name: str, engine: str | None = None, **labels) -> float:
    """The sum of a series' samples at base/metrics, over those with these labels."""
    if engine is not None:
        labels["engine"] = engine
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_data_parallel_replicas_share_the_tier_and_a_restart_keeps_it(tiny_chat_gguf, tmp_path):
    """Two replicas (round robin) on one tier: the second replica loads the prefix the first computed;
    after a restart the first request of that prefix computes only its tail."""
    d = str(tmp_path / "tier")
    prefix = " ".join(f"w{i}" for i in range(120))
    common = ["--model", tiny_chat_gguf, "--kv-tier", d, "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    body = {"prompt": prefix + " tail one", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    port = two_free_ports()  # replica i publishes its KV events on port + i (vLLM's offset)
    events = ["--kv-events-config", f'{{"endpoint": "tcp://127.0.0.1:{port}"}}']
    subs = [Subscriber(f"tcp://127.0.0.1:{port + i}", None) for i in range(2)]
    with running_server([*common, *events, "--data-parallel-size", "2", "--data-parallel-routing", "round_robin"]) as base:
        r0 = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        wait_until(lambda: metric(base, "inferd:kv_tier_stored_blocks_total") > 0, what="the prefix written")
        r1 = httpx.post(base + "/v1/completions", json={**body, "prompt": prefix + " tail two"}, timeout=60).json()
        loaded = {e: metric(base, "inferd:kv_tier_loaded_tokens_total", e) for e in ("0", "1")}
        assert min(loaded.values()) == 0 and max(loaded.values()) > 0, loaded
        assert r1["choices"][0]["text"]
        for i, sub in enumerate(subs):  # both replicas stored blocks: each told its own subscriber
            wait_until(lambda: sub.poll(50) or any(isinstance(e, BlockStored) for b in sub.batches for e in b.events),
                       what=f"replica {i}'s events")
            raw = msgspec.msgpack.decode(sub.raw[-1])
            assert raw[2] == i  # the batch's data_parallel_rank
    for sub in subs:
        sub.close()
    with running_server(common) as base:
        again = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        n = again["usage"]["prompt_tokens"]
        loaded = metric(base, "inferd:kv_tier_loaded_tokens_total")
        assert loaded == (n - 1) // 16 * 16
        assert metric(base, "inferd:prompt_tokens_computed_total") == n - loaded
        assert again["choices"][0]["text"] == r0["choices"][0]["text"]


def test_router_kv_events_policy_follows_the_blocks(tiny_chat_gguf):
    """A prefix computed on backend b (sent to it directly) is where `--policy kv_events` sends the
    next request of that prefix, following b's own events; `--policy prefix`, which only knows what
    it routed itself, sees a new prefix. (b is the first backend: a new prefix on idle backends
    goes to the second first, so the kv_events router's pick is not that fallback.)"""
    from conftest import ServerProc

    ports = [(free_port(), free_port()) for _ in range(2)]
    backends = [ServerProc(["--model", tiny_chat_gguf, "--kv-cache-memory", "16MiB", "--kv-events-config",
                            f'{{"endpoint": "tcp://127.0.0.1:{p}", "replay_endpoint": "tcp://127.0.0.1:{q}"}}'])
                for p, q in ports]
    routers = []
    try:
        for b in backends:
            b.wait_ready()
        urls = [b.base for b in backends]
        common = [a for u in urls for a in ("--backend", u)] + ["--health-interval", "0.3"]
        routers = [ServerProc([*common, "--policy", "kv_events", "--tokenizer", tiny_chat_gguf,
                               *[a for p, q in ports for a in ("--kv-events-endpoint", f"tcp://127.0.0.1:{p},tcp://127.0.0.1:{q}")]],
                              command="router"),
                   ServerProc([*common, "--policy", "prefix"], command="router")]
        for r in routers:
            r.wait_ready()
            wait_until(lambda: metric(r.base, "inferd:router_backend_up") == 2, what="both backends up")
        prefix = " ".join(f"doc{i}" for i in range(150))
        body = {"prompt": prefix + " question zero", "max_tokens": 2, "temperature": 0}
        assert httpx.post(urls[0] + "/v1/completions", json=body, timeout=60).status_code == 200
        ev_router, guess_router = routers
        wait_until(lambda: metric(ev_router.base, "inferd:router_kv_event_blocks") > 0, what="b's events at the router")
        hits_before = metric(urls[0], "inferd:prefix_cache_hits_total")
        for r in routers:
            got = httpx.post(r.base + "/v1/completions", json={**body, "prompt": prefix + " question one"}, timeout=60)
            assert got.status_code == 200
        sent = {r.base: [metric(r.base, "inferd:router_requests_total", backend=u) for u in urls] for r in routers}
        assert sent[ev_router.base] == [1, 0], sent
        assert metric(ev_router.base, "inferd:router_decisions_total", reason="prefix") == 1
        assert metric(guess_router.base, "inferd:router_decisions_total", reason="new") == 1
        assert metric(urls[0], "inferd:prefix_cache_hits_total") > hits_before
    finally:
        for p in routers + backends:
            p.stop()


def test_event_index_replays_gaps_resets_on_restart_and_guides_the_balancer():
    """KVEventIndex against a real publisher: a late subscriber's gap is filled from the replay
    socket, a publisher that starts numbering again empties the set, in-flight reservations count
    until dropped; the kv_events Balancer follows the events and, where no backend holds the
    prefix, its own memory."""
    from inferd.distributed.kv_events import EventPublisher, KVEventsConfig, hash_chain
    from inferd.distributed.kv_events import BlockStored as Stored
    from inferd.distributed.policy import Balancer
    from inferd.router.kv_index import KVEventIndex

    def publisher():
        cfg = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
        return cfg, EventPublisher(cfg)

    cfg, pub = publisher()
    ids = list(range(1, 65))
    h = hash_chain(ids, BS)
    pub.publish([Stored(h[:2], None, ids[:32], BS, None, "CPU")])  # before anyone listens: replayed
    wait_until(lambda: pub.published == 1, what="the first batch out")
    idx = KVEventIndex({"a": (cfg.endpoint, cfg.replay_endpoint), "b": (f"tcp://127.0.0.1:{free_port()}", None)})
    try:
        def until_seen():
            pub.publish([Stored(h[2:3], h[1], ids[32:48], BS, None, "CPU")])
            return idx.match("a", h) >= 3
        wait_until(until_seen, what="the index to catch up")  # the SUB socket joins some batches late
        assert idx.counts["a"]["replayed"] >= 1 and idx.match("b", h) == 0
        drop = idx.reserve("b", h)
        assert idx.match("b", h) == 4
        drop()
        assert idx.match("b", h) == 0
        bal = Balancer(["a", "b"], "kv_events", chunk=8, matcher=idx.match)
        p = bal.pick((h, "x" * 64), {"a": 0, "b": 0})
        assert (p.target, p.reason) == ("a", "prefix")
        other = hash_chain(list(range(100, 164)), BS)
        first = bal.pick((other, "y" * 64), {"a": 0, "b": 0})
        assert first.reason == "new"
        again = bal.pick((other, "y" * 64), {"a": 0, "b": 0})  # no events yet: the router's own memory
        assert (again.target, again.reason) == (first.target, "prefix")
        pub.close()
        cfg2 = KVEventsConfig(endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint)
        pub = EventPublisher(cfg2)  # a restart: numbering from 0, a new pool

        def restarted():
            pub.publish([Stored(other[:1], None, list(range(100, 116)), BS, None, "CPU")])
            return idx.match("a", other) == 1
        wait_until(restarted, what="the restarted publisher's events")
        assert idx.counts["a"]["resets"] >= 1 and idx.match("a", h) == 0
    finally:
        idx.close()
        pub.close()


def test_a_load_in_flight_does_not_stall_other_requests(tiny, work, tmp_path):
    """While one request's blocks are being read (the read held on a gate), another request keeps
    getting a token every step; the loading request joins once its blocks are in, with the
    reference's tokens."""
    import threading

    reqs, ref = work
    d = str(tmp_path / "tier")
    a = engine(tiny, d, blocks=64)
    one_by_one(a, reqs[:1])
    a.close()
    b = engine(tiny, d, blocks=64)
    gate, read = threading.Event(), b.tier.store.read

    def held_read(*args):
        gate.wait(30)
        return read(*args)
    b.tier.store.read = held_read
    other = b.add_request([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    b.step()
    loading = b.add_request(reqs[0][0], SamplingParams(max_tokens=reqs[0][1], temperature=0))
    got = {other: [], loading: []}
    for _ in range(10):
        for o in b.step():
            got[o.request_id].extend(o.new_token_ids)
        assert loading in b.tier.loading and loading not in [r.request_id for r in b.scheduler.running]
    assert len(got[other]) >= 10 and not got[loading]
    gate.set()
    while b.has_unfinished():
        for o in b.step():
            got[o.request_id].extend(o.new_token_ids)
    compare([got[loading]], [ref[0]], max_ties=1)
    assert b.tier.view()["hit_tokens"] == (len(reqs[0][0]) - 1) // BS * BS
    assert_drained(b)
    b.close()
