"""What a load did and cost: seconds, peak resident memory, the file's bytes read, and every layer
that fell back to dense weights (a type without a kernel), for the log, `/v1/engine/state` and
`/metrics`. It also drops the file's mapped pages once a layer is built from them, and draws a
progress line on a terminal for big files."""
from __future__ import annotations

import logging
import resource
import sys
import time

log = logging.getLogger("inferd")

PROGRESS_BYTES = 300 << 20  # files past this size get a progress line on a terminal


def peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory (mapped file pages it touched count)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LoadReport:
    def __init__(self):
        self.t0 = time.monotonic()
        self.seconds = None
        self.file_bytes = 0
        self.done_bytes = 0
        self.reader = None
        self.dense_fallback: dict[str, int] = {}  # GGUF type -> layers served dense for want of a kernel
        self.dense_fallback_bytes = 0
        self.weight_bytes = 0
        self.peak = 0
        self.progress = False
        self._last_draw = 0.0

    def begin(self, plan, reader, dtype) -> None:
        self.file_bytes, self.reader, self.dtype = plan.file_bytes, reader, dtype
        self.progress = plan.file_bytes > PROGRESS_BYTES and sys.stderr.isatty()

    def on_dense(self, name: str, lin) -> None:
        """A projection the gguf method could not serve from its blocks: one log line a type."""
        from inferd.model.planned import role

        # the output layer stays dense only where no --quantize-lm-head asked for it: a choice, not a fallback
        if role(name) not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            return
        kinds = sorted({p.type for p in lin.parts})
        key = "+".join(kinds)
        size = lin.dense_bytes(self.dtype)
        self.dense_fallback_bytes += size
        if key not in self.dense_fallback:
            log.warning("gguf: %s layers have no kernel for their type (first: %s): served dense, %.2f MiB each "
                        "(counted in /v1/engine/state and inferd:dense_fallback_layers)", key, name, size / 2**20)
        self.dense_fallback[key] = self.dense_fallback.get(key, 0) + 1

    def release(self, parts) -> None:
        """A layer is built from `parts`: drop the mapped pages it read (they would count as resident
        until the process exits) and move the progress line."""
        # (a part of blocks made at load, --lm-head-quantization's, maps nothing)
        spans = [(p.tensor.data_offset, p.tensor.n_bytes) for p in parts if hasattr(getattr(p, "tensor", None), "data_offset")]
        if self.reader is not None and spans:
            self.reader.release(spans)
        self.done_bytes += sum(getattr(p, "nbytes", 0) for p in parts)
        if self.progress:
            now = time.monotonic()
            if now - self._last_draw > 0.1:
                self._last_draw = now
                self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        frac = min(1.0, self.done_bytes / max(self.file_bytes, 1))
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\rloading [{bar:<30}] {self.done_bytes / 2**30:5.2f}/{self.file_bytes / 2**30:.2f} GiB "
                         f"{now - self.t0:5.1f} s{end}")
        sys.stderr.flush()

    def end(self, model) -> None:
        from inferd.quant.linear import weight_bytes

        if self.reader is not None:
            self.reader.release()  # the mapping's pages: only the rows a lookup reads come back
        self.seconds = time.monotonic() - self.t0
        self.weight_bytes = weight_bytes(model)
        self.peak = peak_rss_bytes()
        if self.progress:
            self.done_bytes = self.file_bytes
            self._draw(time.monotonic(), "\n")

    def lines(self) -> list[str]:
        out = [f"loaded in {self.seconds:.1f} s{f' from a {self.file_bytes / 2**20:.1f} MiB file' if self.file_bytes else ''}, "
               f"peak RSS {self.peak / 2**20:.0f} MiB"]
        if self.dense_fallback:
            out.append("dense fallback: " + ", ".join(f"{v} {k} layers" for k, v in self.dense_fallback.items()))
        return out

    def as_dict(self) -> dict:
        return {"load_seconds": self.seconds, "peak_rss_bytes": self.peak, "weight_bytes": self.weight_bytes,
                "file_bytes": self.file_bytes, "dense_fallback": dict(self.dense_fallback),
                "dense_fallback_bytes": self.dense_fallback_bytes}

