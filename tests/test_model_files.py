"""Model files and chat templates are untrusted: hostile ones are one clear error (exit 2 from the
CLI), never a crash, a hang or a huge allocation. The fuzz runs in a subprocess under RLIMIT_AS."""
import functools
import json
import os
import struct
import subprocess
import sys

import pytest

from inferd.errors import InferdError
from inferd.loading.checks import check_gguf, check_safetensors
from test_gguf import write_tiny_gguf

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf"))


def patched(tmp_path, good, at: int, data: bytes, name="bad.gguf") -> str:
    raw = bytearray(open(good, "rb").read())
    raw[at:at + len(data)] = data
    p = tmp_path / name
    p.write_bytes(bytes(raw))
    return str(p)


def test_the_valid_file_passes(good):
    check_gguf(good)


@pytest.mark.parametrize("at,data,words", [
    (4, struct.pack("<I", 99), "version"),
    (8, struct.pack("<Q", 2**62), "tensors"),  # tensor count
    (16, struct.pack("<Q", 2**40), "metadata"),  # kv count
    (24, struct.pack("<Q", 2**50), "bytes"),  # the first key's length
])
def test_hostile_headers_are_one_clear_error(tmp_path, good, at, data, words):
    with pytest.raises(InferdError) as e:
        check_gguf(patched(tmp_path, good, at, data))
    msg = str(e.value)
    assert "\n" not in msg and words in msg and "bad.gguf" in msg


def test_truncated_and_offset_past_the_end(tmp_path, good):
    raw = open(good, "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(InferdError, match="past the end"):
        check_gguf(str(p))


def test_huge_dimension_is_refused_before_the_reader(tmp_path, good):
    from gguf import GGUFReader

    t = GGUFReader(good).tensors[0]
    # a tensor info's first dimension follows its name (u64 length, bytes) and n_dims (u32)
    raw = open(good, "rb").read()
    i = raw.index(t.name.encode()) + len(t.name) + 4
    bad = patched(tmp_path, good, i, struct.pack("<Q", 2**45))
    with pytest.raises(InferdError, match="dimension|elements|past the end"):
        check_gguf(bad)


def test_cli_exits_2_with_one_line(tmp_path, good):
    bad = patched(tmp_path, good, 8, struct.pack("<Q", 2**62))
    r = subprocess.run([sys.executable, "-m", "inferd", "generate", "--model", bad, "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "invalid GGUF file" in lines[0] and "Traceback" not in r.stderr


def _safetensors(tmp_path, header: dict, data: bytes = b"", n: int | None = None) -> str:
    h = json.dumps(header).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(h) if n is None else n) + h + data)
    return str(p)


@pytest.mark.parametrize("header,data,n,words", [
    ({}, b"", 2**40, "header length"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "byte range"),
    ({"w": {"dtype": "F32", "shape": [2**41], "data_offsets": [0, 16]}}, b"\0" * 16, None, "shape"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16, None, "bytes for shape"),
    ({"w": {"dtype": "EVIL", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, None, "dtype"),
])
def test_hostile_safetensors_headers(tmp_path, header, data, n, words):
    with pytest.raises(InferdError, match=words):
        check_safetensors(_safetensors(tmp_path, header, data, n))


def test_config_json_bounds_before_allocation(tmp_path):
    from inferd.loading.loader import load_model

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2**20,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InferdError, match="hidden_size"):
        load_model(str(tmp_path), load_format="dummy")
    cfg.update(hidden_size=16384, num_attention_heads=128, num_hidden_layers=1000, intermediate_size=200000,
               vocab_size=1 << 21)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InferdError, match="GiB"):  # in bounds, but no machine here holds it
        load_model(str(tmp_path), load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(InferdError, match="missing or invalid"):
        load_model(str(tmp_path), load_format="dummy")


# -- chat templates -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _tokenizer():
    from inferd.gguf_file import default_model_path
    from inferd.loading.loader import _load_tokenizer

    return _load_tokenizer(default_model_path())


def _tok_with_template(template: str):
    tok = _tokenizer()
    tok.chat_template = template
    tok._compiled_template = None
    return tok


@pytest.mark.parametrize("template,words", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe|access"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{{ 'x' * 1000000000 }}", "too large"),
    ("{{ 10 ** 100000000 }}", "too large"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "larger than"),
    ("{{ 'a'.ljust(10000000000) }}", "too large"),
])
def test_hostile_chat_templates_are_refused(template, words):
    import re

    tok = _tok_with_template(template)
    with pytest.raises(InferdError) as e:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert re.search(words, str(e.value)), str(e.value)


def test_loader_fuzz_in_a_memory_limited_subprocess(tmp_path):
    """Mutated headers, metadata and tensor infos of a valid GGUF, and mutated safetensors
    headers (hypothesis, a fixed number of examples): each load either works or fails with one
    InferdError line; never another exception, a hang, or an allocation past RLIMIT_AS."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_loader.py"), str(tmp_path), "250"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["crashes"] == [] and report["examples"] >= 500, report
    assert report["rejected"] > 0 and report["loaded"] > 0, report  # both outcomes were reached
