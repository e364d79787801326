"""The engine client seam (inferd.engine.client): the engine on a thread (AsyncLLM), the engine core
in its own process (EngineCoreClient) and N replicas behind one client (EngineGroup) are the same
EngineClient to the server, and the group runs whatever replica its start function returns."""
import asyncio

import pytest

from helpers import compare, make_requests, reference_outputs
from inferd.config import EngineConfig
from inferd.distributed.data_parallel import EngineGroup
from inferd.engine.async_engine import AsyncLLM
from inferd.engine.client import EngineClient, Overloaded
from inferd.engine.core_client import EngineCoreClient
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams


async def _run(client, reqs) -> list[list[int]]:
    """Every request through client.generate at once; each request's tokens, in order."""
    async def one(i, prompt, n):
        toks = []
        async for out in client.generate(prompt, SamplingParams(max_tokens=n, temperature=0), f"r{i}"):
            toks += out.new_token_ids
        return toks

    return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs)))


def test_a_group_runs_any_engine_client_as_its_replicas(tiny_model):
    reqs = make_requests(seed=3, n=8)
    finished = [0, 0]

    def start(i, cpus, on_step=None, on_finish=None, on_fault=None):
        return AsyncLLM(LLMEngine(loaded=tiny_model, dtype="float32"), on_finish=on_finish)

    single = AsyncLLM(LLMEngine(loaded=tiny_model, dtype="float32"))
    group = EngineGroup(start, 2, policy="round_robin",
                        on_finish=lambda out, i: finished.__setitem__(i, finished[i] + 1))
    try:
        assert isinstance(single, EngineClient) and isinstance(group, EngineClient)
        assert group.info.max_model_len == single.info.max_model_len
        ref = reference_outputs(tiny_model.model, reqs)
        compare(asyncio.run(_run(single, reqs)), ref, max_ties=1)
        compare(asyncio.run(_run(group, reqs)), ref, max_ties=1)
        assert group.picks == [4, 4] and finished == [4, 4]  # both replicas served, each its half
        assert group.open_requests() == 0 and single.open_requests() == 0
        states = asyncio.run(group.state(8))
        assert [s["engine"] for s in states] == [0, 1]
    finally:
        single.shutdown()
        group.shutdown()


def test_every_client_refuses_past_max_waiting(tiny_model):
    llm = AsyncLLM(LLMEngine(loaded=tiny_model, dtype="float32"), max_waiting=0)

    async def first():
        async for _ in llm.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), "r"):
            pass

    try:
        with pytest.raises(Overloaded):
            asyncio.run(first())
        assert llm.open_requests() == 0  # the refused request left no stream behind
    finally:
        llm.shutdown()


def test_the_core_process_client_sends_deltas_not_the_whole_sequence():
    """What crosses the process boundary is each step's delta: the cumulative ids stay in the core
    (output_ids is None here), num_output_tokens counts them, and the text is the deltas joined."""
    cfg = EngineConfig(model="smollm2-135m", load_format="dummy", dtype="float32", max_model_len=128,
                       num_kv_blocks=32, threads=1)
    client = EngineCoreClient(cfg)
    try:
        assert isinstance(client, EngineClient)
        assert client.info.tokenizer is not None and client.info.pid != 0 and client.info.cache["num_blocks"] == 32

        async def run():
            return [o async for o in client.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0), "r")]

        outs = asyncio.run(run())
        assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4]
        assert all(o.output_ids is None for o in outs) and outs[-1].finished and outs[-1].timings is not None
        ids = [t for o in outs for t in o.new_token_ids]
        assert "".join(o.text_delta for o in outs) == client.info.tokenizer.decode(ids)
        assert client.open_requests() == 0
    finally:
        client.shutdown()
