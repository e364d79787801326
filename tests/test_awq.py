"""AWQ: the GEMM packing against hand-computed words, a hand-built Hugging Face AWQ checkpoint
loading to exactly its integers, the search beating round-to-nearest on every layer, the
quantize -> save -> load round trip, the `inferd quantize` command, and a saved folder served by
`inferd serve`."""
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_model
from helpers import FUSED, TINY, build_hf_awq_checkpoint, hf_awq_config, pack_by_hand  # noqa: F401
from inferd.model.layers import ContiguousKV
from inferd.loading.loader import load_model
from inferd.quant import Int4Linear
from inferd.quant.awq import attach, awq_quantize, fake_quant, int_grid, output_error, quantize_groups
from inferd.quant.awq_checkpoint import dequantize, pack_int4, save_awq, unpack_int4

def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "inferd", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


def logits(model, ids):
    ids = torch.tensor(ids)
    pos = torch.arange(len(ids))
    kv = ContiguousKV(model.cfg, len(ids), model.dtype, model.device)
    kv.set_positions(pos)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, kv))


# -- packing ----------------------------------------------------------------------------------

def test_pack_matches_hand_computed_word():
    # channels 0..7 hold 1..8; a word's nibbles (low to high) hold channels 0,2,4,6,1,3,5,7
    # -> nibbles 1,3,5,7,2,4,6,8 -> 0x86427531
    w = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert w.dtype == torch.int32 and int(w) == 0x86427531 - 2**32  # stored as a signed int32
    assert torch.equal(unpack_int4(w), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.int32))
    x = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(x)), x.to(torch.int32))


# -- a hand-built Hugging Face AWQ checkpoint ----------------------------------------------------

def _dense(lin: Int4Linear) -> torch.Tensor:
    """The weight an Int4Linear multiplies by, [out, in] (one-hot inputs: each output is one product)."""
    with torch.no_grad():
        return lin(torch.eye(lin.in_features)).t()


