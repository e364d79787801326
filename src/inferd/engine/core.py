"""The engine core in its own process: build the engine, then serve messages (inferd.engine.messages)
until the server says stop.

Why a process: in one process the asyncio server (HTTP, tokenizing, SSE) and the engine loop share
one interpreter lock, and on two cores a waiting thread costs the engine's OpenMP workers their
core. vLLM v1 moved its engine loop into a separate EngineCore process for the same reason, and
replicas, disaggregated prefill/decode and tensor parallelism all need the engine behind a message
boundary. The API process's end is inferd.engine.core_client.

Faults: if the engine cannot go on (any exception in a step), the core sends one Fault with the
reason and exits non-zero; the client fails every open stream with it.
"""
from __future__ import annotations

import logging
import os
import pickle
from typing import TYPE_CHECKING

from inferd.engine.messages import (Abort, AddFailed, AddRequest, Control, ControlReply, Fault, Ready, Shutdown,
                                    StateQuery, StateReply, StepOutputs)
from inferd.errors import InferdError

if TYPE_CHECKING:
    from inferd.engine.interface import Engine

log = logging.getLogger("inferd")


def run_core(cfg, to_core: str, from_core: str, threads: int | None, log_level: int = logging.INFO,
             cpus: list[int] | None = None):
    """The core process's main (started with `spawn`): build the engine, then serve messages.
    `cpus`: the cores this engine is pinned to (data parallelism: replicas must not share cores,
    or their OpenMP workers preempt each other at every barrier)."""
    import signal
    import sys

    # The server decides when the core stops (after draining, on a Shutdown message); a SIGINT or
    # SIGTERM sent to the whole process group must not kill it under the open requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
        threads = threads or len(cpus)
    if threads:  # before torch loads, so OpenMP starts with this many workers
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[k] = str(threads)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(to_core)
    push = ctx.socket(zmq.PUSH)
    push.connect(from_core)

    def send(msg):
        push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from dataclasses import replace

        from inferd.engine.factory import make_engine

        engine = make_engine(cfg)
        # the tokenizer crosses as the file it came from: the API process loads its own
        send(Ready(replace(engine.info(), tokenizer=None), engine.tokenizer_path()))
        try:
            _serve(engine, pull, send, os.getppid())
        finally:
            engine.close()
    except Exception as e:  # the engine cannot go on: say why, then exit non-zero
        from inferd.distributed.comm import CollectiveError

        one_line = isinstance(e, (InferdError, CollectiveError))  # the reason is the whole story
        if not one_line:  # a user-facing error is the API process's one line
            log.exception("engine core died")
        try:
            send(Fault(str(e) if one_line else f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        raise SystemExit(1)
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()


def _serve(engine: Engine, pull, send, parent: int):
    import zmq

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    adds = 0
    while True:
        # idle: wait for a message; busy: take what is there and step
        timeout = 0 if engine.has_unfinished() else 500
        if os.getppid() != parent:  # the server is gone (killed): nothing to serve
            return
        handled = False
        while poller.poll(timeout):
            msg = pickle.loads(pull.recv())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequest):
                adds += 1
                try:
                    engine.add_request(msg.prompt_ids, msg.params, msg.request_id, msg.arrival,
                                       msg.kv_transfer_params, lora=msg.lora)
                except Exception as e:  # InferdError: the client's 400
                    send(AddFailed(msg.request_id, e))
            elif isinstance(msg, Abort):
                engine.abort(msg.request_id)
            elif isinstance(msg, Control):
                try:
                    send(ControlReply(msg.seq, engine.control(msg.op, **msg.args)))
                except InferdError as e:  # refused: the operator's 400 / 409
                    send(ControlReply(msg.seq, error=e))
                timeout = 0
                continue
            elif isinstance(msg, StateQuery):  # changes nothing: no gauges to send after it
                from inferd.engine.state import read_state

                send(StateReply(msg.seq, {"pid": os.getpid(), **read_state(engine, msg.steps)}))
                timeout = 0
                continue
            handled = True
            timeout = 0
        if engine.has_unfinished():
            send(StepOutputs([_slim(o) for o in engine.step()], engine.snapshot(), adds))
        elif engine.housekeeping() or handled:  # an abort or a freed lease on an idle engine shows in the gauges
            send(StepOutputs([_slim(o) for o in engine.take_aborted()], engine.snapshot(), adds))


def _slim(out):
    """What crosses the boundary of one output: the step's delta. The cumulative ids, and the
    timings before the finish, would make every message grow with the sequence (quadratic in its
    length); what a client needs of them is the count (num_output_tokens)."""
    from dataclasses import replace

    return replace(out, output_ids=None, timings=out.timings if out.finished else None)
