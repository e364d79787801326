"""Where the Ray executor's cluster is, found without importing Ray: the server checks RAY_ADDRESS
with it before it starts an engine, and `ray_executor.join_cluster` decides with it whether the
cluster a `ray_current_cluster` file names is still there.

Ray's own client, handed an address where nothing listens (or a port that is not a GCS), retries
for about two minutes without a word; a connect and the first bytes of gRPC's handshake answer the
same question in a few seconds.
"""
from __future__ import annotations

import os
import socket

from inferd.errors import InferdError

# how long a cluster gets to answer before inferd calls it gone
PROBE_TIMEOUT = 3.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9)  # an empty SETTINGS frame after it
_SETTINGS = 4


def current_cluster_file() -> str:
    """Where `ray start` records the cluster it started or joined on this machine (and where
    `ray.init(address="auto")` looks): `ray_current_cluster` in Ray's temp dir, which is `ray` under
    RAY_TMPDIR, else TMPDIR, else /tmp."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(base, "ray", "ray_current_cluster")


def _host_port(address: str) -> tuple[str, int]:
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise InferdError(f"the Ray address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when a gRPC server (Ray's GCS) answers at `address` within `timeout`, else why not.
    A plain TCP connect tells a dead address at once; the HTTP/2 preface tells a live port that is
    not a GCS (the dashboard's 8265, say), on which Ray would retry as long as on a dead one."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None  # a TLS GCS would want a handshake first: the connect is all we check
            s.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = s.recv(9 - len(head))
                if not chunk:
                    return "it closed the connection: not a Ray GCS port"
                head += chunk
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e)
    if head[3] != _SETTINGS:
        return "it answered, but not as gRPC: not a Ray GCS port"
    return None


def check_address() -> None:
    """An InferdError, in seconds, when RAY_ADDRESS names a cluster that does not answer."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address and address not in ("auto", "local"):
        why = probe(address)
        if why:
            raise InferdError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {why}")
