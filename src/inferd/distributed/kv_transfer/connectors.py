"""The KV connectors: how a consumer gets a producer's leased KV into its own pool.

One small interface, `pull(remote, start, end) -> (k, v)` ([layers, tokens, kv heads, head dim]
each) and `confirm(remote) -> bool`, over one control channel: a ZeroMQ DEALER socket talking to
the producer's KV server (a ROUTER socket on kv_ip:kv_port, a thread of the producer's engine
process). ZeroMQ rather than torch.distributed point-to-point: producers and consumers come and go
independently (a process group wants every rank up front and dies with any of them), and a ZeroMQ
request can time out, which a blocking recv cannot.

- ZmqConnector (any host): the KV server copies the tokens' K and V out of the leased blocks and
  sends them as two raw frames behind a JSON header (dtype, shape, layout, bytes: checked on arrival).
- SharedMemoryConnector (same host): the producer's whole pool lives in a shared-memory file; the
  consumer maps it read-only and copies the tokens straight out of it. Only the confirmation goes
  over the socket, and it is what makes the copy safe: the producer frees leased blocks only on
  confirmation or expiry, so a confirmation that finds its lease still held proves no block was
  reused while the consumer read it (an expired lease makes the copy void: the consumer recomputes).
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import warnings

import torch

from inferd.distributed.kv_transfer.wire import LAYOUT, PROTOCOL, RemoteKV, check_reply_header, token_slots
from inferd.faults import InjectedFault

log = logging.getLogger("inferd")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _raw(t: torch.Tensor):
    """A contiguous tensor's bytes, without a copy (bf16 has no numpy dtype: viewed as bytes)."""
    return t.contiguous().view(torch.uint8).numpy()


def _tensor(buf, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffers: only ever copied from
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class TransferError(Exception):
    """A transfer that cannot complete: the consumer recomputes the prompt."""


# -- the producer's side -------------------------------------------------------------------------

class KVServer:
    """The producer's KV server thread: answers `fetch` (the tokens of a lease, as raw frames),
    `confirm` (the consumer has them: free the lease) and `info` (the model fingerprint)."""

    def __init__(self, pool, leases, block_size: int, ip: str, port: int, info: dict, faults=None):
        import zmq

        self.pool, self.leases, self.block_size, self.info = pool, leases, block_size, info
        self.faults = faults
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{ip}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{ip}")
        self.port = port
        self.bytes_sent = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="inferd-kv-server", daemon=True)
        self.thread.start()

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()

    def _run(self):
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            try:
                if not poller.poll(200):
                    continue
                frames = self.sock.recv_multipart()
            except zmq.ZMQError:
                return
            ident, body = frames[0], frames[-1]
            try:
                msg = json.loads(body)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
                reply = self._answer(msg)
            except InjectedFault:
                continue
            except Exception as e:  # noqa: BLE001 - a bad request gets an error reply, the server goes on
                reply = [json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode()]
            try:
                self.sock.send_multipart([ident, *reply], copy=False)
            except zmq.ZMQError:
                pass

    def _answer(self, msg: dict) -> list:
        op, seq = msg.get("op"), msg.get("seq")
        if op == "info":
            return [json.dumps({"ok": True, "seq": seq, **self.info}).encode()]
        lid = msg.get("lease")
        if not isinstance(lid, str):
            raise ValueError("lease must be a string")
        if op == "confirm":
            return [json.dumps({"ok": self.leases.confirm(lid), "seq": seq}).encode()]
        if op != "fetch":
            raise ValueError(f"unknown op {op!r}")
        if self.faults is not None:
            self.faults.hit("kv_fetch")  # InjectedFault: this fetch gets no reply at all (a lost transfer)
        start, end = msg.get("start"), msg.get("end")
        with self.leases.lock:  # the blocks cannot be freed (and reused) while they are copied
            lease = self.leases.leases.get(lid)
            if lease is None:
                return [json.dumps({"ok": False, "seq": seq, "error": "no such lease (expired or confirmed)"}).encode()]
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= lease.num_tokens):
                raise ValueError(f"token range [{start}, {end}) is outside the lease's {lease.num_tokens} tokens")
            slots = torch.tensor(token_slots(lease.blocks, self.block_size, start, end))
            k = self.pool.k.index_select(1, slots)
            v = self.pool.v.index_select(1, slots)
        kb, vb = _raw(k), _raw(v)
        self.bytes_sent += kb.nbytes + vb.nbytes
        hdr = {"ok": True, "seq": seq, "protocol": PROTOCOL, "dtype": dtype_name(k.dtype), "shape": list(k.shape),
               "layout": LAYOUT, "nbytes": int(kb.nbytes)}
        return [json.dumps(hdr).encode(), kb, vb]


# -- the consumer's side -------------------------------------------------------------------------

