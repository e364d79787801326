"""A one-line progress bar on stderr with live TTFT, TPOT and output throughput.

It must not disturb what it reports: it redraws at most every TICK_S from a task on the bench's own
event loop, and looks only at requests that finished since the last redraw, with byte-level
regexes on their raw SSE payloads (the run's real JSON parsing happens after the clock stops).
The live numbers are therefore approximate (e.g. a content chunk is recognized by a non-empty
"text"/"content" string); the report's numbers are the exact ones.
"""
from __future__ import annotations

import re
import sys
import time

TICK_S = 0.25
_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def want_progress(flag: bool | None, stream=None) -> bool:
    """--progress forces it on, --no-progress off; by default only when stderr is a terminal."""
    if flag is not None:
        return flag
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    def __init__(self, total: int, stream=None, label: str = "inferd bench", width: int = 24):
        self.total = total
        self.stream = stream or sys.stderr
        self.label = label
        self.width = width
        self.done = self.failed = 0
        self.ttft_sum = self.ttft_n = 0.0
        self.tpot_sum = self.tpot_n = 0.0
        self.tokens = 0
        self.t0_ns: int | None = None
        self.finished: list[int] = []  # indices appended by the runner as requests end
        self._seen = 0
        self._last_draw = 0.0

    def start(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    def _absorb(self, item) -> None:
        _, _, _, send, _, resp, kind, _, _ = item
        self.done += 1
        if resp is None or kind is not None or resp.status != 200:
            self.failed += 1
            return
        ev = resp.events
        # only the first and the last content chunk matter: scan in from both ends, not every chunk
        first = next((t for t, p in ev if _TEXT.search(p)), None)
        last = next((t for t, p in reversed(ev) if _TEXT.search(p)), None)
        n = 0
        for _, p in reversed(ev[-3:]):
            m = _TOKENS.search(p)
            if m:
                n = int(m.group(1))
                break
        self.tokens += n
        if first is not None:
            self.ttft_sum += (first - send) / 1e6
            self.ttft_n += 1
            if n > 1:
                self.tpot_sum += (last - first) / 1e6 / (n - 1)
                self.tpot_n += 1

    def line(self, now_ns: int) -> str:
        frac = self.done / self.total if self.total else 1.0
        k = int(round(self.width * frac))
        el = max(0.0, (now_ns - (self.t0_ns or now_ns)) / 1e9)
        parts = [f"{self.label} [{'#' * k}{'.' * (self.width - k)}] {self.done}/{self.total}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.ttft_n:
            parts.append(f"TTFT {self.ttft_sum / self.ttft_n:.1f} ms")
        if self.tpot_n:
            parts.append(f"TPOT {self.tpot_sum / self.tpot_n:.2f} ms")
        if el > 0:
            parts.append(f"{self.tokens / el:.1f} tok/s")
        parts.append(f"{el:.1f} s")
        return "  ".join(parts)

    def tick(self, raw: list, now_ns: int, force: bool = False) -> None:
        while self._seen < len(self.finished):
            item = raw[self.finished[self._seen]]
            self._seen += 1
            if item is not None:
                self._absorb(item)
        now = time.monotonic()
        if not force and now - self._last_draw < TICK_S * 0.9:
            return
        self._last_draw = now
        try:
            self.stream.write("\r" + self.line(now_ns) + "\x1b[K")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def close(self, raw: list, now_ns: int) -> None:
        self.tick(raw, now_ns, force=True)
        try:
            self.stream.write("\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