@pytest.mark.parametrize("group", [32, 64])
def test_hand_built_hf_awq_checkpoint_loads_exactly(tmp_path, group):
    want, sd = build_hf_awq_checkpoint(tmp_path / "awq", group)
    lm = load_model(str(tmp_path / "awq"), dtype="float32", with_tokenizer=False)
    hd = TINY["head_dim"]
    for i, layer in enumerate(lm.model.layers):
        assert all(isinstance(getattr(layer, n), Int4Linear) for n in FUSED)
        parts = {"qkv_proj": [("self_attn.q_proj", 4 * hd), ("self_attn.k_proj", 2 * hd), ("self_attn.v_proj", 2 * hd)],
                 "o_proj": [("self_attn.o_proj", None)],
                 "gate_up_proj": [("mlp.gate_proj", 128), ("mlp.up_proj", 128)], "down_proj": [("mlp.down_proj", None)]}
        for fused, names in parts.items():
            w = torch.cat([want[f"{i}.{n}"] for n, _ in names])
            assert torch.equal(_dense(getattr(layer, fused)).double(), w), (i, fused)
        assert torch.equal(layer.input_layernorm.weight, sd[f"model.layers.{i}.input_layernorm.weight"].float())
    assert torch.equal(lm.model.lm_head.weight, sd["lm_head.weight"].float())
    assert not lm.config.tie_word_embeddings

    # the same model with plain float weights (the intended ones) gives the same logits
    from inferd.loading.loader import build_model

    plain = {k.replace("model.", "").replace("self_attn.", "").replace("mlp.", ""): v.float()
             for k, v in sd.items() if not k.endswith(("qweight", "qzeros", "scales"))}
    for k, v in want.items():
        i, name = k.split(".", 1)
        plain[f"layers.{i}.{name.split('.')[1]}.weight"] = v.float()
    ref = build_model(lm.config, plain, torch.float32, torch.device("cpu"))
    ids = [5, 17, 300, 42, 7, 99, 511, 0]
    torch.testing.assert_close(logits(lm.model, ids), logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_hand_built_checkpoint_bf16_serves(tmp_path):
    build_hf_awq_checkpoint(tmp_path / "awq", 32)
    lm = load_model(str(tmp_path / "awq"), dtype="bfloat16", with_tokenizer=False, quantization="awq")
    ref = load_model(str(tmp_path / "awq"), dtype="float32", with_tokenizer=False)
    a, b = logits(lm.model, [1, 2, 3, 4]), logits(ref.model, [1, 2, 3, 4])
    assert ((a - b).abs().max() / b.abs().max()) < 0.05


def test_awq_checkpoint_bad_inputs(tmp_path):
    from inferd.errors import InferdError

    build_hf_awq_checkpoint(tmp_path / "awq", 32)
    with pytest.raises(InferdError, match="AWQ checkpoint"):
        load_model(str(tmp_path / "awq"), dtype="float32", with_tokenizer=False, quantization="int4")
    for over, msg in [({"bits": 8}, "4-bit"), ({"version": "gemv"}, "GEMM"), ({"group_size": 16}, "group size")]:
        cfg = hf_awq_config(32)
        cfg["quantization_config"].update(over)
        (tmp_path / "awq" / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InferdError, match=msg):
            load_model(str(tmp_path / "awq"), dtype="float32", with_tokenizer=False)
    with pytest.raises(InferdError, match="needs an AWQ checkpoint"):
        load_model(None, dtype="float32", with_tokenizer=False, quantization="awq", load_format="dummy")


# -- the search -------------------------------------------------------------------------------

def test_int_grid_covers_and_fake_quant_matches_codes():
    g = torch.Generator().manual_seed(0)
    lo, hi = -torch.rand(2000, generator=g), torch.rand(2000, generator=g)
    lo[:5], hi[5:10] = 0, 0
    s, z = int_grid(lo, hi)
    step = s.float()
    assert int(z.min()) >= 0 and int(z.max()) <= 15
    # the covering grid: a brute force over every zero point finds no smaller step (before fp16)
    zs = torch.arange(16.0)
    inf = float("inf")
    need = torch.maximum(torch.where(zs > 0, -lo[:, None] / zs.clamp(min=1), torch.where(lo[:, None] < 0, inf, 0.0)),
                         torch.where(zs < 15, hi[:, None] / (15 - zs).clamp(min=1), torch.where(hi[:, None] > 0, inf, 0.0)))
    assert torch.equal(step, need.min(-1).values.clamp(min=2**-14).half().float())
    w = torch.randn(32, 128, generator=g)
    q, z, s = quantize_groups(w, 64)
    assert torch.equal(fake_quant(w, 64), dequantize(q, z, s, 64))
    assert (dequantize(q, z, s, 64) - w).abs().max() <= s.float().max() / 2 * 1.01


def test_output_error_from_second_moments():
    g = torch.Generator().manual_seed(1)
    x, d = torch.randn(300, 48, generator=g), torch.randn(20, 48, generator=g)
    h = x.t() @ x / 300
    assert abs(output_error(d, h) - float(((x @ d.t()) ** 2).sum(1).mean())) < 1e-3 * output_error(d, h)


def _calib(n=16, t=64, vocab=512, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("group", [32, 64])
def test_search_beats_round_to_nearest_on_every_layer(group):
    """Per linear, the calibration output error of the AWQ codes (scale and clip searched, folded
    scales included) against the float layer is below plain min/max int4 at the same group size."""
    lm = make_tiny_model()
    res = awq_quantize(lm.model, _calib(), group)
    assert len(res.reports) == 2
    for i, r in enumerate(res.reports):
        for n in FUSED:
            assert r.awq[n] < r.rtn[n], (i, n, r.awq[n], r.rtn[n])
    print(res.summary())


def test_awq_model_closer_to_float_than_rtn():
    """On held-out tokens the AWQ model's distributions stay nearer the float model's than RTN's."""
    ref = make_tiny_model().model
    rtn = make_tiny_model().model
    from inferd.quant import quantize

    quantize(rtn, "int4", 32)
    awq = make_tiny_model().model
    attach(awq, awq_quantize(awq, _calib(), 32).codes, 32)
    kl = {}
    for name, m in (("rtn", rtn), ("awq", awq)):
        tot = 0.0
        for seq in _calib(4, 64, seed=7):
            p, q = torch.log_softmax(logits(ref, seq), -1), torch.log_softmax(logits(m, seq), -1)
            tot += float((p.exp() * (p - q)).sum(-1).mean())
        kl[name] = tot
    assert kl["awq"] < kl["rtn"], kl


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_save_load_same_logits(tmp_path, arch):
    """In-memory AWQ model == the folder it saves, loaded back (Qwen2: the v bias takes o's scale)."""
    over = {"architecture": "qwen2", "attention_bias": True} if arch == "qwen2" else {}
    lm = make_tiny_model(**over)
    if arch == "qwen2":
        with torch.no_grad():
            lm.model.layers[0].qkv_proj.bias.normal_(0, 0.5)
    res = awq_quantize(lm.model, _calib(), 32)
    attach(lm.model, res.codes, 32)
    save_awq(str(tmp_path / "out"), lm.model, res.codes, 32)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm"}
    back = load_model(str(tmp_path / "out"), dtype="float32", with_tokenizer=False)
    ids = _calib(1, 40, seed=3)[0]
    assert torch.equal(logits(lm.model, ids), logits(back.model, ids))


def test_awq_keeps_the_float_function_before_rounding():
    """The folds alone (scales into norms, v and up rows) leave the model's function unchanged:
    with the codes replaced by the scaled float weights, logits match the original model."""
    from inferd.quant import awq as A

    ref = make_tiny_model().model
    A._round_floats_fp16(ref)  # the checkpoint's fp16 embeddings and norms, minus the scale folds
    m = make_tiny_model().model
    captured = {}
    orig = A.search_codes

    def spy(w, h, group_size, shrinks=(1.0,)):  # the final quantization sees the folded float weight
        captured[id(w)] = w
        return orig(w, h, group_size, shrinks)


    A.search_codes = spy
    try:
        res = awq_quantize(m, _calib(), 32, clip=False)
    finally:
        A.search_codes = orig
    ws = list(captured.values())
    assert len(ws) == 8
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            for j, n in enumerate(FUSED):
                getattr(layer, n).weight.copy_(ws[4 * i + j])
    ids = _calib(1, 32, seed=5)[0]
    torch.testing.assert_close(logits(m, ids), logits(ref, ids), atol=1e-4, rtol=1e-4)
    assert res.tokens == 16 * 64


# -- the command, the tokenizer, the server ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_gguf_path):
    """A tiny random Llama with the default model's tokenizer, as a Hugging Face folder."""
    from inferd.quant.awq_checkpoint import save_tokenizer
    from inferd.tokenizer import Tokenizer

    tok = Tokenizer.load(default_gguf_path)
    lm = make_tiny_model(vocab_size=tok.vocab_size, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-src")
    cfg = lm.config
    hd, nq, nk, ff = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": lm.model.embed_tokens.weight, "model.norm.weight": lm.model.norm.weight,
          "lm_head.weight": lm.model.lm_head.weight}
    for i, layer in enumerate(lm.model.layers):
        p = f"model.layers.{i}."
        for n, w in zip(("q_proj", "k_proj", "v_proj"), layer.qkv_proj.weight.split([nq * hd, nk * hd, nk * hd])):
            sd[p + "self_attn." + n + ".weight"] = w
        sd[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
        for n, w in zip(("gate_proj", "up_proj"), layer.gate_up_proj.weight.split([ff, ff])):
            sd[p + "mlp." + n + ".weight"] = w
        sd[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    from inferd.quant.awq_checkpoint import hf_config

    d = hf_config(cfg, 32)
    del d["quantization_config"]
    d["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(d))
    save_tokenizer(tok, str(folder), None)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_awq(tiny_folder, tmp_path_factory, wikitext_file):  # calibrated on WikiText-2: skipped without it
    out = str(tmp_path_factory.mktemp("tiny-awq") / "awq")
    r = run_cli("quantize", "--model", tiny_folder, "--method", "awq", "--group-size", "32", "--calib", "wikitext",
                "--calib-samples", "4", "--calib-seqlen", "128", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "0 of 8 linears not improved" in r.stdout, r.stdout
    return out


@pytest.mark.slow
def test_quantize_cli_writes_a_self_contained_folder(tiny_awq, tiny_folder, default_gguf_path):
    from inferd.tokenizer import Tokenizer

    files = set(os.listdir(tiny_awq))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    qc = json.loads(open(os.path.join(tiny_awq, "config.json")).read())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["zero_point"], qc["version"]) == ("awq", 4, 32, True, "gemm")
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_awq, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.qweight").shape == (64, 64 // 8)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.qzeros").shape == (64 // 32, 64 // 8)
        assert f.get_tensor("model.layers.0.mlp.down_proj.scales").dtype == torch.float16
    assert "model.layers.1.mlp.up_proj.qweight" in keys and not any(k.endswith("gate_up_proj.qweight") for k in keys)
    # the tokenizer written from GGUF metadata is the GGUF's
    a, b = Tokenizer.load(default_gguf_path), Tokenizer.load(tiny_awq)
    text = "Hello world! 3.14159 café 你好 <|im_start|>user\nhi<|im_end|>"
    assert a.encode(text) == b.encode(text)
    assert a.eos_token_ids == b.eos_token_ids and a.bos_token_id == b.bos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs, tokenize=True) == b.apply_chat_template(msgs, tokenize=True)
    r = run_cli("generate", "--model", tiny_awq, "--prompt", "The capital of France is", "--max-tokens", "4",
                "--temperature", "0", "--dtype", "float32")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_quantize_cli_bad_inputs(tiny_folder, tiny_awq, tmp_path):
    assert_one_line_error(run_cli("quantize", "--model", tiny_folder, "--group-size", "48", "--out", str(tmp_path / "a")),
                          "group size")
    assert_one_line_error(run_cli("quantize", "--model", tiny_folder, "--out", tiny_awq), "not empty")
    assert_one_line_error(run_cli("quantize", "--model", tiny_folder, "--calib", str(tmp_path / "none.txt"),
                                  "--out", str(tmp_path / "b")), "calibration text not found")
    assert_one_line_error(run_cli("quantize", "--model", tiny_folder, "--calib-samples", "0", "--out", str(tmp_path / "c")),
                          "--calib-samples")
    assert_one_line_error(run_cli("generate", "--model", tiny_folder, "--quantization", "awq", "--prompt", "x"),
                          "needs an AWQ checkpoint")
    assert_one_line_error(run_cli("generate", "--model", tiny_awq, "--quantization", "int4", "--prompt", "x"),
                          "AWQ checkpoint")
    assert_one_line_error(run_cli("eval", "--model", tiny_folder, "--quantization", "int4", "--awq-path", tiny_awq),
                          "--awq-path")


@pytest.mark.slow
def test_quantize_cli_custom_calibration_text(tiny_folder, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    r = run_cli("quantize", "--model", tiny_folder, "--group-size", "64", "--calib", str(text), "--calib-samples", "2",
                "--calib-seqlen", "64", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["group_size"] == 64


@pytest.mark.slow
def test_eval_awq_config(tiny_folder, tiny_awq):
    """`inferd eval` with awq: in-memory calibration and a saved folder, same windows, same reference."""
    from inferd.eval import run_eval

    res = run_eval(tiny_folder, ["int4", "awq"], group_size=32, ctx=32, windows=2, dtype="float32", speed=False,
                   continuation_tokens=2)
    names = [r["config"] for r in res["configs"]]
    assert names == ["int4 g32 float32 act", "awq g32 float32 act"]
    res2 = run_eval(tiny_folder, ["awq"], group_size=32, ctx=32, windows=2, dtype="float32", speed=False,
                    continuation_tokens=2, awq_path=tiny_awq)
    # 4 x 128 calibration tokens in the folder vs 32 x 512 in memory: different codes, both finite
    assert res2["configs"][0]["config"] == "awq g32 float32 act" and res2["configs"][0]["mean_kl"] > 0
    assert res2["reference"]["perplexity"] == res["reference"]["perplexity"]


@pytest.mark.slow
def test_saved_awq_folder_serves(tiny_awq):
    """`inferd serve --model AWQ_FOLDER`: /v1/completions gives the offline engine's greedy text."""
    from inferd.engine.reference import reference_generate

    from conftest import running_server

    with running_server(["--model", tiny_awq, "--dtype", "float32", "--quantization", "awq", "--host", "127.0.0.1",
                         "--kv-cache-memory", "64MiB"]) as url:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        prompt = "The capital of France is"
        r = httpx.post(url + "/v1/completions", json={"model": models[0]["id"], "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8
        lm = load_model(tiny_awq, dtype="float32")
        ids = reference_generate(lm.model, lm.tokenizer.encode(prompt), 8).token_ids
        assert body["choices"][0]["text"] == lm.tokenizer.decode(ids)
