"""The model loader under mutated files, run by test_model_files.py in its own process under an
address-space limit (RLIMIT_AS): `python tests/fuzz_loader.py DIR N` runs N hypothesis examples
for each of GGUF and safetensors and prints one JSON line {examples, loaded, rejected, crashes}.

A crash is any exception other than InferdError, an InferdError of more than one line, or a
MemoryError (an allocation past the limit). Each example runs under a 20 s alarm (a hang)."""
import json
import os
import resource
import signal
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from inferd.errors import InferdError  # noqa: E402
from inferd.loading.loader import load_model  # noqa: E402
from test_gguf import write_tiny_gguf  # noqa: E402

out_dir, n_examples = sys.argv[1], int(sys.argv[2])
good = str(write_tiny_gguf(os.path.join(out_dir, "good.gguf")))
GOOD = open(good, "rb").read()
HEADER_END = GOOD.index(b"GGUF") + 4096  # the header, metadata and tensor infos lie in the first KiB or so
report = {"examples": 0, "loaded": 0, "rejected": 0, "crashes": []}


def limit_memory():
    # what the process maps now, plus 1 GiB: a file that asks for more fails to allocate
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    cap = vm + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def alarm(*_):
    raise TimeoutError("hang: an example ran past 20 s")


def attempt(path, kind, **kw):
    report["examples"] += 1
    signal.alarm(20)
    try:
        load_model(path, with_tokenizer=False, dtype="float32", **kw)
        report["loaded"] += 1
    except InferdError as e:
        if "\n" in str(e) or not str(e):
            report["crashes"].append(f"{kind}: multi-line error: {str(e)[:300]!r}")
        report["rejected"] += 1
    except BaseException as e:  # noqa: BLE001 - that is what is counted
        report["crashes"].append(f"{kind}: {type(e).__name__}: {str(e)[:300]}")
    finally:
        signal.alarm(0)


edits = st.lists(st.tuples(st.integers(0, HEADER_END - 1),
                           st.one_of(st.binary(min_size=1, max_size=8),
                                     st.sampled_from([struct.pack("<Q", 2**63), struct.pack("<Q", 2**32 + 1),
                                                      struct.pack("<I", 0xFFFFFFFF), struct.pack("<Q", 0),
                                                      struct.pack("<I", 13), struct.pack("<Q", 1 << 40)]))),
                 min_size=1, max_size=4)


@settings(max_examples=n_examples, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(edits=edits, cut=st.one_of(st.none(), st.integers(0, len(GOOD))))
def fuzz_gguf(edits, cut):
    raw = bytearray(GOOD)
    for at, data in edits:
        raw[at:at + len(data)] = data
    if cut is not None:
        raw = raw[:cut]
    p = os.path.join(out_dir, "m.gguf")
    with open(p, "wb") as f:
        f.write(bytes(raw))
    attempt(p, "gguf")


CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
small_int = st.one_of(st.integers(-2, 70), st.sampled_from([2**31, 2**40, 2**63, -(2**63)]))


@settings(max_examples=n_examples, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(cfg=st.fixed_dictionaries({}, optional={k: small_int for k in CONFIG if k != "architectures"}),
       dtype=st.sampled_from(["F32", "F16", "BF16", "I64", "XX"]),
       shape=st.lists(st.one_of(st.integers(0, 40), st.just(2**40)), max_size=3),
       offs=st.lists(st.integers(-5, 5000), min_size=0, max_size=3),
       hlen=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def fuzz_safetensors(cfg, dtype, shape, offs, hlen):
    d = os.path.join(out_dir, "hf")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**CONFIG, **cfg}, f)
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    header = {n: {"dtype": dtype, "shape": shape, "data_offsets": offs} for n in names}
    h = json.dumps(header).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h) if hlen is None else hlen) + h + np.zeros(1000, np.uint8).tobytes())
    attempt(d, "safetensors")


signal.signal(signal.SIGALRM, alarm)
attempt(good, "gguf-good")  # the unmutated file loads (and warms every import before the limit)
limit_memory()
fuzz_gguf()
fuzz_safetensors()
print(json.dumps(report))
