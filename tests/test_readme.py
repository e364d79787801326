"""The README's commands, run as a new user would run them, with tiny settings: `make run` itself, one
request with curl and one with the `openai` client, `inferd bench` against that server, `inferd eval`
of a quantization. The commands are read from the README itself, so a README that
drifts from the CLI fails here."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

import conftest

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..")
VENV_BIN = os.path.dirname(sys.executable)
TINY = {"--num-prompts": "4", "--max-concurrency": "2", "--windows": "3"}  # values the test shrinks
SHORT = {"bench": ["--input-len", "32", "--output-len", "16"], "eval": ["--ctx", "64", "--windows", "8"]}  # flags it adds


def blocks(lang: str) -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def shell_commands(prefix: str) -> list[list[str]]:
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                args = shlex.split(line.split("  #")[0])
                for i, a in enumerate(args[:-1]):
                    if a in TINY:
                        args[i + 1] = TINY[a]
                out.append(args)
    return out


class MakeRun:
    """The README's `make run`, as written, plus `ARGS="--port P"` (the README's way to pass flags) for
    a free port; in its own session so that stopping it stops make and the server under it."""

    def __init__(self):
        (line,) = [ln for b in blocks("bash") for ln in b.splitlines() if ln.startswith("make run")]
        assert line.split("#")[0].split() == ["make", "run"], line
        self.port = conftest.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(ROOT, "build", f"readme-make-run-{self.port}.log"), "w+b")
        self.proc = subprocess.Popen(["make", "--no-print-directory", "run", f"ARGS=--port {self.port}"], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600):  # a first `make run` may still be installing
        conftest.wait_healthy(self.base, self.proc, timeout, "make run", self.tail)
        return self

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:].decode("utf-8", "replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # inferd drains and exits; make follows
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server():
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    srv = MakeRun()
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def on(server, args: list[str]) -> list[str]:
    return [a.replace("http://127.0.0.1:8000", server.base) for a in args]


def test_the_readme_request_with_curl(server):
    block = next(b for b in blocks("bash") if b.lstrip().startswith("curl"))
    cmd = block.replace("http://127.0.0.1:8000", server.base).replace("\\\n", " ")
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "data: [DONE]" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_the_readme_request_with_the_openai_client(server):
    code = next(b for b in blocks("python") if "OpenAI(" in b).replace("http://127.0.0.1:8000", server.base)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]


def test_the_readme_bench_command(server, tmp_path):
    (cmd,) = shell_commands(".venv/bin/inferd bench")
    cmd = on(server, cmd)
    cmd[0] = os.path.join(VENV_BIN, "inferd")
    r = subprocess.run(cmd + SHORT["bench"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "TTFT" in r.stdout and (tmp_path / "report.html").is_file()


def test_the_readme_eval_command(tmp_path, wikitext_file):
    """Also the eval CLI's own test: the numbers exist, are sane and order as they must (on
    WikiText-2: skipped without it)."""
    (cmd,) = shell_commands(".venv/bin/inferd eval")
    cmd[0] = os.path.join(VENV_BIN, "inferd")
    out = tmp_path / "eval.json"
    r = subprocess.run(cmd + SHORT["eval"] + ["--result-json", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "reference" in r.stdout
    res = json.loads(out.read_text())
    by = {c["config"].split()[0]: c for c in res["configs"]}
    assert set(by) == {"auto", "int4"}
    assert all(0 <= c["mean_kl"] < 0.5 and c["top1_agreement"] > 0.8 for c in by.values()), by
    # the default configuration: the file's blocks with int8 activations (lossy: KL > 0), the head in Q8_0;
    # int4 at group 32 lands back on the file's Q4_1 grid: its KL can be 0
    assert "W4A8" in by["auto"]["config"] and "W8A8Linear" in by["auto"]["config"] and by["auto"]["mean_kl"] > 0
    assert by["auto"]["weight_mib"] < res["reference"]["weight_mib"] / 4
    assert "Q4_1" in res["note"]  # the reference itself is 4-bit, and the report says so
