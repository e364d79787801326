"""Schemathesis against the server's own OpenAPI document: every operation, 200 examples each, all
of schemathesis' default checks: no 5xx, every status and body as documented, no hang (a request
timeout), and the KV pool empty afterwards. The server runs a tiny random model with SmolLM2's
tokenizer and --max-model-len 64, so schema-valid requests finish in milliseconds."""
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from conftest import ServerProc
from helpers import write_tiny_chat_gguf

pytestmark = pytest.mark.slow

# Schema-valid requests the server still refuses, by rules JSON Schema cannot state: cross-field
# ones (best_of >= n, min_tokens <= max_tokens, n > 1 needs temperature > 0, max_tokens 0 only
# with echo), a prompt longer than --max-model-len, token ids past this model's vocabulary, and a
# model name other than the served one (404). schemathesis' positive-data check is told those are
# 400 and 404; every other check keeps its defaults.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_chat_gguf(tmp_path_factory.mktemp("fuzz") / "tiny-chat.gguf")
    s = ServerProc(["--model", path, "--max-model-len", "64", "--threads", "1", "--max-request-body-bytes",
                    str(1 << 20)])
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_openapi_document_declares_errors_and_bounds(server):
    doc = httpx.get(server.base + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        resp = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(resp), (path, set(resp))
        assert "422" not in resp
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]

    def bounded(p):
        opts = p.get("anyOf", [p])
        nums = [o for o in opts if o.get("type") in ("integer", "number")]
        return all(("maximum" in o or "exclusiveMaximum" in o) and ("minimum" in o or "exclusiveMinimum" in o)
                   for o in nums)

    numeric = [k for k, p in props.items() if any(o.get("type") in ("integer", "number") for o in p.get("anyOf", [p]))]
    assert {"max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "min_tokens"} <= set(numeric)
    assert all(bounded(props[k]) for k in numeric), [k for k in numeric if not bounded(props[k])]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(server, tmp_path):
    st = shutil.which("st") or os.path.join(os.path.dirname(sys.executable), "st")
    cfg = tmp_path / "schemathesis.toml"
    cfg.write_text(CONFIG)
    junit = tmp_path / "junit.xml"
    cmd = [st, "--config-file", str(cfg), "run", server.base + "/openapi.json", "--max-examples", "200",
           "--request-timeout", "20", "--workers", "1", "--seed", "1", "--generation-deterministic",
           "--phases", "examples,coverage,fuzzing", "--no-color", "--report", "junit",
           "--report-junit-path", str(junit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, out
    m = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 1000, out  # 7 operations; the bodies get ~200 each
    assert "Traceback" not in server.log_text(), server.log_text()
    # nothing left behind: no sequence running or waiting, no KV block held
    metrics = httpx.get(server.base + "/metrics", timeout=10).text
    gauges = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("inferd:kv_cache_usage_perc", "inferd:num_requests_running",
                                  "inferd:num_requests_waiting"))}
    assert gauges and all(v == 0 for v in gauges.values()), gauges
    assert server.alive()
