"""Disaggregated prefill and decode (KV hand-over between engines): config (the vLLM-shaped
--kv-transfer-config), wire (what travels), leases (the producer's held blocks), connectors (ZeroMQ,
shared memory) and transfer (KVTransfer, an engine's side of it).

The config parser is importable without torch (the API process validates the flag before it
starts an engine); KVTransfer loads with the engine."""
from inferd.distributed.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config  # noqa: F401


def __getattr__(name):
    if name == "KVTransfer":
        from inferd.distributed.kv_transfer.transfer import KVTransfer

        return KVTransfer
    raise AttributeError(name)
