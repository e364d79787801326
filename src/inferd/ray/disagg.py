"""Disaggregated prefill/decode on Ray Serve: a prefill deployment and a decode deployment behind
the one ingress, the KV handed over by the existing network connector (ZmqConnector).

Each prefill replica is a KV producer listening on its own node's address (which Ray tells it:
`kv_ip` left out of the config is filled from the node the replica landed on); each decode
replica runs `role: decode`. Per request the ingress's client does what `inferd router` does over
HTTP (inferd.router.disagg), at the engine-client level: a one-token request to a prefill replica
marked `do_remote_decode`, whose final output names the KV lease, then the request itself to a
decode replica with those kv_transfer_params; the decode replica pulls the prompt's KV and
computes only the last prompt position. A prefill that fails or answers without a lease falls
back to the decode replica computing the prompt itself (counted).
"""
from __future__ import annotations

import logging
from dataclasses import replace

from inferd.errors import InferdError

log = logging.getLogger("inferd")

PRODUCER = {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}


def prefill_options(a: dict) -> tuple[dict, dict]:
    """(the decode deployment's options, the prefill deployment's) from the app's args: `prefill`
    holds the prefill deployment's own keys over the app's (engine options merged)."""
    p = dict(a["prefill"])
    unknown = sorted(set(p) - {"engine", "num_replicas", "autoscaling_config", "ray_actor_options",
                               "max_ongoing_requests", "routing"})
    if unknown:
        raise InferdError(f"prefill: unknown option {unknown[0]!r}")
    pre = {**a, **p, "prefill": None}
    pre["engine"] = {**a["engine"], **p.get("engine", {})}
    pre["engine"]["kv_transfer_config"] = {**PRODUCER, **(pre["engine"].get("kv_transfer_config") or {})}
    dec = {**a, "engine": {**a["engine"], "role": "decode"}}
    return dec, pre


def producer_on_this_node(options: dict, node_ip: str) -> dict:
    """A prefill replica's engine options with its KV server on this node's address."""
    kv = options.get("kv_transfer_config")
    if not isinstance(kv, dict) or kv.get("kv_role") != "kv_producer" or kv.get("kv_ip"):
        return options
    return {**options, "kv_transfer_config": {**kv, "kv_ip": node_ip}}


class DisaggregatedClient:
    """An engine client over a prefill client and a decode client (both RayEngineClient)."""

    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.info = decode.info
        self.dead = None
        self.max_waiting = decode.max_waiting
        self.paths = {"disagg": 0, "fallback": 0, "ineligible": 0}

    @property
    def failures(self) -> int:
        return self.prefill.failures + self.decode.failures

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def num_running(self) -> int:
        return self.decode.num_running

    def open_requests(self) -> int:
        return self.decode.open_requests() + self.prefill.open_requests()

    async def _lease(self, prompt_ids, params, request_id):
        one = replace(params, max_tokens=1, min_tokens=0, n=1, logprobs=None, stop=[], stop_token_ids=[],
                      ignore_eos=True)
        try:
            kvp = None
            async for out in self.prefill.generate(prompt_ids, one, f"{request_id}-prefill",
                                                   kv_transfer_params={"do_remote_decode": True,
                                                                       "do_remote_prefill": False}):
                kvp = out.kv_transfer_params or kvp
            return kvp if isinstance(kvp, dict) and kvp.get("do_remote_prefill") else None
        except Exception as e:  # noqa: BLE001 - the decode side computes the prompt instead
            log.warning("request %s: prefill failed (%s); decoding computes the prompt", request_id, e)
            return None

    async def generate(self, prompt_ids, params, request_id, arrival=None, kv_transfer_params=None, lora=None):
        kvp = kv_transfer_params
        if kvp is None and params.n == 1 and not params.prompt_logprobs:
            kvp = await self._lease(prompt_ids, params, request_id)
            self.paths["disagg" if kvp else "fallback"] += 1
        else:
            self.paths["ineligible"] += 1
        async for out in self.decode.generate(prompt_ids, params, request_id, kv_transfer_params=kvp, lora=lora):
            yield out

    def abort(self, request_id: str) -> None:
        pass

    async def control(self, op: str, **args):
        return await self.decode.control(op, **args)

    async def state(self, steps: int = 100) -> list[dict]:
        return [*(await self.prefill.state(steps)), *(await self.decode.state(steps))]

    def shutdown(self) -> None:
        pass
