"""How tensor-parallel ranks talk: all-reduce (row-parallel layers, the embedding), gather of the
vocab-sharded logits to rank 0, and rank 0's per-step plan to the others.

Two implementations with one interface:
- `ShmComm`: ranks on one host share one memory segment (csrc/cpu/collectives.cpp): a copy, a
  futex barrier and a sum, no sockets. The fast path on CPU.
- `DistComm`: torch.distributed collectives: gloo (the fallback, and the path across hosts) or
  nccl on CUDA (coded, not run here: no GPU).

Both count what they do (`counts`), so tests can prove the split ran: all-reduces per step, gathers.
Every collective has a deadline; a rank that dies or stops answering raises `CollectiveError`, which
the engine treats as unrecoverable (its ranks are out of step).
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
from collections import Counter

import torch

from inferd.errors import InferdError

HEADER = 4096
DEFAULT_SLOT_BYTES = 4 << 20  # a chunk of one collective: 512 tokens x 576 fp32 hidden is 1.2 MB
DEFAULT_TIMEOUT = float(os.environ.get("INFERD_TP_TIMEOUT", "120"))


def ready_counts(rank: int, world: int, nbytes: int) -> torch.Tensor:
    """The all-reduce every rank makes when ready, carrying its weight bytes: MiB and the rest in two
    float32 lanes (exact below 16 TiB; one float32 holds integers exactly only up to 2^24)."""
    t = torch.zeros(world, 2)
    t[rank, 0], t[rank, 1] = divmod(nbytes, 1 << 20)
    return t


def weights_of(ready: torch.Tensor) -> list[int]:
    return [(int(hi) << 20) + int(lo) for hi, lo in ready.tolist()]


class CollectiveError(RuntimeError):
    """A collective could not complete (a rank died, or timed out): the engine cannot go on."""


class Comm:
    rank: int
    world: int

    def __init__(self):
        self.counts: Counter = Counter()
        self.abort_reason: str | None = None  # what the rank that aborted saw (e.g. which rank died)

    def gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank r's x [rows, widths[r]] -> on rank 0 the concatenation [rows, sum(widths)]; else None."""
        raise NotImplementedError

    def send_obj(self, obj) -> None:  # rank 0
        raise NotImplementedError

    def recv_obj(self, alive=None):  # the other ranks; `alive()` False: stop waiting (returns None)
        raise NotImplementedError

    def all_reduce_(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class ShmComm(Comm):
    """Collectives through one shared-memory segment (layout in csrc/cpu/collectives.cpp)."""

    def __init__(self, rank: int, world: int, path: str | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        from inferd.kernels import native

        if native.ops() is None:
            raise InferdError("the shared-memory all-reduce needs inferd's C++ kernels, which did not build: "
                              "use --tensor-parallel-backend gloo")
        self.rank, self.world, self.slot, self.timeout = rank, world, slot_bytes, timeout
        size = HEADER + 2 * world * slot_bytes
        if path is None:  # rank 0 makes it; unlinked at once, the others open /proc/PID/fd/FD
            where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, p = tempfile.mkstemp(prefix="inferd-tp-", dir=where)
            os.unlink(p)
            os.ftruncate(fd, size)
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            fd = os.open(path, os.O_RDWR)
            self.path = path
        self._fd = fd
        self._map = mmap.mmap(fd, size)
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self.seq = 1
        self.ops = torch.ops.inferd

    def _slot(self, r: int, seq: int) -> torch.Tensor:
        off = HEADER + ((seq & 1) * self.world + r) * self.slot
        return self.buf[off: off + self.slot]

    def _error(self, e: RuntimeError) -> CollectiveError:
        return CollectiveError(self.abort_reason or str(e).splitlines()[0])

    def _barrier(self):
        try:
            self.ops.tp_barrier(self.buf, self.world, self.seq, self.timeout)
        except RuntimeError as e:
            raise self._error(e) from None
        self.seq += 1

    def all_reduce_(self, x: torch.Tensor) -> None:
        self.counts["all_reduce"] += 1
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise CollectiveError(f"tp all-reduce of {x.dtype}")
        try:
            self.seq = self.ops.tp_all_reduce_(x, self.buf, self.rank, self.world, self.seq, self.slot, self.timeout)
        except RuntimeError as e:
            raise self._error(e) from None

    def gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        self.counts["gather"] += 1
        rows = x.shape[0]
        x = x.float().contiguous()
        per = max(1, self.slot // (4 * max(widths)))
        out = torch.empty(rows, sum(widths), dtype=torch.float32) if self.rank == 0 else None
        starts = [sum(widths[:r]) for r in range(self.world)]
        for a in range(0, max(rows, 1), per):
            b = min(rows, a + per)
            mine = self._slot(self.rank, self.seq)[: (b - a) * widths[self.rank] * 4].view(torch.float32)
            mine.copy_(x[a:b].reshape(-1))
            seq = self.seq
            self._barrier()
            if out is not None:
                for r in range(self.world):
                    part = self._slot(r, seq)[: (b - a) * widths[r] * 4].view(torch.float32)
                    out[a:b, starts[r]: starts[r] + widths[r]] = part.view(b - a, widths[r])
        return out

    def send_obj(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = struct.pack("<q", len(data))
        payload = head + data
        for a in range(0, len(payload), self.slot):
            chunk = payload[a: a + self.slot]
            self._slot(0, self.seq)[: len(chunk)].numpy()[:] = memoryview(chunk)
            self._barrier()

    def recv_obj(self, alive=None):
        parts, need = [], None
        while need is None or sum(map(len, parts)) < need:
            seq = self.seq
            self.ops.tp_arrive(self.buf, self.world, seq)
            while True:  # long waits between steps: look up every second whether rank 0 is still there
                r = self.ops.tp_wait(self.buf, self.world, seq, 1.0)
                if r == 0:
                    break
                if r == 2:
                    raise CollectiveError(self.abort_reason or "tensor-parallel collective aborted: a rank stopped")
                if alive is not None and not alive():
                    return None
            self.seq += 1
            slot = self._slot(0, seq).numpy()
            if need is None:
                need = struct.unpack("<q", slot[:8].tobytes())[0] + 8
            take = min(self.slot, need - sum(map(len, parts)))
            parts.append(slot[:take].tobytes())
        return pickle.loads(b"".join(parts)[8:])

    def abort(self) -> None:
        self.ops.tp_abort(self.buf)

    def close(self) -> None:
        self.buf = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        os.close(self._fd)


def short_error(e: BaseException) -> str:
    """gloo's one-line message without its source location and advice: 'Read error [10.0.0.2]:2178:
    Connection reset by peer' names the peer that went away."""
    import re

    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line.split(". This is typically caused")[0]


class DistComm(Comm):
    """torch.distributed collectives on a process group of our own (gloo on CPU, nccl on CUDA): no
    global default group, so one process may hold more than one engine."""

    def __init__(self, pg, rank: int, world: int, device: torch.device):
        super().__init__()
        self.pg, self.rank, self.world, self.device = pg, rank, world, device

    def _run(self, what: str, work_fn):
        try:
            work_fn().wait()
        except RuntimeError as e:
            raise CollectiveError(self.abort_reason or f"tensor-parallel {what} failed: {short_error(e)}") from None

    def all_reduce_(self, x: torch.Tensor) -> None:
        self.counts["all_reduce"] += 1
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":  # sum in fp32, as ShmComm does
            y = x.float()
            self._run("all-reduce", lambda: self.pg.allreduce([y]))
            x.copy_(y)
        else:
            self._run("all-reduce", lambda: self.pg.allreduce([x]))

    def gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        import torch.distributed as dist

        self.counts["gather"] += 1
        rows, w = x.shape[0], max(widths)
        pad = torch.zeros(rows, w, dtype=torch.float32, device=x.device)
        pad[:, : x.shape[1]] = x
        bufs = [torch.empty_like(pad) for _ in range(self.world)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._run("gather", lambda: self.pg.gather([bufs] if self.rank == 0 else [], [pad], opts))
        if self.rank != 0:
            return None
        return torch.cat([b[:, :widths[r]] for r, b in enumerate(bufs)], dim=1)

    def send_obj(self, obj) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        self._run("broadcast", lambda: self.pg.broadcast(n.to(self.device), 0))
        self._run("broadcast", lambda: self.pg.broadcast(data.to(self.device), 0))

    def recv_obj(self, alive=None):
        from datetime import timedelta

        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:  # between steps a worker may wait as long as the server idles
            self.pg.broadcast(n, 0, timedelta(days=365)).wait()
        except RuntimeError as e:
            if alive is not None and not alive():
                return None
            raise CollectiveError(f"tensor-parallel broadcast failed: {short_error(e)}") from None
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self._run("broadcast", lambda: self.pg.broadcast(data, 0))
        return pickle.loads(data.cpu().numpy().tobytes())

    def abort(self) -> None:
        try:  # a collective blocked on a dead peer returns with an error
            self.pg.abort()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - already broken by a dead peer
            pass


def process_group(backend: str, store, rank: int, world: int, timeout: float, interface: str | None,
                  hostname: str | None = None):
    """A gloo (CPU) or nccl (CUDA) process group over `store`, not registered as torch's default;
    gloo binds `interface` by name, or the one that holds `hostname` (an address)."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout)
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface
                         else dist.ProcessGroupGloo.create_device(hostname=hostname) if hostname
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    if backend == "nccl":  # coded to the API, never run here (no GPU)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise InferdError(f"unknown tensor-parallel backend {backend!r}")


BACKENDS = ("auto", "shm", "gloo", "nccl")


def resolve_backend(backend: str, device: str, nodes: int = 1) -> str:
    """The backend for `backend` (a flag's value) with ranks on `nodes` machines."""
    if backend not in BACKENDS:
        raise InferdError(f"unknown tensor-parallel backend {backend!r} (choose {', '.join(BACKENDS)})")
    if nodes > 1 and backend == "shm":
        raise InferdError(f"the shared-memory all-reduce needs every rank on one node, and the ranks were placed on "
                          f"{nodes}: use --tensor-parallel-backend gloo (or auto)")
    if device.startswith("cuda"):
        if backend not in ("auto", "nccl"):
            raise InferdError("on CUDA tensor parallelism runs over nccl")
        return "nccl"
    if backend == "nccl":
        raise InferdError("nccl is for CUDA: on CPU use --tensor-parallel-backend shm or gloo")
    if backend == "auto":
        from inferd.kernels import native

        return "shm" if native.ops() is not None and nodes == 1 else "gloo"
    return backend


def torchrun_backend(backend: str, device: str) -> str:
    """The backend of ranks torchrun started (possibly on several hosts): gloo or nccl, never shm."""
    if device.startswith("cuda"):
        return resolve_backend(backend, device)
    if backend == "shm":
        raise InferdError("the shared-memory all-reduce is for ranks inferd starts on one host: under torchrun "
                          "use --tensor-parallel-backend gloo (or auto)")
    return resolve_backend("gloo" if backend == "auto" else backend, device)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when torchrun started this process (its env:// variables), else None."""
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return None


def tcp_store(ip: str, world: int, timeout: float = DEFAULT_TIMEOUT):
    """Rank 0's rendezvous store for ranks on other nodes, a TCP store on `ip` at a free port, and
    its URL (tcp://ip:port) for the other ranks."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(ip, 0, world, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return store, f"tcp://{ip}:{store.port}"


def connect(backend: str, rank: int, world: int, store, shm_path: str | None, device: torch.device,
            timeout: float = DEFAULT_TIMEOUT, ip: str | None = None):
    """(process group, comm) of one rank; every rank calls it. `store`: None for torchrun's env://
    rendezvous (ranks possibly on other hosts: gloo picks the interface from GLOO_SOCKET_IFNAME or
    the hostname); a path for a file store of ranks inferd started on this host (loopback); a
    tcp://ip:port URL (or rank 0's own store) for ranks an executor placed on several nodes, each
    binding gloo to its node's `ip`."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "shm":  # the segment is the rendezvous: nothing to wait for before loading
        return None, ShmComm(rank, world, shm_path, timeout=timeout)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout)))
    elif isinstance(store, str) and store.startswith("tcp://"):
        host, port = store[len("tcp://"):].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout))
    elif isinstance(store, str):
        store, interface = dist.FileStore(store, world), interface or "lo"
    pg = process_group(backend, store, rank, world, timeout, interface, None if interface else ip)
    return pg, DistComm(pg, rank, world, device)
