"""A small HTTP/1.1 client on asyncio protocols, for streaming many SSE responses at once.

Why not httpx or aiohttp: the cost per received chunk decides how many concurrent streams a client
can time honestly on a small machine. Here a chunk costs one read: the bytes are de-chunked and split
into SSE events, each kept as raw bytes with its arrival time; JSON is parsed only after the run.
Connections are kept alive and reused.

Arrival times: on Linux over plain HTTP each read returns the kernel's receive timestamp of its
bytes (SO_TIMESTAMPNS), converted to the `time.perf_counter_ns` clock, so that a busy client (256
streams whose chunks land at once) does not stamp the last chunks of a burst late by however long it
took to get to them; how late the client actually read is kept too (`rx_delay`). Elsewhere (https,
other systems) the time is taken when the read returns.
"""
from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
import struct
import sys
from time import perf_counter_ns, time_ns
from urllib.parse import urlsplit

from inferd.errors import InferdError

SO_TIMESTAMPNS = 35  # Linux (x86-64, arm64): the cmsg type SCM_TIMESTAMPNS has the same value
_ANC = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 64


class Response:
    """One response as it arrives: status, headers, SSE events (t_ns, payload bytes) or body bytes."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.done = loop.create_future()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.http10 = False
        self.events: list[tuple[int, bytes]] = []
        self.body: list[bytes] = []
        self.first_byte_ns: int | None = None
        self.rx_delay_max = 0  # ns between the kernel's receive time and the client's read
        self.end_ns: int | None = None
        self.error: str | None = None  # set when the connection broke before the response ended
        self.sse = False
        self.sse_done = False
        self._head = b""
        self._mode = ""  # chunked | length | close
        self._left = 0
        self._cstate = "size"  # size | data | crlf | trailer
        self._cbuf = b""
        self._sbuf = b""

    # -- parsing ---------------------------------------------------------------------------------
    def feed(self, t: int, data: bytes) -> None:
        if self.done.done():
            return
        if self.first_byte_ns is None:
            self.first_byte_ns = t
        if self.status is None:
            self._head += data
            i = self._head.find(b"\r\n\r\n")
            if i < 0:
                return
            head, data = self._head[:i].decode("latin-1"), self._head[i + 4:]
            self._head = b""
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            try:
                self.status = int(parts[1])
            except (IndexError, ValueError):
                self._fail(t, f"bad HTTP status line {lines[0][:80]!r}")
                return
            self.http10 = parts[0] == "HTTP/1.0"
            for line in lines[1:]:
                k, _, v = line.partition(":")
                self.headers[k.strip().lower()] = v.strip()
            self.sse = self.status == 200 and "text/event-stream" in self.headers.get("content-type", "")
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                self._mode = "chunked"
            elif "content-length" in self.headers:
                self._mode, self._left = "length", int(self.headers["content-length"])
                if self._left == 0:
                    self._finish(t)
                    return
            else:
                self._mode = "close"
            if not data:
                return
        if self._mode == "chunked":
            if self._cstate == "size" and not self._cbuf and not self._sbuf and self.sse:
                # fast path: the segment is exactly one chunk holding exactly one `data:` event
                j = data.find(b"\r\n")
                if 0 < j < 9:
                    try:
                        size = int(data[:j], 16)
                    except ValueError:
                        size = -1
                    end = j + 2 + size
                    if (size > 8 and len(data) == end + 2 and data.endswith(b"\n\n\r\n")
                            and data.startswith(b"data: ", j + 2) and data.find(b"\n", j + 2) == end - 2
                            and b"\r" not in data[j + 2:end]):
                        ev = data[j + 8:end - 2]
                        self.events.append((t, ev))
                        if ev == b"[DONE]":
                            self.sse_done = True
                        return
            self._dechunk(t, data)
        elif self._mode == "length":
            piece = data[: self._left]
            self._left -= len(piece)
            self._deliver(t, piece)
            if self._left <= 0:
                self._finish(t)
        else:
            self._deliver(t, data)

    def _dechunk(self, t: int, data: bytes) -> None:
        buf = self._cbuf + data if self._cbuf else data
        pos = 0
        n = len(buf)
        while pos < n:
            st = self._cstate
            if st == "size":
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    break
                try:
                    size = int(buf[pos:j].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(t, "bad chunked encoding")
                    return
                pos = j + 2
                if size == 0:
                    self._cstate = "trailer"
                else:
                    self._left, self._cstate = size, "data"
            elif st == "data":
                piece = buf[pos: pos + self._left]
                pos += len(piece)
                self._left -= len(piece)
                self._deliver(t, piece)
                if self._left == 0:
                    self._cstate = "crlf"
            elif st == "crlf":
                if n - pos < 2:
                    break
                pos += 2
                self._cstate = "size"
            else:  # trailer: "\r\n" alone, or trailer fields ending with an empty line
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                    self._finish(t)
                    break
                j = buf.find(b"\r\n\r\n", pos)
                if j < 0:
                    break
                pos = j + 4
                self._finish(t)
                break
        self._cbuf = buf[pos:] if pos < n else b""

    def _deliver(self, t: int, piece: bytes) -> None:
        if not self.sse:
            self.body.append(piece)
            return
        buf = self._sbuf + piece if self._sbuf else piece
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while True:
            j = buf.find(b"\n\n")
            if j < 0:
                break
            block, buf = buf[:j], buf[j + 2:]
            data = None
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    v = line[5:]
                    if v.startswith(b" "):
                        v = v[1:]
                    data = v if data is None else data + b"\n" + v
            if data is not None:
                self.events.append((t, data))
                if data == b"[DONE]":
                    self.sse_done = True
        self._sbuf = buf

    def _finish(self, t: int) -> None:
        if not self.done.done():
            self.end_ns = t
            self.done.set_result(True)

    def _fail(self, t: int, why: str) -> None:
        if not self.done.done():
            self.end_ns = t
            self.error = why
            self.done.set_result(False)

    def eof(self, t: int, exc) -> None:
        if self.status is not None and self._mode == "close":
            self._finish(t)
        else:
            why = "connection closed by the server" + (f" ({exc})" if exc else "")
            if self.status is None:
                why += " before a response"
            else:
                why += " mid-stream"
            self._fail(t, why)

    @property
    def reusable(self) -> bool:
        return (self.done.done() and self.error is None and not self.http10 and self._mode != "close"
                and self.headers.get("connection", "").lower() != "close")


class _Conn(asyncio.BufferedProtocol):
    """recv_into one reused buffer: a plain Protocol would allocate 256 KiB for every read."""

    def __init__(self):
        self.transport = None
        self.closed = False
        self.resp: Response | None = None
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return self._view

    def buffer_updated(self, nbytes):
        t = perf_counter_ns()
        r = self.resp
        if r is not None:
            r.feed(t, bytes(self._view[:nbytes]))

    def eof_received(self):
        return False

    def write(self, data: bytes):
        self.transport.write(data)

    def close(self):
        self.transport.close()

    def abort(self):
        self.transport.abort()

    def connection_lost(self, exc):
        self.closed = True
        r = self.resp
        if r is not None:
            r.eof(perf_counter_ns(), exc)


class _KConn:
    """A plain non-blocking socket read with recvmsg_into: arrival times from the kernel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket):
        self.loop = loop
        self.sock = sock
        self.closed = False
        self.resp: Response | None = None
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self):
        t_user = perf_counter_ns()
        offset = time_ns() - t_user  # realtime - perf, read together
        while not self.closed:
            try:
                n, anc, _, _ = self.sock.recvmsg_into([self._view], _ANC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e)
                return
            if n == 0:
                self._lost(None)
                return
            t = t_user
            for level, typ, data in anc:
                if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS and len(data) >= 16:
                    sec, nsec = struct.unpack_from("qq", data)
                    t = min(sec * 1_000_000_000 + nsec - offset, t_user)
            r = self.resp
            if r is not None:
                if t_user - t > r.rx_delay_max:
                    r.rx_delay_max = t_user - t
                r.feed(t, bytes(self._view[:n]))
            if n < len(self._buf):
                return  # drained: another recvmsg would only say EAGAIN

    def write(self, data: bytes):
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._lost(e)
            return
        if n < len(data):
            self.loop.create_task(self._send_rest(data[n:]))

    async def _send_rest(self, rest: bytes):
        try:
            await self.loop.sock_sendall(self.sock, rest)
        except OSError as e:
            self._lost(e)

    def _lost(self, exc):
        if self.closed:
            return
        self.close()
        r = self.resp
        if r is not None:
            r.eof(perf_counter_ns(), exc)

    def close(self):
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    abort = close


