"""Disaggregated prefill/decode (inferd.distributed.kv_transfer, inferd router --prefill/--decode).

Engine level, on tiny random models in one process: a producer engine and a consumer engine,
their outputs against the reference loop, what each computed, what the connector moved, what the
leases held; faults (a pull that never gets an answer, aborts in every phase, lease expiry) and
bad input. The servers and the router, with the official openai client, are in
test_disagg_serving.py.
"""
import random
import time

import pytest
import torch

from conftest import make_tiny_model
from helpers import assert_no_leaks, compare, make_requests, reference_outputs
from inferd.engine.engine import LLMEngine
from inferd.faults import Faults
from inferd.distributed.kv_transfer import parse_kv_transfer_config
from inferd.distributed.kv_transfer.leases import LeaseTable
from inferd.distributed.kv_transfer.wire import bytes_per_token, prompt_digest, token_slots
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError

CONNECTORS = ("ZmqConnector", "SharedMemoryConnector")


def engine(model, role, conn="ZmqConnector", extra=None, **opts):
    cfg = {"kv_connector": conn, "kv_role": role, "kv_connector_extra_config": extra or {}}
    return LLMEngine(loaded=model, dtype="float32", kv_transfer_config=cfg, **{"num_kv_blocks": 256, **opts})


def prefill(P, reqs, tag="r", each_step=None):
    """Run each prompt on the producer as the router does (one token, KV leased): its params
    (None for a request aborted by `each_step`, called after every step)."""
    for i, (p, _) in enumerate(reqs):
        P.add_request(p, SamplingParams(max_tokens=1, temperature=0), f"{tag}{i}",
                      kv_transfer_params={"do_remote_decode": True})
    params = {}
    while P.has_unfinished():
        for o in P.step():
            if o.finished and o.finish_reason != "abort":
                params[o.request_id] = o.kv_transfer_params
        if each_step is not None:
            each_step()
    return [params.get(f"{tag}{i}") for i in range(len(reqs))]


def decode(C, reqs, params, P=None, tag="r", abort=None):
    """Run the requests on the consumer with the producer's params; P's housekeeping runs between
    steps (it would run in its own process)."""
    outs = {}
    for i, ((p, n), kvp) in enumerate(zip(reqs, params)):
        C.add_request(p, SamplingParams(max_tokens=n, temperature=0), f"{tag}{i}", kv_transfer_params=kvp)
        outs[f"{tag}{i}"] = []
    steps, deadline = 0, time.monotonic() + 120
    while C.has_unfinished():
        assert time.monotonic() < deadline, f"the consumer made no progress: {C.kv.blocked} {C.scheduler.waiting}"
        if P is not None:
            P.housekeeping()
        for o in C.step():
            outs[o.request_id].extend(o.new_token_ids)
        steps += 1
        if abort is not None:
            abort(C, steps)
        C.block_manager.check_invariants(C.scheduler.running + list(C.scheduler.waiting) + list(
            C.kv.pending.values()))
    return [outs[f"{tag}{i}"] for i in range(len(reqs))]


