"""Model files and chat templates are untrusted: hostile ones are one clear error (exit 2 from the
CLI), never a crash, a hang or a huge allocation. The fuzz runs in a subprocess under RLIMIT_AS."""
import functools
import json
import os
import re
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


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tensor(name: str, dims, ttype: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def _gguf(tmp_path, kvs=(), tensors=(), data: bytes = b"\0" * 256) -> str:
    """A GGUF file built byte by byte (the writer refuses to write what these tests need)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    p = tmp_path / "bad.gguf"
    p.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return str(p)


U8, U32, STRING, ARRAY = 0, 4, 8, 9


@pytest.mark.parametrize("kvs,tensors,words", [
    ([_kv("a", ARRAY, struct.pack("<IQ", U8, (1 << 24) + 1))], [], "items .limit"),
    ([_kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * 4 + struct.pack("<IQ", U8, 0))], [], "nests arrays"),
    ([_kv("a", 13, b"")], [], "unknown type 13"),
    ([_kv("a", ARRAY, struct.pack("<IQ", 13, 1))], [], "unknown item type"),
    ([_kv("a", ARRAY, struct.pack("<IQ", STRING, 1 << 20))], [], "past the end"),
    ([_kv(b"\xff", U8, b"\0")], [], "not UTF-8"),
    ([_kv("a", STRING, struct.pack("<Q", (1 << 24) + 1))], [], "bytes long .limit"),
    ([_kv("general.alignment", U32, struct.pack("<I", 48))], [], "power of two"),
    ([_kv("general.alignment", 7, b"\1")], [], "power of two"),  # a bool
    ([], [_tensor("t", [1, 1, 1, 1, 1])], "5 dimensions"),
    ([], [_tensor("t", [0])], "dimension 0"),
    ([], [_tensor("t", [1 << 21, 1 << 21])], "elements"),
    ([], [_tensor("t", [8], ttype=99)], "unknown type 99"),
    ([], [_tensor("t", [33], ttype=2)], "block of 32"),  # Q4_0
    ([], [_tensor("t", [8], offset=4)], "not aligned"),
    ([], [_tensor("t", [8]), _tensor("t", [8], offset=32)], "appears twice"),
    ([], [_tensor("t", [8], offset=1 << 20)], "past the end"),
])
def test_every_bound_is_one_clear_error(tmp_path, kvs, tensors, words):
    with pytest.raises(InferdError) as e:
        check_gguf(_gguf(tmp_path, kvs, tensors))
    msg = str(e.value)
    assert "\n" not in msg and re.search(words, msg) and "invalid GGUF file" in msg and "bad.gguf" in msg, msg


def test_a_sound_hand_built_file_passes(tmp_path):
    check_gguf(_gguf(tmp_path, [_kv("general.alignment", U32, struct.pack("<I", 64))],
                     [_tensor("a", [8, 2]), _tensor("b", [32], ttype=2, offset=64)]))


def test_every_reader_of_a_hostile_file_gives_the_same_error(tmp_path, good):
    """The validator, the loader's GGUFFile, the tokenizer and the bench read through one bounded
    reader, so a hostile metadata section is refused alike by each of them."""
    from inferd.bench.tokenizer import load_local
    from inferd.gguf_file import GGUFFile, read_gguf_metadata
    from inferd.tokenizer import Tokenizer

    bad = patched(tmp_path, good, 24, struct.pack("<Q", 2**50))
    errors = set()
    for read in (check_gguf, GGUFFile, read_gguf_metadata, Tokenizer.load, load_local):
        with pytest.raises(InferdError) as e:
            read(bad)
        errors.add(str(e.value))
    assert len(errors) == 1 and "a metadata key is 1125899906842624 bytes long" in errors.pop()


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
