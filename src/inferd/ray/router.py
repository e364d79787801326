"""The request router of the engine deployment: `inferd router`'s prefix policy
(inferd.distributed.policy.Balancer over token ids, one chunk a KV block) choosing among the
replicas Serve reports, so requests that share a prompt prefix go where its KV blocks already are,
unless loads are too uneven. Serve calls `choose_replicas` for each request with the live
replicas; the chosen one is offered first, then the others by load (a full replica refuses and
Serve moves on)."""
from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from inferd.distributed.policy import Balancer

CHUNK = 16  # tokens: the engine's KV block


class PrefixRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, chunk: int = CHUNK, **_):
        self.balancer = Balancer([], policy="prefix", chunk=chunk)
        self.picks: dict[str, int] = {}  # reason -> requests (prefix, new, balance)
        # requests this router has in flight on each replica: what the policy balances on (Serve's
        # queue-length cache is filled only by probes, which a router that ranks replicas itself
        # may never trigger, and a cache of zeros would pile every shared prefix onto one replica)
        self.open: dict[str, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {k: self.open.get(k, 0) for k in by_id}
        self.balancer.add_targets(list(by_id))
        ids = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(ids, list):  # not a generate call (state, info): the least loaded
            return [sorted(candidate_replicas, key=lambda r: loads[r.replica_id.unique_id])]
        pick = self.balancer.pick(ids, loads, live=list(by_id))
        self.picks[pick.reason] = self.picks.get(pick.reason, 0) + 1
        rest = sorted((r for k, r in by_id.items() if k != pick.target), key=lambda r: loads[r.replica_id.unique_id])
        return [[by_id[pick.target]], rest] if rest else [[by_id[pick.target]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self.open[replica_id.unique_id] = self.open.get(replica_id.unique_id, 0) + 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        k = replica_id.unique_id
        self.open[k] = max(0, self.open.get(k, 0) - 1)