class Client:
    """Keep-alive connections to one base URL (http or https)."""

    def __init__(self, base_url: str, api_key: str | None = None, headers: dict[str, str] | None = None):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise InferdError(f"bad --base-url {base_url!r}: expected http://HOST[:PORT] or https://...")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = _ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        default_port = (u.scheme == "https" and self.port == 443) or (u.scheme == "http" and self.port == 80)
        hostport = self.host if default_port else f"{self.host}:{self.port}"
        if ":" in self.host:
            hostport = f"[{self.host}]" + ("" if default_port else f":{self.port}")
        extra = dict(headers or {})
        if api_key:
            extra["Authorization"] = f"Bearer {api_key}"
        self._head_fixed = (f"Host: {hostport}\r\nUser-Agent: inferd-bench\r\nContent-Type: application/json\r\n"
                            f"Accept: text/event-stream\r\n" + "".join(f"{k}: {v}\r\n" for k, v in extra.items()))
        self._idle: list = []
        self.kernel_timestamps = self.ssl is None and sys.platform.startswith("linux")
        self._addr = None

    async def _connect(self):
        loop = asyncio.get_running_loop()
        if self.kernel_timestamps:
            if self._addr is None:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                self._addr = infos[0][0], infos[0][4]
            fam, addr = self._addr
            sock = socket.socket(fam, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                await loop.sock_connect(sock, addr)
            except BaseException:
                sock.close()
                raise
            return _KConn(loop, sock)
        _, proto = await loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl,
                                                server_hostname=self.host if self.ssl else None)
        return proto

    async def preconnect(self, n: int, timeout: float | None = 30.0) -> None:
        """Open n keep-alive connections now, so that connection set-up stays out of the timed run."""
        conns = await asyncio.wait_for(asyncio.gather(*(self._connect() for _ in range(n))), timeout)
        self._idle.extend(conns)

    def head(self, path: str, body_len: int) -> bytes:
        return (f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head_fixed}Content-Length: {body_len}\r\n\r\n"
                ).encode("latin-1")

    async def post(self, path: str, body: bytes, timeout: float | None) -> tuple[int, Response | None, str | None, str | None]:
        """Send one POST; returns (send_ns, response, error_kind, error). The send time is taken
        before a connection is opened or reused, so connection set-up counts in the latency."""
        loop = asyncio.get_running_loop()
        data = self.head(path, len(body)) + body
        send_ns = perf_counter_ns()
        for attempt in (0, 1):
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                try:
                    conn = await asyncio.wait_for(self._connect(), timeout)
                except asyncio.TimeoutError:
                    return send_ns, None, "timeout", "timed out connecting"
                except OSError as e:
                    return send_ns, None, "connect", f"cannot connect to {self.host}:{self.port}: {e.strerror or e}"
            resp = Response(loop)
            conn.resp = resp
            conn.write(data)
            try:
                await asyncio.wait_for(asyncio.shield(resp.done), timeout)
            except asyncio.TimeoutError:
                conn.resp = None
                conn.abort()
                resp.end_ns = perf_counter_ns()
                return send_ns, resp, "timeout", f"no complete response within {timeout:g} s"
            conn.resp = None
            if resp.error is not None and reused and resp.first_byte_ns is None and attempt == 0:
                continue  # a kept-alive connection the server had closed: retry once on a fresh one
            if resp.reusable and not conn.closed:
                self._idle.append(conn)
            else:
                conn.close()
            if resp.error is not None:
                return send_ns, resp, "stream" if resp.status is not None else "connect", resp.error
            return send_ns, resp, None, None
        raise AssertionError("unreachable")

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
