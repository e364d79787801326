"""KV events: what an engine's KV cache gained and lost, published in vLLM's format and transport so
that KV-aware routers (llm-d's precise prefix scorer, Dynamo's KV router, `inferd router --policy
kv-events`) can send a request to where its prefix really is.

The format is vLLM's (`--kv-events-config`): one `KVEventBatch` per engine step,
`[ts, [event, ...], data_parallel_rank?]`, msgpack-encoded as msgspec's array-like tagged structs,
each event `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`. The transport too: a ZeroMQ PUB
socket sends `(topic, seq as 8 big-endian bytes, payload)`; a ROUTER socket answers a start sequence
number (8 bytes) with every buffered batch from it on, `(seq, payload)` each, then `(-1, b"")`.

Block hashes are the engine's own prefix-cache chain (`block_hash`): stable across processes and
restarts (blake2b, not Python's per-process `hash`), so the KV tier's file names, every replica's
events and the router's lookups agree on what a block is. Torch-free: the router imports it.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from inferd.config import json_flag
from inferd.errors import InferdError

log = logging.getLogger("inferd")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_POOL = "CPU"  # the engine's KV pool (vLLM says "GPU" for its device pool; ours is host memory)


# -- the hash chain ------------------------------------------------------------------------------
def block_hash(parent: int | None, tokens: Sequence[int], seed: int = 0) -> int:
    """The 64-bit hash of a full block: its tokens after the block whose hash is `parent` (None:
    the first block, whose parent is `seed`, 0 for the base model or the adapter's `lora_id`)."""
    words = array("q", (seed if parent is None else parent - (1 << 64) * (parent >= 1 << 63), *tokens))
    return int.from_bytes(hashlib.blake2b(words.tobytes(), digest_size=8).digest(), "big")


def hash_chain(ids: Sequence[int], block_size: int, seed: int = 0, n: int | None = None) -> list[int]:
    """The hashes of the first n (default: every) full blocks of ids."""
    out: list[int] = []
    parent = None
    count = len(ids) // block_size if n is None else min(n, len(ids) // block_size)
    for i in range(count):
        parent = block_hash(parent, ids[i * block_size:(i + 1) * block_size], seed)
        out.append(parent)
    return out


def lora_id(name: str | None) -> int:
    """The int an adapter's blocks are seeded with and its events carry (0: the base model)."""
    if name is None:
        return 0
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big") | 1


# -- vLLM's event schema ----------------------------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


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


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)


_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class EventLog:
    """Where the block manager writes its events during a step; the engine takes them after it.
    Consecutive removals of one medium fold into one event, as vLLM's scheduler batches them."""

    def __init__(self):
        self.events: list = []

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
               lora: int | None, medium: str = MEDIUM_POOL):
        self.events.append(BlockStored(hashes, parent, tokens, block_size, lora or None, medium))

    def removed(self, h: int, medium: str = MEDIUM_POOL):
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(h)
        else:
            self.events.append(BlockRemoved([h], medium))

    def cleared(self):
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        out, self.events = self.events, []
        return out


# -- configuration --------------------------------------------------------------------------------
@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields. inferd binds the endpoints it is given (a wildcard host as
    vLLM's default, or one address); its default is loopback, as every inferd listener's."""
    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """A data-parallel replica's endpoints: the port + rank (tcp), or the path + _dp<rank>."""
        if rank == 0:
            return self
        return KVEventsConfig(**{**self.__dict__, "endpoint": offset_endpoint(self.endpoint, rank),
                                 "replay_endpoint": self.replay_endpoint and offset_endpoint(self.replay_endpoint, rank)})


def offset_endpoint(endpoint: str, rank: int) -> str:
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def parse_kv_events_config(value) -> KVEventsConfig | None:
    """--kv-events-config: a JSON object (or a dict from YAML) of KVEventsConfig's fields; None, or
    events disabled / publisher "null": no publisher."""
    if value is None or value == "":
        return None
    value = json_flag(value, "--kv-events-config")
    known = KVEventsConfig.__dataclass_fields__
    bad = sorted(set(value) - set(known))
    if bad:
        raise InferdError(f"--kv-events-config: unknown field(s) {', '.join(bad)} (known: {', '.join(known)})")
    cfg = KVEventsConfig(**value)
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    if cfg.publisher != "zmq":
        raise InferdError(f"--kv-events-config: publisher {cfg.publisher!r} is not one of zmq, null")
    for ep in (cfg.endpoint, cfg.replay_endpoint):
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise InferdError(f"--kv-events-config: endpoint {ep!r} is not a ZeroMQ address (tcp://HOST:PORT, ipc://PATH)")
    if cfg.buffer_steps < 1 or cfg.max_queue_size < 1:
        raise InferdError("--kv-events-config: buffer_steps and max_queue_size must be at least 1")
    return cfg


# -- the publisher --------------------------------------------------------------------------------
class EventPublisher:
    """One thread owns the PUB and replay sockets (ZeroMQ sockets are not thread-safe); the engine
    thread only queues batches. Sequence numbers count batches from 0; the last `buffer_steps` are
    kept for replay. A full queue drops the batch, counted: a subscriber sees the gap by its seq."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int | None = None):
        import zmq

        self.cfg, self.rank = cfg, data_parallel_rank
        self.queue: queue.Queue = queue.Queue(cfg.max_queue_size)
        self.dropped = 0
        self.published = 0
        self._enc = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InferdError(f"KV events: cannot bind {cfg.endpoint if self._replay is None else cfg.replay_endpoint}: {e}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._loop, name="inferd-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r)", cfg.endpoint,
                 f", replay on {cfg.replay_endpoint}" if cfg.replay_endpoint else "", cfg.topic)

    def publish(self, events: list):
        if not events:
            return
        try:
            self.queue.put_nowait(EventBatch(time.time(), events, self.rank))
        except queue.Full:
            self.dropped += 1

    def _loop(self):
        import zmq

        topic = self.cfg.topic.encode()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self.queue.get(timeout=0.02)
            except queue.Empty:
                batch = False
            if batch is None:
                break
            if batch:
                payload = self._enc.encode(batch)
                seq = self._seq.to_bytes(8, "big")
                self._buffer.append((self._seq, payload))
                self._pub.send_multipart((topic, seq, payload))
                self._seq += 1
                self.published += 1
            if self._replay is not None:
                while poller.poll(0):
                    self._serve_replay()
        self._close_sockets()

    def _serve_replay(self):
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignored a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self):
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=500)
        self._ctx.term()

    def close(self):
        """Send what is queued, then stop."""
        self.queue.put(None)
        self._thread.join(5)
