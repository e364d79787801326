"""`inferd router --policy kv_events`: where each prefix block really is, from the backends' own KV
events (vLLM's format: inferd.distributed.kv_events), instead of the router's memory of where it
sent things.

One thread subscribes to every backend's PUB endpoint and keeps, per backend, the set of block
hashes its pool holds: BlockStored adds, BlockRemoved removes, AllBlocksCleared empties. Beside
the events, the blocks of requests in flight to a backend count as its own until their answer
ends (`reserve`): events say what was computed, not what is being computed, and a router that
ignored its own in-flight requests would scatter a new prefix's first requests over every
backend (Dynamo's KV router keeps the same provisional view). A gap in
a backend's sequence numbers is filled from its replay endpoint when it has one; without one, or
when the replay no longer holds the gap, that backend's set is emptied (a stale set would route to
a cache that is gone; an empty one only costs a miss until new events arrive). Blocks of other
media (a shared disk tier) do not count: every backend on that tier can load them.
"""
from __future__ import annotations

import logging
import threading
from typing import Hashable, Sequence

from inferd.distributed.kv_events import END_SEQ, MEDIUM_POOL, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

log = logging.getLogger("inferd.router")


def parse_endpoint(spec: str) -> tuple[str, str | None]:
    """'tcp://h:p' or 'tcp://h:p,tcp://h:q' (events, then replay)."""
    pub, _, replay = spec.partition(",")
    return pub.strip(), (replay.strip() or None)


class KVEventIndex:
    def __init__(self, endpoints: dict[Hashable, tuple[str, str | None]], topic: str = ""):
        import zmq

        self.endpoints = endpoints
        self.blocks: dict[Hashable, set[int]] = {t: set() for t in endpoints}
        self.pending: dict[Hashable, dict[int, int]] = {}  # target -> hash -> requests in flight (event loop only)
        self.counts = {t: {"batches": 0, "events": 0, "gaps": 0, "replayed": 0, "resets": 0} for t in endpoints}
        self._last: dict[Hashable, int] = {t: -1 for t in endpoints}
        self._ctx = zmq.Context()
        self._subs = {}
        for t, (pub, _) in endpoints.items():
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.connect(pub)
            self._subs[s] = t
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferd-router-kv-events", daemon=True)
        self._thread.start()

    def match(self, target: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of this chain the target's pool holds, or is computing now for a
        request this router sent it (its events come only once those blocks are computed: without
        this, the second request of a new prefix, sent while the first is still in prefill, would
        look new and go elsewhere, and both backends would compute and cache the same prefix)."""
        have = self.blocks.get(target, ())
        coming = self.pending.get(target, {})
        k = 0
        while k < len(hashes) and (hashes[k] in have or hashes[k] in coming):
            k += 1
        return k

    def reserve(self, target: Hashable, hashes: Sequence[int]):
        """A request with these block hashes is on its way to target; call the result when its
        answer is over (by then the target's own events say what it kept)."""
        coming = self.pending.setdefault(target, {})
        for h in hashes:
            coming[h] = coming.get(h, 0) + 1

        def drop():
            for h in hashes:
                n = coming.get(h, 0) - 1
                if n > 0:
                    coming[h] = n
                else:
                    coming.pop(h, None)
        return drop

    def _loop(self):
        import zmq

        poller = zmq.Poller()
        for s in self._subs:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                t = self._subs[s]
                try:
                    _, seq_b, payload = s.recv_multipart()
                except ValueError:
                    continue
                seq = int.from_bytes(seq_b, "big")
                last = self._last[t]
                if seq > last + 1:  # a gap, or a first batch after some (a late join): replay
                    self.counts[t]["gaps"] += 1
                    self._replay(t, last + 1, seq)
                elif 0 <= seq <= last:  # numbering started again: the backend restarted, its pool is new
                    self.blocks[t] = set()
                    self.counts[t]["resets"] += 1
                    self._last[t] = -1
                    if seq > 0:  # and its first batches went by before we were reconnected
                        self._replay(t, 0, seq)
                self._apply(t, payload)
                self._last[t] = seq
        for s in self._subs:
            s.close(linger=0)
        self._ctx.term()

    def _replay(self, t, first: int, upto: int):
        """Fetch batches first..upto-1 from the backend's replay endpoint; reset its set if it cannot."""
        import zmq

        replay = self.endpoints[t][1]
        got_first = False
        if replay is not None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(replay)
            d.send_multipart((b"", first.to_bytes(8, "big")))
            while d.poll(1000):
                _, seq_b, payload = d.recv_multipart()
                if seq_b == END_SEQ:
                    break
                seq = int.from_bytes(seq_b, "big")
                if seq == first:
                    got_first = True
                if got_first and seq < upto and seq > self._last[t]:
                    self._apply(t, payload)
                    self._last[t] = seq
                    self.counts[t]["replayed"] += 1
            d.close()
        if not got_first:
            log.warning("KV events from %s: batches %d..%d are lost; forgetting its blocks until new events come",
                        t, first, upto - 1)
            self.blocks[t] = set()
            self.counts[t]["resets"] += 1
        self._last[t] = upto - 1

    def _apply(self, t, payload: bytes):
        try:
            batch = decode_batch(payload)
        except Exception as e:  # noqa: BLE001 - a publisher's bad batch must not stop the thread
            log.warning("KV events from %s: undecodable batch (%s)", t, e)
            return
        have = self.blocks[t]
        c = self.counts[t]
        c["batches"] += 1
        for ev in batch.events:
            c["events"] += 1
            if isinstance(ev, BlockStored):
                if ev.medium in (None, MEDIUM_POOL):
                    have.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in (None, MEDIUM_POOL):
                    have.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                have.clear()

    def forget(self, target):
        """A backend restarted: its pool is empty (its first events will say what it holds again)."""
        if target in self.blocks:
            self.blocks[target] = set()
            self._last[target] = -1

    def close(self):
        self._stop.set()
        self._thread.join(2)
