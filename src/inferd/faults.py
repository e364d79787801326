"""Test-only fault injection: make the Nth forward pass, sampling or detokenizing call raise.

Set INFERD_INJECT_FAULT to a comma-separated list of `point@n` (the n-th call at that point raises,
counting from 1) or `point@n+` (every call from the n-th on). Points: forward, sample, detokenize, kv_fetch (a
producer's KV server: that fetch gets no reply).
The variable is read once, when an engine is built, so the engine process of `inferd serve` sees
what its server was started with. Unset (always, outside tests) it costs one dict lookup per call.
"""
from __future__ import annotations

import os

POINTS = ("forward", "sample", "detokenize", "kv_fetch")


class InjectedFault(RuntimeError):
    pass


def parse(spec: str) -> dict[str, tuple[int, bool]]:
    """'forward@3,sample@2+' -> {'forward': (3, False), 'sample': (2, True)}"""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, _, n = part.partition("@")
        if point not in POINTS or not n.rstrip("+").isdigit():
            raise ValueError(f"INFERD_INJECT_FAULT: {part!r} is not point@n or point@n+ with point in {POINTS}")
        out[point] = (int(n.rstrip("+")), n.endswith("+"))
    return out


class Faults:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get("INFERD_INJECT_FAULT", "") if spec is None else spec
        self.plan = parse(spec)
        self.calls = dict.fromkeys(self.plan, 0)

    def hit(self, point: str):
        plan = self.plan.get(point)
        if plan is None:
            return
        self.calls[point] += 1
        n, onward = plan
        if self.calls[point] == n or (onward and self.calls[point] > n):
            raise InjectedFault(f"injected fault at {point} call {self.calls[point]}")
