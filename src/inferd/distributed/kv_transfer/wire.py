"""What crosses between a KV producer and a consumer: kv_transfer_params (through the router, as
JSON), the KV server's requests and replies (JSON headers and raw tensor bytes, never pickle: a
network peer must not be able to run code here), and the checks each side makes of the other.

KV is addressed by token, not by block: a producer's blocks are read at the token slots
[start, end) of the leased prompt, so producer and consumer may use different block sizes, and a
consumer that already holds a prefix of the prompt in its own cache pulls only the rest.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from inferd.errors import InferdError

LAYOUT = "layer,token,kv_head,head_dim"  # of both the K and the V tensor of a reply
PROTOCOL = 1


def prompt_digest(ids: list[int]) -> str:
    """A consumer admits KV only for the very prompt the producer computed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(ids).to_bytes(4, "little"))
    for t in ids:
        h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


def token_slots(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Pool slots of token positions start..end-1 of a sequence with this block table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one token in every layer: layers x 2 x KV heads x head dim x dtype size."""
    return num_layers * 2 * num_kv_heads * head_dim * element_size


@dataclass
class RemoteKV:
    """A consumer's view of one producer lease, from validated kv_transfer_params."""
    engine_id: str
    host: str
    port: int
    request_id: str  # the lease's id on the producer
    block_ids: list[int]
    block_size: int
    num_tokens: int  # prompt tokens whose KV the lease holds
    shm: dict | None  # {"path", "size"}: the producer's pool mapping, with the shared-memory connector


def _need(d: dict, key: str, kind, what: str):
    v = d.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise InferdError(f"kv_transfer_params: {key} must be {what}")
    return v


def check_remote(params: dict, prompt_ids: list[int], local_fp: dict) -> RemoteKV:
    """kv_transfer_params of a request to a consumer -> RemoteKV, or a 400 naming what is wrong:
    blocks that cannot hold the prompt, a prompt other than the one computed, an incompatible model."""
    fp = params.get("remote_fingerprint")
    if not isinstance(fp, dict):
        raise InferdError("kv_transfer_params: remote_fingerprint is missing (they must come from a producer's answer)")
    for key in sorted(set(local_fp) | set(fp)):
        if fp.get(key) != local_fp.get(key):
            raise InferdError(f"kv_transfer_params come from an incompatible producer: {key} is "
                              f"{fp.get(key)!r} there, {local_fp.get(key)!r} here")
    eid = _need(params, "remote_engine_id", str, "a string")
    host = _need(params, "remote_host", str, "a host name or address")
    port = _need(params, "remote_port", int, "a port number")
    rid = _need(params, "remote_request_id", str, "a string")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                               for b in blocks):
        raise InferdError("kv_transfer_params: remote_block_ids must be a list of block numbers")
    bs = _need(params, "remote_block_size", int, "a positive integer")
    n = _need(params, "remote_num_tokens", int, "a positive integer")
    nblocks = _need(params, "remote_num_blocks", int, "a positive integer")
    if not 0 < port <= 65535 or bs < 1 or n < 1:
        raise InferdError("kv_transfer_params: remote_port, remote_block_size and remote_num_tokens are out of range")
    if any(b >= nblocks for b in blocks):
        raise InferdError(f"kv_transfer_params: remote_block_ids name blocks the producer does not have "
                          f"(it has {nblocks})")
    if len(blocks) != -(-n // bs):
        raise InferdError(f"kv_transfer_params: {len(blocks)} blocks of {bs} cannot hold exactly {n} tokens")
    if n != len(prompt_ids):
        raise InferdError(f"kv_transfer_params: the producer computed {n} prompt tokens, this prompt has "
                          f"{len(prompt_ids)}")
    if params.get("remote_prompt_digest") != prompt_digest(prompt_ids):
        raise InferdError("kv_transfer_params: the producer computed a different prompt")
    shm = params.get("remote_shm")
    if shm is not None and not (isinstance(shm, dict) and isinstance(shm.get("path"), str)
                                and shm["path"].startswith("/proc/") and isinstance(shm.get("size"), int)
                                and isinstance(shm.get("inode"), int)):
        raise InferdError("kv_transfer_params: remote_shm must be {path: /proc/PID/fd/N, size, inode}")
    return RemoteKV(eid, host, port, rid, list(blocks), bs, n, shm)


def check_reply_header(hdr: dict, dtype: str, shape: list[int], frames: list[int]) -> None:
    """A KV reply's header against what this consumer expects; a mismatch is a failed transfer."""
    if hdr.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {hdr.get('protocol')!r}, expected {PROTOCOL}")
    if hdr.get("dtype") != dtype:
        raise ValueError(f"dtype {hdr.get('dtype')!r}, expected {dtype}")
    if hdr.get("layout") != LAYOUT:
        raise ValueError(f"layout {hdr.get('layout')!r}, expected {LAYOUT}")
    if hdr.get("shape") != shape:
        raise ValueError(f"shape {hdr.get('shape')!r}, expected {shape}")
    want = hdr.get("nbytes")
    if not isinstance(want, int) or any(f != want for f in frames):
        raise ValueError(f"frames of {frames} bytes, header says {want}")
