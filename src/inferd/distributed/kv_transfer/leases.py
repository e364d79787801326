"""A producer's leases: the blocks of finished prompts, held until a consumer confirms it has
copied them, or until the lease expires (then freed and counted).

Shared by two threads: the engine thread creates leases and is the only one to free blocks (the
BlockManager is not thread-safe); the KV server thread reads leased blocks and confirms them. So
a confirmation or an expiry only moves the lease to `freeable`, which the engine thread empties.
Reads happen under the table's lock, and blocks leave the table under the same lock before the
engine thread can reuse them: a reply is never a copy of a reused block.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    blocks: list[int]
    num_tokens: int
    expires: float  # time.monotonic()


class LeaseTable:
    def __init__(self, timeout_s: float):
        self.timeout = timeout_s
        self.lock = threading.Lock()
        self.leases: dict[str, Lease] = {}
        self.freeable: list[list[int]] = []
        self.created = self.confirmed = self.expired = 0

    def add(self, lease_id: str, blocks: list[int], num_tokens: int, now: float | None = None):
        with self.lock:
            self.leases[lease_id] = Lease(list(blocks), num_tokens, (time.monotonic() if now is None else now) + self.timeout)
            self.created += 1

    def confirm(self, lease_id: str) -> bool:
        """The consumer has the blocks: free them. False if the lease was gone already (expired,
        confirmed, never made): whatever a shared-memory reader copied may then be stale."""
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self.freeable.append(lease.blocks)
            self.confirmed += 1
            return True

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self.lock:
            gone = [k for k, v in self.leases.items() if v.expires <= now]
            for k in gone:
                self.freeable.append(self.leases.pop(k).blocks)
            self.expired += len(gone)
            return len(gone)

    def take_freeable(self) -> list[list[int]]:
        with self.lock:
            out, self.freeable = self.freeable, []
            return out

    @property
    def num_blocks(self) -> int:
        with self.lock:
            return sum(len(v.blocks) for v in self.leases.values()) + sum(len(b) for b in self.freeable)

    def __len__(self) -> int:
        with self.lock:
            return len(self.leases)
