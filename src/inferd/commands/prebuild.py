"""`python -m inferd.commands.prebuild`: compile the native kernels now (make install runs it), so
that the first model load, or the first test that needs them, does not wait a minute on the
compiler. One library with every ISA variant (csrc/cpu) goes into torch's extension cache.

A build that fails is an install that failed: it exits 1 with one line saying why (the compiler's
first error) and how to go without the kernels on purpose (INFERD_NO_NATIVE=1, the torch fallbacks,
several times slower), which exits 0. Models still load without the kernels (the loader logs the
fallback); an install should not leave that to be discovered later."""
from __future__ import annotations

import logging
import sys
import time
import warnings

OFF_HINT = "set INFERD_NO_NATIVE=1 to install and run without them on purpose (torch fallbacks, slower)"


def _load_quietly(native):
    """native.load() with every log record and warning held back: torch's extension builder logs
    multi-line banners (a compiler it does not know) and tracebacks (a compiler it cannot run), and
    this command's whole report is the one line main prints."""
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return native.load()
    finally:
        logging.disable(logging.NOTSET)


def main() -> int:
    from inferd.errors import InferdError
    from inferd.kernels import native

    if native.disabled():
        print("inferd: native kernels off by request (INFERD_NO_NATIVE): nothing to build; the torch fallbacks "
              "will run", file=sys.stderr)
        return 0
    t0 = time.monotonic()
    try:
        mod = _load_quietly(native)
    except InferdError as e:  # built, but INFERD_ISA names a variant this CPU cannot run
        print(f"inferd: native kernels {native.build_name()}: {e}", file=sys.stderr)
        return 2
    if mod is None:
        print(f"inferd: the native kernels could not be built: {native.build_error()}; install a C++ compiler "
              f"(g++) and ninja, or {OFF_HINT}", file=sys.stderr)
        return 1
    print(f"inferd: native kernels {native.build_name()}: ready, {native.describe()['isa']} variant "
          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
