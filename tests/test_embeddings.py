"""Embeddings: the encoder family and the pooling runner held to oracles nobody here wrote.

- all-MiniLM-L6-v2 (embedded) against sentence-transformers on the same files: short inputs, inputs
  at its 256-token limit, token ids, a batch of 64 mixed lengths, truncation; offline (`LLM.embed`)
  and served (/v1/embeddings float and base64, /pooling, Ollama's /api/embed and /api/embeddings),
  with the counters that prove one padding-free flat batch.
- decoders as pooling models (`--runner pooling`): last-token and mean vectors equal to transformers'
  normalised hidden states, from an HF folder and a GGUF.
- the official `openai` and `ollama` clients; an embedding model and a chat model in one server, each
  refusing the other's routes with a 400; hostile inputs one line each; schemathesis over the routes.
"""
import base64
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import httpx
import pytest
import torch

from conftest import ServerProc

st = pytest.importorskip("sentence_transformers")

WORDS = ("the of and to in is was for on that with as by it at from his her an have are were this be which or had "
         "not river model token light north quiet paper system garden number").split()
COS = 0.9999  # the bar: every vector's cosine with sentence-transformers'


def texts(n: int, seed: int = 0, lo: int = 1, hi: int = 200) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def minilm_dir():
    from inferd.errors import InferdError
    from inferd.loading import embedded

    try:
        return embedded.minilm_path()
    except InferdError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def oracle(minilm_dir):
    """sentence-transformers on the same folder, fp32, its own truncation at max_seq_length."""
    return st.SentenceTransformer(minilm_dir, device="cpu")


def ref(oracle, inputs) -> torch.Tensor:
    return torch.tensor(oracle.encode(inputs, batch_size=64))


def assert_cos(got, want, bar=COS):
    got = torch.as_tensor(got, dtype=torch.float32)
    cos = torch.nn.functional.cosine_similarity(got, want.float())
    assert cos.min() >= bar, (cos.min().item(), int(cos.argmin()))


def at_limit(tok, n: int = 256) -> str:
    """A text of exactly n tokens with [CLS] and [SEP] (each word here is one WordPiece)."""
    words = texts(1, seed=7, lo=n, hi=n)[0].split()
    for k in range(n - 2, 0, -1):
        t = " ".join(words[:k])
        if len(tok.encode(t)) == n:
            return t
    raise AssertionError("no text of that length")


def packs(lengths: list[int], budget: int, max_seqs: int) -> int:
    """Forwards a FIFO of these lengths takes, whole sequences, each under the budget (the first always goes)."""
    n = tokens = seqs = 0
    for k in lengths:
        if seqs and (tokens + k > budget or seqs == max_seqs):
            n, tokens, seqs = n + 1, 0, 0
        tokens, seqs = tokens + k, seqs + 1
    return n + (seqs > 0)


# -- offline: LLM.embed ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from inferd.engine.llm import LLM

    return LLM(model="all-minilm-l6-v2", dtype="auto")


def test_minilm_equals_sentence_transformers_offline(minilm, oracle):
    """Short inputs, inputs at the 256-token limit, token ids and 64 mixed lengths, in the dtype --dtype
    auto picks; the 64 ran as few flat batches, every row a real token (no padding)."""
    tok = minilm.tokenizer
    short = ["hi", "Hello world!", "A quick brown fox."]
    limit = [at_limit(tok), at_limit(tok, 255)]
    assert [len(tok.encode(t)) for t in limit] == [256, 255]
    mixed = texts(64, seed=1, hi=250)
    everything = short + limit + mixed
    before = dict(minilm.engine.counters())
    got = [o.embedding for o in minilm.embed(everything)]
    assert_cos(got, ref(oracle, everything))
    c = minilm.engine.counters()
    n_real = sum(len(tok.encode(t)) for t in everything)
    assert c["tokens"] - before["tokens"] == n_real == c["real_tokens"] - before["real_tokens"]
    assert c["padded_tokens"] == 0
    assert c["sequences"] - before["sequences"] == len(everything)
    # batched as the scheduler's rule says: arrival order, whole sequences, up to the budget
    eng = minilm.engine
    want = packs([len(tok.encode(t)) for t in everything], eng.budget, eng.config.max_num_seqs)
    assert c["forwards"] - before["forwards"] == want < len(everything) // 2
    ids = [tok.encode(t) for t in short]
    assert_cos([o.embedding for o in minilm.embed(ids)], ref(oracle, short))
    assert minilm.embed(ids[0])[0].num_prompt_tokens == len(ids[0])


