"""The Responses API's store: what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` read.

Bounded three ways, each a flag: entries, bytes (the JSON size of what an entry keeps: its
response and the conversation it ended), and a time to live. Past a bound the oldest entries go
first; an entry alone larger than the byte bound is not kept (the request still succeeds; a later
`GET` finds nothing). vLLM ships its store off for want of any bound; this one cannot grow past its
bytes, and /metrics shows its size.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_ENTRIES = 1024
DEFAULT_BYTES = 64 * 2**20
DEFAULT_TTL_S = 3600.0


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # the input items this response answered, then its output items
    size: int
    at: float


def json_size(x) -> int:
    return len(json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        self._expire()
        return len(self.entries)

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep a response; False when it alone is past the byte bound (or the store is off)."""
        size = json_size(response) + json_size(conversation)
        if self.max_entries <= 0 or size > self.max_bytes:
            return False
        self.delete(response["id"])
        self.entries[response["id"]] = Stored(response, conversation, size, self.clock())
        self.bytes += size
        self._expire()
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            self._pop_oldest()
        return True

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        st = self.entries.pop(rid, None)
        if st is None:
            return False
        self.bytes -= st.size
        return True

    def _pop_oldest(self):
        _, st = self.entries.popitem(last=False)
        self.bytes -= st.size
        self.evicted += 1

    def _expire(self):
        """Entries are in insertion order with one time to live: the expired ones are the first."""
        now = self.clock()
        while self.entries and now - next(iter(self.entries.values())).at > self.ttl_s:
            self._pop_oldest()

    def stats(self) -> dict:
        self._expire()
        return {"entries": len(self.entries), "bytes": self.bytes, "max_entries": self.max_entries,
                "max_bytes": self.max_bytes, "ttl_s": self.ttl_s, "evicted": self.evicted}