def settle(*engines, until=lambda: True, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines:
            e.housekeeping()
        if until():
            return
        time.sleep(0.01)


def assert_pool_empty(eng):
    """Nothing used, nothing leased, every block free or findable in the prefix cache."""
    eng.housekeeping()
    if eng.kv.leases is not None:
        assert len(eng.kv.leases) == 0 and eng.kv.leases.num_blocks == 0
    if eng.kv.connector is not None:
        assert not eng.kv.pending and not eng.kv.blocked and not eng.kv.cancelled
    assert_no_leaks(eng)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


# -- pure parts ---------------------------------------------------------------------------------

def test_config_keys_roles_and_errors():
    c = parse_kv_transfer_config('{"kv_connector": "shm", "kv_role": "kv_producer", "kv_port": 7000}')
    assert (c.kv_connector, c.kv_role, c.kv_port, c.producer, c.consumer) == (
        "SharedMemoryConnector", "kv_producer", 7000, True, False)
    d = parse_kv_transfer_config(None, "decode")
    assert (d.kv_connector, d.kv_role) == ("ZmqConnector", "kv_consumer")  # --role: the network connector
    assert parse_kv_transfer_config(None, "both").producer and parse_kv_transfer_config(None, "both").consumer
    assert parse_kv_transfer_config(None, None) is None
    for bad, words in [("{not json", "not valid JSON"), ("[1]", "JSON object"), ('{"kv_conector": "shm"}', "unknown key"),
                       ('{"kv_connector": "nccl"}', "unknown kv_connector"), ('{"kv_role": "boss"}', "kv_role"),
                       ('{"kv_port": 70000}', "kv_port"), ('{"kv_connector_extra_config": {"lease": 1}}', "unknown"),
                       ('{"kv_connector_extra_config": {"lease_timeout_s": -1}}', "lease_timeout_s")]:
        with pytest.raises(InferdError, match=words) as e:
            parse_kv_transfer_config(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(InferdError, match="contradicts"):
        parse_kv_transfer_config('{"kv_role": "kv_consumer"}', "prefill")


def test_token_slots_bytes_per_token_and_leases():
    assert token_slots([5, 2], 4, 2, 6) == [22, 23, 8, 9]
    # the default model (SmolLM2-135M: 30 layers, 3 KV heads of 64) in fp32: 46,080 B per token
    assert bytes_per_token(30, 3, 64, 4) == 46_080
    t = LeaseTable(timeout_s=10)
    t.add("a", [1, 2], 20, now=0.0)
    t.add("b", [3], 5, now=5.0)
    assert t.num_blocks == 3 and t.expire(now=12.0) == 1 and t.expired == 1
    assert t.confirm("b") and not t.confirm("b") and not t.confirm("a")  # each lease is freed once
    assert sorted(map(tuple, t.take_freeable())) == [(1, 2), (3,)] and t.num_blocks == 0


# -- equality and the proof the machinery ran ---------------------------------------------------------

@pytest.mark.parametrize("conn", CONNECTORS)
def test_an_int8_cache_travels_as_it_is(tiny, conn):
    """int8 pools on both sides: the prompt's rows move as the pool holds them (head_dim codes and a
    4-byte scale a row, nothing requantized), so the consumer's tokens are a colocated int8 engine's."""
    reqs = make_requests(seed=5, n=4)
    from helpers import run_recording

    alone = LLMEngine(loaded=tiny, dtype="float32", num_kv_blocks=256, kv_cache_dtype="int8")
    want = run_recording(alone, reqs)  # tokens and the logits each came from: the near-tie rule's
    alone.close()
    P = engine(tiny, "kv_producer", conn, kv_cache_dtype="int8")
    C = engine(tiny, "kv_consumer", conn, kv_cache_dtype="int8", block_size=8)
    try:
        got = decode(C, reqs, prefill(P, reqs), P)
        compare(got, want, max_ties=1, what="int8 disaggregated vs colocated")
        kv = C.kv.counters
        assert kv["recomputes"] == kv["failures"] == 0 and C.stats.prefill_tokens == len(reqs)
        assert kv["bytes"] == kv["tokens"] * bytes_per_token(2, 2, 16 + 2, 1)  # 16 codes, one fp16 scale > 0
        settle(P, until=lambda: len(P.kv.leases) == 0)
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("conn", CONNECTORS)
def test_1p1d_gives_the_reference_tokens_and_moves_exactly_the_prompt_kv(tiny, conn):
    """Mixed prompts (short, long and chunked on the producer, shared prefixes that hit its cache),
    then the same families again so the consumer's own cache holds part of some prompts. Different
    block sizes on the two sides: KV travels by token."""
    reqs = make_requests(seed=3, n=24, shared_prefixes=3) + make_requests(seed=4, n=8)
    ref = reference_outputs(tiny.model, reqs)
    P = engine(tiny, "kv_producer", conn, max_num_batched_tokens=64)  # long prompts take several chunks
    C = engine(tiny, "kv_consumer", conn, block_size=8)
    try:
        params = prefill(P, reqs)
        assert P.stats.max_prefill_chunks > 1 and P.block_manager.hits > 0
        assert len(P.kv.leases) == len(reqs) and P.block_manager.num_used > 0
        got = decode(C, reqs, params, P)
        compare(got, ref, max_ties=1)
        kv = C.kv.counters
        assert kv["recomputes"] == kv["failures"] == 0 and kv["transfers"] <= len(reqs)
        # the consumer computed exactly one prompt token per request: the last position
        assert C.stats.prefill_tokens == len(reqs)
        hits = C.block_manager.hits
        assert hits > 0  # later members of a family found its prefix in the consumer's own cache
        assert kv["tokens"] == sum(len(p) - 1 for p, _ in reqs) - hits
        assert kv["bytes"] == kv["tokens"] * bytes_per_token(2, 2, 16, 4)
        if conn == "ZmqConnector":
            assert P.kv.server.bytes_sent == kv["bytes"]
        else:
            assert P.kv.server.bytes_sent == 0  # shared memory: only confirmations cross the socket
        settle(P, until=lambda: len(P.kv.leases) == 0)
        assert P.kv.leases.confirmed == len(reqs) and P.kv.leases.expired == 0
        assert_pool_empty(P)
        assert_pool_empty(C)
    finally:
        P.close()
        C.close()


def test_sampling_state_stays_on_the_consumer(tiny):
    """Seeded sampling, penalties and logprobs on the consumer equal a colocated engine's: the
    consumer samples every output token itself."""
    reqs = make_requests(seed=5, n=6)
    sp = dict(temperature=0.9, top_p=0.9, seed=11, presence_penalty=0.5, logprobs=2)
    col = LLMEngine(loaded=tiny, dtype="float32", num_kv_blocks=256)
    want = {}
    for i, (p, n) in enumerate(reqs):
        col.add_request(p, SamplingParams(max_tokens=n, **sp), f"r{i}")
    while col.has_unfinished():
        for o in col.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    P, C = engine(tiny, "kv_producer"), engine(tiny, "kv_consumer")
    try:
        params = prefill(P, reqs)
        got = {}
        for i, ((p, n), kvp) in enumerate(zip(reqs, params)):
            C.add_request(p, SamplingParams(max_tokens=n, **sp), f"r{i}", kv_transfer_params=kvp)
        while C.has_unfinished():
            P.housekeeping()
            for o in C.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert got == want and C.kv.counters["recomputes"] == 0
    finally:
        P.close()
        C.close()


# -- faults ----------------------------------------------------------------------------------------

def test_a_pull_that_never_gets_an_answer_is_recomputed_and_leases_expire(tiny):
    reqs = make_requests(seed=6, n=4)
    ref = reference_outputs(tiny.model, reqs)
    P = engine(tiny, "kv_producer", extra={"lease_timeout_s": 0.5})
    C = engine(tiny, "kv_consumer", extra={"transfer_timeout_s": 0.3})
    P.kv.server.faults = Faults("kv_fetch@1+")  # the KV server drops every fetch
    try:
        params = prefill(P, reqs)
        got = decode(C, reqs, params, P)
        compare(got, ref, max_ties=0)
        kv = C.kv.counters
        assert kv["recomputes"] == len(reqs) and kv["transfers"] == 0 and kv["bytes"] == 0
        assert C.stats.prefill_tokens == sum(len(p) for p, _ in reqs)  # the whole prompts, here
        settle(P, until=lambda: len(P.kv.leases) == 0)
        assert P.kv.leases.expired == len(reqs)
        assert_pool_empty(P)
        assert_pool_empty(C)
    finally:
        P.close()
        C.close()


def test_a_producer_that_is_gone_means_recompute(tiny):
    reqs = make_requests(seed=7, n=3)
    P = engine(tiny, "kv_producer")
    C = engine(tiny, "kv_consumer", extra={"transfer_timeout_s": 0.3})
    params = prefill(P, reqs)
    P.close()  # its KV server is gone (the process-level kill is in test_disagg_serving.py)
    try:
        got = decode(C, reqs, params)
        compare(got, reference_outputs(tiny.model, reqs), max_ties=0)
        assert C.kv.counters["recomputes"] == len(reqs)
        assert_pool_empty(C)
    finally:
        C.close()


def test_aborts_in_every_phase_leave_nothing_behind(tiny):
    """Abort on the producer mid-prefill and after its lease; on the consumer while its pull runs
    and while it waits for blocks; 500 requests with random aborts. Both pools end empty."""
    rng = random.Random(0)
    P = engine(tiny, "kv_producer", extra={"lease_timeout_s": 0.5}, max_num_batched_tokens=64, num_kv_blocks=1024)
    C = engine(tiny, "kv_consumer", extra={"transfer_timeout_s": 0.5}, num_kv_blocks=48)
    try:
        total = 0
        for rnd in range(10):
            reqs = [(p, rng.randint(1, 6)) for p, _ in make_requests(seed=100 + rnd, n=50)]
            tag = f"x{rnd}-"

            def abort_some():
                for rid in list(P.requests):
                    if rng.random() < 0.01:
                        P.abort(rid)

            params = prefill(P, reqs, tag, abort_some)
            for i, ((p, n), kvp) in enumerate(zip(reqs, params)):
                if kvp is not None and rng.random() < 0.9:  # some leases are never claimed
                    C.add_request(p, SamplingParams(max_tokens=n, temperature=0), f"{tag}{i}",
                                  kv_transfer_params=kvp)
                    total += 1
            deadline = time.monotonic() + 120
            while C.has_unfinished():
                assert time.monotonic() < deadline, "the consumer made no progress"
                P.housekeeping()
                C.step()
                for rid in list(C.requests):
                    if rng.random() < 0.05:
                        C.abort(rid)  # queued for blocks, pulling, or decoding
        assert total > 250  # of the 500 prefilled
        assert C.kv.counters["transfers"] > 0 and C.kv.cancelled == set()
        settle(P, C, until=lambda: len(P.kv.leases) == 0 and not C.kv.pending)
        assert P.kv.leases.expired > 0 and P.kv.leases.confirmed > 0
        assert_pool_empty(P)
        assert_pool_empty(C)
    finally:
        P.close()
        C.close()


def test_leases_that_fill_the_producer_make_new_prompts_wait_not_fail(tiny):
    """Under load a producer's pool can be all leases: new prompts wait for confirmations (or
    expiries) instead of failing the engine."""
    reqs = [(p, 4) for p, _ in make_requests(seed=10, n=6)]
    P = engine(tiny, "kv_producer", extra={"lease_timeout_s": 0.3}, num_kv_blocks=24)
    try:
        params = prefill(P, reqs)  # more prompts than the pool holds: later ones wait for expiries
        assert all(params) and P.kv.leases.expired > 0
        settle(P, until=lambda: len(P.kv.leases) == 0)
        assert_pool_empty(P)
    finally:
        P.close()


def test_abort_while_the_pull_runs_frees_the_blocks_when_it_ends(tiny):
    (p, n), = make_requests(seed=8, n=1)
    P = engine(tiny, "kv_producer", extra={"lease_timeout_s": 0.3})
    C = engine(tiny, "kv_consumer", extra={"transfer_timeout_s": 0.4})
    P.kv.server.faults = Faults("kv_fetch@1+")
    try:
        kvp, = prefill(P, [(p, n)])
        C.add_request(p, SamplingParams(max_tokens=n, temperature=0), "a", kv_transfer_params=kvp)
        assert C.kv.pending and C.block_manager.num_used > 0
        C.abort("a")
        assert C.block_manager.num_used > 0  # held: the fetch thread may still write into them
        settle(P, C, until=lambda: not C.kv.pending and len(P.kv.leases) == 0)
        assert_pool_empty(C)
        assert_pool_empty(P)
    finally:
        P.close()
        C.close()


# -- bad input -------------------------------------------------------------------------------------

def test_bad_kv_transfer_params_are_clear_errors_at_admission(tiny):
    reqs = make_requests(seed=9, n=1)
    p = reqs[0][0]
    P = engine(tiny, "kv_producer")
    C = engine(tiny, "kv_consumer")
    other = make_tiny_model(seed=1)
    C_other = engine(other, "kv_consumer")
    C_bf16 = engine(tiny, "kv_consumer", kv_cache_dtype="bfloat16")
    plain = LLMEngine(loaded=tiny, dtype="float32", num_kv_blocks=64)
    C_shm = engine(tiny, "kv_consumer", "SharedMemoryConnector")  # its producer shares no pool
    try:
        good, = prefill(P, reqs)
        sp = SamplingParams(max_tokens=4, temperature=0)
        cases = [
            (C, {**good, "remote_block_ids": [10**6] * len(good["remote_block_ids"])}, "does not have"),
            (C, {**good, "remote_block_ids": good["remote_block_ids"][:-1] or [0, 0]}, "cannot hold"),
            (C, {**good, "remote_prompt_digest": prompt_digest(p[:-1])}, "different prompt"),
            (C, {k: v for k, v in good.items() if k != "remote_fingerprint"}, "remote_fingerprint"),
            (C, {**good, "remote_port": "x"}, "remote_port"),
            (C, "nope", "must be an object"),
            (C_other, good, "incompatible producer: weights"),
            (C_bf16, good, "incompatible producer: kv_dtype"),
            (P, good, "not a KV consumer"),
            (C, {"do_remote_decode": True}, "not a KV producer"),
            (plain, good, "--kv-transfer-config"),
            (C_shm, good, "does not share its KV pool"),
        ]
        for eng, kvp, words in cases:
            with pytest.raises(InferdError, match=words) as e:
                eng.add_request(p, sp, kv_transfer_params=kvp)
            assert "\n" not in str(e.value)
        with pytest.raises(InferdError, match="this prompt has"):
            C.add_request(p + [1], sp, kv_transfer_params=good)
        with pytest.raises(InferdError, match="n = 1"):
            P.add_request(p, SamplingParams(max_tokens=1, n=2, temperature=1.0),
                          kv_transfer_params={"do_remote_decode": True})
        assert not C.requests and C.block_manager.num_used == 0
    finally:
        for e in (P, C, C_other, C_bf16, C_shm):
            e.close()


def test_a_malformed_config_fails_the_engine_at_start(tiny):
    with pytest.raises(InferdError, match="unknown kv_connector"):
        LLMEngine(loaded=tiny, dtype="float32", num_kv_blocks=8, kv_transfer_config={"kv_connector": "nixl"})


def test_a_shared_pool_is_released_with_its_process(tiny):
    P = engine(tiny, "kv_producer", "SharedMemoryConnector", num_kv_blocks=8)
    try:
        path = P.pool.shm["path"]
        assert path.startswith("/proc/") and torch.equal(P.pool.k, torch.zeros_like(P.pool.k))
        import os

        assert not any(n.startswith("inferd-kv-") for n in os.listdir("/dev/shm"))  # unlinked at once
    finally:
        P.close()


def test_pulled_requests_holding_blocks_never_block_the_queue(tiny):
    """A consumer whose pool is mostly held by pulled (prefilled, waiting) requests, with a preempted
    request at the head of its queue that needs blocks: the pulled ones run first, so it finishes."""
    reqs = [(p, 40) for p, _ in make_requests(seed=11, n=12)]
    P = engine(tiny, "kv_producer", num_kv_blocks=1024)
    C = engine(tiny, "kv_consumer", num_kv_blocks=48, block_size=8, max_num_seqs=4)
    try:
        params = prefill(P, reqs)
        got = decode(C, reqs, params, P)
        compare(got, reference_outputs(tiny.model, reqs), max_ties=1)
        assert C.kv.counters["recomputes"] == 0
        assert_pool_empty(C)
    finally:
        P.close()
        C.close()
