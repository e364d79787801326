"""`inferd env`: what a bug report needs about this machine and build, on a few lines."""
from __future__ import annotations

import json
import platform
import sys


def run_env(args) -> int:
    from inferd import __version__
    from inferd.kernels import native

    info = {"inferd": __version__, "python": platform.python_version(), **native.describe()}
    if getattr(args, "json", False):
        print(json.dumps(info))
        return 0
    if "error" in info:  # an INFERD_ISA this CPU cannot run: the CLI's one-line error, exit 2
        from inferd.errors import InferdError

        raise InferdError(info["error"])
    rows = [("inferd", info["inferd"]), ("python", info["python"]), ("torch", info["torch"]),
            ("cpu", f"{info['cpu']} ({info['machine']})"),
            ("cpu features", " ".join(info.get("cpu_features") or []) or "(none the kernels use)"),
            ("kernel variant", info["isa"] or "none (native kernels unavailable: torch fallbacks)"),
            ("runnable variants", ", ".join(info.get("runnable") or [])),
            ("native library", info["native"] or "-"),
            ("torch cpu capability", info["torch_cpu_capability"]),
            ("torch threads", str(info["threads"]))]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        sys.stdout.write(f"{k:<{w}}  {v}\n")
    return 0
