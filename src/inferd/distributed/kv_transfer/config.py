"""--kv-transfer-config: which connector moves KV blocks between engines, and this engine's role.

The JSON keys are vLLM's (`kv_connector`, `kv_role`, `kv_ip`, `kv_port`, `engine_id`,
`kv_connector_extra_config`), so a launch script written for vLLM's disaggregated prefill reads the
same. Roles: `kv_producer` runs prompts and keeps their blocks under a lease until a consumer
has pulled them; `kv_consumer` admits requests whose prompt KV lives on a producer and pulls it;
`kv_both` can do either (vLLM's NIXL flow: the router decides per request who prefills).
`--role prefill|decode` is shorthand for {"kv_connector": "ZmqConnector", "kv_role":
"kv_producer"|"kv_consumer"}: the network connector, because it works on one host and across hosts.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from inferd.config import json_flag
from inferd.errors import InferdError

# name -> canonical; the canonical names read like vLLM's connector class names
CONNECTORS = {"SharedMemoryConnector": "SharedMemoryConnector", "shm": "SharedMemoryConnector",
              "ZmqConnector": "ZmqConnector", "zmq": "ZmqConnector", "tcp": "ZmqConnector"}
ROLES = ("kv_producer", "kv_consumer", "kv_both")
SHORTHAND = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
EXTRA_KEYS = {"lease_timeout_s", "transfer_timeout_s", "advertise_host"}
KEYS = {"kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_connector_extra_config"}


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer's KV server listens
    kv_port: int = 0  # 0: any free port (it is advertised in kv_transfer_params)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lease_timeout_s: float = 30.0  # a producer frees blocks no consumer pulled within this
    transfer_timeout_s: float = 10.0  # a consumer that waits longer for KV recomputes the prompt
    advertise_host: str | None = None  # the address consumers reach kv_ip by (default: kv_ip)

    @property
    def producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def host(self) -> str:
        return self.advertise_host or self.kv_ip


def _only(d: dict, known: set[str], where: str):
    unknown = set(d) - known
    if unknown:
        raise InferdError(f"--kv-transfer-config: unknown {where}key(s) {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(known))})")


def parse_kv_transfer_config(text: str | dict | None, role: str | None = None) -> KVTransferConfig | None:
    """The flag's JSON (or a dict), merged with --role; None when neither is given. Every bad key
    or value is one InferdError naming it."""
    if text is None and role is None:
        return None
    data: dict = json_flag(text, "--kv-transfer-config") if text is not None else {}
    _only(data, KEYS, "")
    cfg = KVTransferConfig()
    if role is not None:
        if role not in SHORTHAND:
            raise InferdError(f"--role must be one of {', '.join(SHORTHAND)}")
        want = SHORTHAND[role]
        if "kv_role" in data and data["kv_role"] != want:
            raise InferdError(f"--role {role} contradicts kv_role {data['kv_role']!r} in --kv-transfer-config")
        cfg.kv_role = want
    conn = data.get("kv_connector", cfg.kv_connector)
    if conn not in CONNECTORS:
        raise InferdError(f"--kv-transfer-config: unknown kv_connector {conn!r} "
                          f"(choose SharedMemoryConnector/shm or ZmqConnector/zmq)")
    cfg.kv_connector = CONNECTORS[conn]
    if "kv_role" in data:
        if data["kv_role"] not in ROLES:
            raise InferdError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}")
        cfg.kv_role = data["kv_role"]
    if "kv_ip" in data:
        if not isinstance(data["kv_ip"], str) or not data["kv_ip"]:
            raise InferdError("--kv-transfer-config: kv_ip must be an address string")
        cfg.kv_ip = data["kv_ip"]
    if "kv_port" in data:
        p = data["kv_port"]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= 65535:
            raise InferdError("--kv-transfer-config: kv_port must be an integer in [0, 65535]")
        cfg.kv_port = p
    if "engine_id" in data:
        if not isinstance(data["engine_id"], str) or not data["engine_id"] or len(data["engine_id"]) > 64:
            raise InferdError("--kv-transfer-config: engine_id must be a string of 1-64 characters")
        cfg.engine_id = data["engine_id"]
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise InferdError("--kv-transfer-config: kv_connector_extra_config must be an object")
    _only(extra, EXTRA_KEYS, "kv_connector_extra_config ")
    for k in ("lease_timeout_s", "transfer_timeout_s"):
        if k in extra:
            v = extra[k]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 3600:
                raise InferdError(f"--kv-transfer-config: {k} must be a number of seconds in (0, 3600]")
            setattr(cfg, k, float(v))
    if "advertise_host" in extra:
        cfg.advertise_host = str(extra["advertise_host"])
    return cfg
