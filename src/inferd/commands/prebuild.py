"""`python -m inferd.commands.prebuild`: compile the native kernels now (make install runs it), so
that the first model load, or the first test that needs them, does not wait a minute on the
compiler. One library with every ISA variant (csrc/cpu) goes into torch's extension cache; a machine
without a compiler gets the torch fallbacks the loader logs, as on first use."""
from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from inferd.kernels import native

    t0 = time.monotonic()
    ok = native.load() is not None
    print(f"inferd: native kernels {native.build_name()}: {'ready' if ok else 'unavailable (torch fallbacks)'} "
          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
