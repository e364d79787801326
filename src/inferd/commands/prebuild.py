"""`python -m inferd.commands.prebuild`: compile the native kernels now (make install runs it), so
that the first model load, or the first test that needs one, does not wait a minute on the compiler.
Each is built for this CPU (-march=native) into torch's extension cache; a machine without a
compiler gets the fallbacks the kernels log, as on first use."""
from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from inferd.kernels import cpu_attention, cpu_ops, w4a8
    from inferd.quant import fused_decode

    for mod in (cpu_ops, cpu_attention, w4a8, fused_decode):
        t0 = time.monotonic()
        ok = mod.load() is not None
        print(f"inferd: native kernels {mod.__name__}: {'ready' if ok else 'unavailable (fallback)'} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