class _Control:
    """One DEALER socket per producer, used by one thread. A request that times out closes its
    socket, so that a late reply can never be read as the answer to the next request."""

    def __init__(self, timeout_s: float):
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.timeout_ms = int(timeout_s * 1000)
        self.socks: dict[tuple[str, int], object] = {}
        self.seq = 0

    def _sock(self, host: str, port: int):
        key = (host, port)
        s = self.socks.get(key)
        if s is None:
            s = self.ctx.socket(self.zmq.DEALER)
            s.setsockopt(self.zmq.LINGER, 0)
            s.connect(f"tcp://{host}:{port}")
            self.socks[key] = s
        return s

    def request(self, remote: RemoteKV, msg: dict, deadline_ms: int | None = None) -> list:
        zmq = self.zmq
        self.seq += 1
        msg = {**msg, "seq": self.seq}
        s = self._sock(remote.host, remote.port)
        s.send(json.dumps(msg).encode())
        wait = self.timeout_ms if deadline_ms is None else max(1, deadline_ms)
        while True:
            if not s.poll(wait, zmq.POLLIN):
                s.close(0)
                del self.socks[(remote.host, remote.port)]
                raise TransferError(f"no answer from the producer at {remote.host}:{remote.port} "
                                    f"within {wait / 1000:.1f} s")
            frames = s.recv_multipart(copy=False)
            try:
                hdr = json.loads(frames[0].bytes)
            except ValueError:
                raise TransferError("the producer sent a reply that is not JSON") from None
            if hdr.get("seq") == self.seq:
                return [hdr] + [f.buffer for f in frames[1:]]
            wait = 1  # an old request's late reply: skip it

    def close(self):
        for s in self.socks.values():
            s.close(0)
        self.ctx.term()


class ZmqConnector:
    name = "ZmqConnector"

    def __init__(self, control: _Control, dtype: torch.dtype, layers: int, n_kv: int, head_dim: int):
        self.control, self.dtype = control, dtype
        self.dims = (layers, n_kv, head_dim)

    def pull(self, remote: RemoteKV, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        hdr, *frames = self.control.request(remote, {"op": "fetch", "lease": remote.request_id,
                                                     "start": start, "end": end})
        if not hdr.get("ok"):
            raise TransferError(f"the producer refused the fetch: {hdr.get('error')}")
        L, H, D = self.dims
        shape = [L, end - start, H, D]
        if len(frames) != 2:
            raise TransferError(f"a KV reply has {len(frames)} data frames, expected 2")
        try:
            check_reply_header(hdr, dtype_name(self.dtype), shape, [f.nbytes for f in frames])
        except ValueError as e:
            raise TransferError(f"KV arrived in the wrong form: {e}") from None
        return _tensor(frames[0], self.dtype, shape), _tensor(frames[1], self.dtype, shape)

    def confirm(self, remote: RemoteKV) -> bool:
        hdr = self.control.request(remote, {"op": "confirm", "lease": remote.request_id})[0]
        return bool(hdr.get("ok"))


class SharedMemoryConnector(ZmqConnector):
    name = "SharedMemoryConnector"

    def __init__(self, control: _Control, dtype, layers, n_kv, head_dim):
        super().__init__(control, dtype, layers, n_kv, head_dim)
        # (path, size, inode) of a producer's pool -> (mmap, k, v). Not keyed by engine id: a
        # producer restarted under the same id has a new pool, and the old mapping would keep the
        # dead one's memory readable
        self.maps: dict[tuple, tuple] = {}

    def _map(self, remote: RemoteKV):
        if remote.shm is None:
            raise TransferError("the producer does not share its KV pool (its connector is not SharedMemoryConnector)")
        path, size, inode = remote.shm["path"], remote.shm["size"], remote.shm.get("inode")
        key = (path, size, inode)
        got = self.maps.get(key)
        if got is not None:
            return got[1], got[2]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise TransferError(f"cannot open the producer's shared KV pool {path}: {e.strerror} "
                                f"(another host? use ZmqConnector)") from None
        try:
            st = os.fstat(fd)
            if st.st_size != size or st.st_ino != inode:
                raise TransferError(f"{path} is not the producer's shared KV pool any more (it restarted?)")
            m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: nothing here can write the producer's
        finally:
            os.close(fd)
        L, H, D = self.dims
        esize = torch.empty((), dtype=self.dtype).element_size()
        per_half = size // 2 // esize
        slots = per_half // (L * H * D)
        if slots * L * H * D * esize * 2 != size:
            raise TransferError("the shared KV pool's size does not fit this model's KV layout")
        flat = torch.frombuffer(m, dtype=self.dtype, count=2 * per_half)
        k = flat[:per_half].view(L, slots, H, D)
        v = flat[per_half:].view(L, slots, H, D)
        if len(self.maps) >= 8:  # producers come and go: keep the newest few mappings
            self.maps.pop(next(iter(self.maps)))
        self.maps[key] = (m, k, v)
        return k, v

    def pull(self, remote: RemoteKV, start: int, end: int):
        k, v = self._map(remote)
        slots = torch.tensor(token_slots(remote.block_ids, remote.block_size, start, end))
        if int(slots.max()) >= k.shape[1]:
            raise TransferError("the lease's blocks lie outside the producer's shared pool")
        return k.index_select(1, slots), v.index_select(1, slots)


def make_connector(name: str, timeout_s: float, dtype, layers: int, n_kv: int, row: int):
    """`row`: the pool's last axis, head_dim (or head_dim + 2 a group of 32 for an int8 cache: codes and fp16 scales)."""
    cls = SharedMemoryConnector if name == "SharedMemoryConnector" else ZmqConnector
    return cls(_Control(timeout_s), dtype, layers, n_kv, row)