def test_minilm_fp32_is_exact(minilm_dir, oracle):
    """In fp32 the vectors are sentence-transformers' to float rounding; both attention layouts
    (length buckets, one call per sequence) agree."""
    from inferd.engine.llm import LLM

    llm = LLM(model="all-minilm-l6-v2", dtype="float32")
    batch = texts(24, seed=2, hi=240)
    want = ref(oracle, batch)
    got = torch.tensor([o.embedding for o in llm.embed(batch)])
    assert_cos(got, want, 0.999999)
    llm.engine.runner.strategy = "loop"
    loop = torch.tensor([o.embedding for o in llm.embed(batch)])
    torch.testing.assert_close(loop, got, atol=1e-5, rtol=0)


def test_pooling_config_comes_from_the_sentence_transformers_files(minilm, minilm_dir, tmp_path):
    from inferd.errors import InferdError
    from inferd.loading.encoder import read_pooling

    p = read_pooling(minilm_dir)
    assert (p.mode, p.normalize, p.max_seq_length) == ("mean", True, 256)
    assert minilm.engine.max_model_len == 256
    assert read_pooling(minilm_dir, "cls").mode == "cls"
    shutil.copytree(minilm_dir, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = tmp_path / "m" / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(InferdError, match="pooling_mode_max_tokens is not supported"):
        read_pooling(str(tmp_path / "m"))
    assert read_pooling(str(tmp_path / "m"), "mean").mode == "mean"  # --pooling overrides what we lack


def test_engine_refuses_what_a_pooling_model_cannot_do(minilm):
    from inferd.engine.request import PoolingParams, SamplingParams
    from inferd.errors import InferdError

    with pytest.raises(InferdError, match="embedding model"):
        minilm.engine.add_request("hi", SamplingParams())
    with pytest.raises(InferdError, match="at most 256"):
        minilm.engine.add_request(list(range(1000, 1300)), PoolingParams())
    with pytest.raises(InferdError, match=r"\[0, 30522\)"):
        minilm.engine.add_request([101, 40000, 102], PoolingParams())
    with pytest.raises(InferdError, match="does not apply to the pooling runner"):
        from inferd.config import EngineConfig
        from inferd.engine.pooling import PoolingEngine

        PoolingEngine(EngineConfig(model="all-minilm-l6-v2", speculative_method="ngram"), minilm.engine.loaded)


def test_encoder_refuses_the_generate_runner(minilm):
    from inferd.config import EngineConfig
    from inferd.engine.factory import make_engine
    from inferd.errors import InferdError

    with pytest.raises(InferdError, match="--runner pooling"):
        make_engine(EngineConfig(model="all-minilm-l6-v2", runner="generate"), minilm.engine.loaded)


# -- decoders as pooling models ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def tiny_llama(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, eos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.mul_(3.0)
    return hf


def hf_pooled(hf, seqs: list[list[int]], mode: str) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled per sequence and normalised."""
    out = []
    with torch.no_grad():
        for s in seqs:
            h = hf.model(torch.tensor([s])).last_hidden_state[0]
            v = h[-1] if mode == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0))
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_decoder_as_pooling_model_equals_transformers(tmp_path, mode):
    """`--runner pooling` on a tiny Llama: the HF folder and its GGUF (llama.cpp's names and row order),
    the same vectors as transformers' hidden states, causal attention kept within each sequence of
    one flat batch; Q8_0 blocks on the block kernels stay close."""
    from hf_to_gguf import write_gguf

    from inferd.engine.llm import LLM
    from inferd.loading.loader import load_model

    hf = tiny_llama(tmp_path)
    hf.save_pretrained(tmp_path / "hf")
    rng = random.Random(3)
    seqs = [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(12)]
    want = hf_pooled(hf, seqs, mode)
    forms = [str(tmp_path / "hf"), write_gguf(hf, tmp_path / "m.gguf", "llama")]
    for form in forms:
        llm = LLM(loaded=load_model(form, dtype="float32", with_tokenizer=False), runner="pooling", pooling=mode)
        got = torch.tensor([o.embedding for o in llm.embed(seqs)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        c = llm.engine.counters()
        assert c["padded_tokens"] == 0 and c["max_batch_seqs"] > 1
    from gguf import GGMLQuantizationType

    q8 = write_gguf(hf, tmp_path / "q8.gguf", "llama", qtype=GGMLQuantizationType.Q8_0)
    llm = LLM(loaded=load_model(q8, quantization="auto", with_tokenizer=False), runner="pooling", pooling=mode)
    got = torch.tensor([o.embedding for o in llm.embed(seqs)])
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.99


# -- served: the embedding model beside a chat model in one server --------------------------------------

@pytest.fixture(scope="module")
def server(minilm_dir, tiny_chat_gguf):
    """all-MiniLM-L6-v2 and a chat model in one server (each its own engine process), fp32 embeddings;
    `emb-auto`: the same files in --dtype auto, the decoder's pooling runner on the chat file."""
    s = ServerProc(["--model", f"minilm={minilm_dir}", "--model", f"chat={tiny_chat_gguf}", "--dtype", "float32",
                    "--threads", "1", "--preload", "--max-num-batched-tokens", "4096"])
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def post(srv, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.base + path, content=data, headers={"Content-Type": "application/json"}, timeout=120, **kw)


def vectors(r) -> torch.Tensor:
    assert r.status_code == 200, r.text
    return torch.tensor([d["embedding"] for d in r.json()["data"]])


def test_served_embeddings_equal_sentence_transformers(server, oracle):
    tok = oracle.tokenizer
    short = ["hi", "Hello world!"]
    limit = at_limit(_Tok(tok))
    mixed = texts(64, seed=4, hi=250)
    r = post(server, "/v1/embeddings", {"model": "minilm", "input": short + [limit]})
    assert_cos(vectors(r), ref(oracle, short + [limit]))
    body = r.json()
    n = sum(len(tok(t)["input_ids"]) for t in short + [limit])
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n} and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert_cos(vectors(post(server, "/v1/embeddings", {"model": "minilm", "input": mixed})), ref(oracle, mixed))
    # the 64 inputs went to the engine as 64 requests and ran batched (the first may run alone: it
    # starts a step before the rest arrive), every computed row a real token
    state = httpx.get(server.base + "/v1/engine/state?steps=0", timeout=30).json()["engines"]
    pool = next(e for e in state if e["model"] == "minilm")["counters"]["pooling"]
    assert pool["max_batch_seqs"] >= 16 and pool["padded_tokens"] == 0 and pool["tokens"] == pool["real_tokens"]
    ids = [tok(t)["input_ids"] for t in short]
    assert_cos(vectors(post(server, "/v1/embeddings", {"model": "minilm", "input": ids})), ref(oracle, short))
    assert_cos(vectors(post(server, "/v1/embeddings", {"model": "minilm", "input": ids[1]})), ref(oracle, short[1:]))
    b64 = post(server, "/v1/embeddings", {"model": "minilm", "input": short, "encoding_format": "base64"}).json()
    floats = vectors(post(server, "/v1/embeddings", {"model": "minilm", "input": short}))
    # float32 both ways; another request's batch may round the matmuls' last bits differently
    for d, f in zip(b64["data"], floats):
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 4 * 384
        torch.testing.assert_close(torch.tensor(struct.unpack("<384f", raw)), f, atol=1e-6, rtol=0)
    pooled = post(server, "/pooling", {"model": "minilm", "input": short}).json()
    torch.testing.assert_close(torch.tensor([d["data"] for d in pooled["data"]]), floats, atol=1e-6, rtol=0)


class _Tok:
    """sentence-transformers' tokenizer as `at_limit` reads ours."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, t):
        return self.tok(t)["input_ids"]


def test_past_the_limit_is_a_400_and_truncation_is_sentence_transformers(server, oracle):
    long = texts(1, seed=5, lo=400, hi=400)[0]
    r = post(server, "/v1/embeddings", {"model": "minilm", "input": long})
    assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "input"
    r = post(server, "/v1/embeddings", {"model": "minilm", "input": [long, "short"], "truncate_prompt_tokens": -1})
    assert_cos(vectors(r), ref(oracle, [long, "short"]))  # sentence-transformers cuts at its 256
    assert r.json()["usage"]["prompt_tokens"] == 256 + len(oracle.tokenizer("short")["input_ids"])
    oracle.max_seq_length = 100
    try:
        want = ref(oracle, [long])
    finally:
        oracle.max_seq_length = 256
    assert_cos(vectors(post(server, "/v1/embeddings", {"model": "minilm", "input": long,
                                                        "truncate_prompt_tokens": 100})), want)
    r = post(server, "/v1/embeddings", {"model": "minilm", "input": "x", "truncate_prompt_tokens": 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_openai_client_embeddings(server, oracle):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    batch = ["The cat sat on the mat.", "A dog ran in the park."]
    got = client.embeddings.create(model="minilm", input=batch)  # the client asks for base64 and decodes it
    assert_cos([d.embedding for d in got.data], ref(oracle, batch))
    assert got.usage.prompt_tokens > 0
    got = client.embeddings.create(model="minilm", input=batch[0], encoding_format="float")
    assert_cos([got.data[0].embedding], ref(oracle, batch[:1]))
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="minilm", input="x", dimensions=64)


def test_ollama_client_embed(server, oracle):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.base)
    batch = ["why is the sky blue", "why is the grass green"]
    got = client.embed(model="minilm", input=batch)
    assert_cos(got["embeddings"], ref(oracle, batch))
    assert got["prompt_eval_count"] == sum(len(oracle.tokenizer(t)["input_ids"]) for t in batch)
    assert_cos(client.embed(model="minilm:latest", input=batch[0])["embeddings"], ref(oracle, batch[:1]))
    legacy = client.embeddings(model="minilm", prompt=batch[0])["embedding"]  # not normalised, as Ollama's
    assert_cos([legacy], ref(oracle, batch[:1]))
    assert abs(torch.tensor(legacy).norm() - 1) > 1e-3
    long = texts(1, seed=5, lo=400, hi=400)[0]  # Ollama cuts by default; truncate false refuses
    assert_cos(client.embed(model="minilm", input=long)["embeddings"], ref(oracle, [long]))
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="minilm", input=long, truncate=False)
    assert e.value.status_code == 400 and "at most 256" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nope", input="x")
    assert e.value.status_code == 404


def test_each_model_answers_its_own_routes(server):
    """The chat model chats and the embedding model embeds; each refuses the other's route with a
    400 that says which routes it answers."""
    r = post(server, "/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/completions", {"model": "minilm", "prompt": "hi"})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/embeddings", {"model": "chat", "input": "hi"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
    r = post(server, "/api/embed", {"model": "chat", "input": "hi"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"], r.text
    models = httpx.get(server.base + "/v1/models").json()["data"]
    assert {m["id"] for m in models} == {"minilm", "chat"}


HOSTILE = [
    ({"input": []}, "empty list"),
    ({"input": ""}, "empty string"),
    ({"input": ["a", ""]}, "input[1] is empty"),
    ({"input": ["x"] * 100_000}, "at most 2048"),
    ({"input": [1, "a"]}, "mixes"),
    ({"input": [[1, 2], []]}, "input[1] is empty"),
    ({"input": [101, 99999, 102]}, "past the vocabulary"),
    ({"input": [[101, 2**31]]}, "input"),
    ({"input": [101, -1]}, "input"),
    ({"input": {"a": 1}}, "input"),
    ({"input": "x " * 300_000}, "at most 256"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "model": "nope"}, "does not exist"),
]


@pytest.mark.parametrize("body,words", HOSTILE, ids=[w for _, w in HOSTILE])
def test_hostile_inputs_are_one_line_400s(server, body, words):
    r = post(server, "/v1/embeddings", {"model": "minilm", **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert words in err["message"] or words == err["param"], err
    assert "\n" not in err["message"] and "Traceback" not in r.text and len(err["message"]) < 400


def test_ollama_errors_are_ollamas_shape(server):
    for body in ({"model": "minilm", "input": []}, {"model": "minilm"}, {"input": "x"}, b"not json",
                 {"model": "minilm", "input": ["x"] * 5000}):
        r = post(server, "/api/embed", body)
        assert r.status_code == 400 and set(r.json()) == {"error"} and "\n" not in r.json()["error"], r.text
    r = post(server, "/api/embeddings", {"model": "minilm", "prompt": ""})
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text


def test_schemathesis_over_the_embedding_routes(server, tmp_path):
    """Zero 5xx and every answer in its declared shape over the four routes; nothing left queued."""
    st_bin = shutil.which("st") or os.path.join(os.path.dirname(sys.executable), "st")
    cfg = tmp_path / "schemathesis.toml"
    cfg.write_text('[checks.positive_data_acceptance]\nexpected-statuses = ["2xx", "400", "404"]\n\n'
                   '[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "404", "405", "413", "422"]\n')
    cmd = [st_bin, "--config-file", str(cfg), "run", server.base + "/openapi.json", "--max-examples", "60",
           "--request-timeout", "30", "--workers", "1", "--seed", "1", "--generation-deterministic",
           "--phases", "examples,coverage,fuzzing", "--no-color",
           "--include-path-regex", "^/(v1/embeddings|pooling|api/embed|api/embeddings)$"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "Traceback" not in server.log_text(), server.log_text()
    metrics = httpx.get(server.base + "/metrics", timeout=10).text
    waiting = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("inferd:num_requests_waiting")]
    assert waiting and all(v == 0 for v in waiting)


def test_inferd_bench_embeddings_workload(server, tmp_path):
    """`inferd bench --endpoint /v1/embeddings`: requests/s, latency percentiles and input tokens/s of
    a served embedding model, every request answered."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "--base-url", server.base, "--endpoint",
                        "/v1/embeddings", "--model", "minilm", "--num-prompts", "12", "--input-len", "48",
                        "--max-concurrency", "4", "--result-json", str(out), "--no-progress", "--no-server-metrics"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["request_throughput"] > 0 and res["total_token_throughput"] > 0 and res["total_output_tokens"] == 0
    assert res["p99_e2el_ms"] >= res["median_e2el_ms"] > 0
    assert res["total_input_tokens_server"] >= 12 * 40


def test_embeddings_benchmark_tiny(minilm_dir, tmp_path):
    """benchmarks/embeddings.py --tiny: both contenders ran, the rows are medians with their spread,
    and inferd's record shows one padding-free flat batch per call with the native attention."""
    from pathlib import Path

    from inferd.engine.paths import check_label

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "emb.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "embeddings.py"), "--tiny", "--threads", "1",
                        "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["cpu"] and doc["setup"]["batches"] == [1, 8]
    assert set(doc["paths"]) == {"sentence-transformers fp32", "inferd", "inferd loop"}
    for label, p in doc["paths"].items():
        check_label(label, p)
    inf = doc["paths"]["inferd"]
    assert inf["runner"] == "pooling" and inf["padded_tokens"] == 0 and inf["tokens"] == inf["real_tokens"] > 0
    from inferd.kernels import native

    if native.load() is not None:
        assert inf["attention"] == "kernel" and inf["kernel_forwards"] == inf["forwards"] > 0
    assert doc["paths"]["inferd loop"]["attention"] == "loop"
    rows = {(row["label"], row["batch"]): row for row in doc["rows"]}
    assert len(rows) == 6 and all(row["min"] <= row["median"] <= row["max"] and row["median"] > 0
                                  for row in rows.values())
    assert "padding-free" in r.stdout and "paths that ran:" in r.stdout


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_served_decoder_with_runner_pooling_equals_transformers(tiny_chat_gguf, mode):
    """`inferd serve --runner pooling` on a chat GGUF (its dequantized weights, fp32): /v1/embeddings'
    vectors are transformers' normalised hidden states of the same file (transformers reads the GGUF),
    for text and token-id inputs; the server then refuses chat."""
    from helpers import hf_gguf_model

    hf = hf_gguf_model(tiny_chat_gguf)
    s = ServerProc(["--model", tiny_chat_gguf, "--runner", "pooling", "--pooling", mode, "--quantization", "none",
                    "--dtype", "float32", "--threads", "1"])
    try:
        s.wait_ready()
        rng = random.Random(5)
        seqs = [[rng.randrange(1, 2000) for _ in range(rng.randint(1, 60))] for _ in range(6)]
        got = vectors(post(s, "/v1/embeddings", {"input": seqs}))
        torch.testing.assert_close(got, hf_pooled(hf, seqs, mode), atol=1e-4, rtol=0)
        ids = httpx.post(s.base + "/tokenize", json={"prompt": "a short text"}).json()["tokens"]
        one = vectors(post(s, "/v1/embeddings", {"input": "a short text"}))
        torch.testing.assert_close(one, hf_pooled(hf, [ids], mode), atol=1e-4, rtol=0)
        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    finally:
        s.stop()
