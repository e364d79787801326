"""Private temporary directories for what one process's helpers share on this host: the engine
core's two unix sockets (inferd-core-PID-...) and a tensor-parallel group's rendezvous file
(inferd-tp-PID-...).

Each directory is made by mkdtemp (mode 0700: no other user can reach the sockets inside) under
tempfile.gettempdir(), so TMPDIR steers it, and carries its owner's pid in its name. The owner
removes it at every exit it lives through: the helper's own shutdown, a failed start, the
interpreter's exit (atexit) and the server's fault exit (`remove_all` before os._exit). What a
killed owner leaves (SIGKILL, an OOM kill) the next start on this machine sweeps, once the pid in
its name belongs to no running process.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile
import threading

log = logging.getLogger("inferd")

KINDS = ("core", "tp")
# inferd-core-PID-XXXX (this module's directories) and inferd-core-PID-HEX-in/-out (the sockets
# versions before it bound straight in the temporary directory)
_NAME = re.compile(r"^inferd-(core|tp)-(\d+)-")

_lock = threading.Lock()
_mine: set[str] = set()
_swept = False


def make(kind: str) -> str:
    """A new private directory of this process; the first one also sweeps what dead processes left."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    global _swept
    with _lock:
        if not _swept:
            _swept = True
            sweep()
        path = tempfile.mkdtemp(prefix=f"inferd-{kind}-{os.getpid()}-")
        _mine.add(path)
    return path


def remove(path: str | None):
    """Remove one of this process's directories (and whatever is left in it); twice is harmless."""
    if not path:
        return
    with _lock:
        _mine.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def remove_all():
    """Every directory this process still holds: at its exit, however it leaves."""
    with _lock:
        paths = list(_mine)
        _mine.clear()
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


atexit.register(remove_all)


def owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep(where: str | None = None) -> list[str]:
    """Remove the directories (and the older loose socket files) under `where` (the temporary
    directory) whose owner no longer runs. Only this user's entries are looked at, never this
    process's own; returns the names removed."""
    where = where or tempfile.gettempdir()
    try:
        names = os.listdir(where)
    except OSError:
        return []
    removed, uid = [], os.getuid()
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(2)) == os.getpid() or owner_alive(int(m.group(2))):
            continue
        path = os.path.join(where, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid:
            continue
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            elif stat.S_ISSOCK(st.st_mode):
                os.unlink(path)
            else:
                continue
        except OSError:
            continue
        removed.append(name)
    if removed:
        pids = sorted({int(_NAME.match(n).group(2)) for n in removed})
        log.info("removed %d temporary socket/rendezvous entr%s left in %s by exited processes (pids %s)",
                 len(removed), "y" if len(removed) == 1 else "ies", where, ", ".join(map(str, pids)))
    return removed
