"""LoRA adapters (inferd.model.lora, inferd.worker.lora, inferd.loading.lora) held to `peft`: four
random adapters made by peft for the default model, each merged into it by peft + transformers as
the oracle; rows of several adapters and of the base model in one step; slots, the scheduler's
limit, prefix-cache isolation, and the refusals."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import assert_no_leaks, compare

from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "1, 1, 2, 3, 5, 8,"]
N_NEW = 10
# four shapes of adapter: some projections or all, ranks 4..16, rsLoRA, alpha != r
SPECS = [dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
         dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]),
         dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
         dict(r=8, lora_alpha=32, target_modules=["o_proj", "down_proj", "k_proj"])]
NAMES = [f"ad{i}" for i in range(len(SPECS))]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_gguf_path):
    """The four adapters' folders, and transformers' greedy tokens and logits for each prompt with
    each adapter merged by peft (None: the base model alone)."""
    from helpers import hf_gguf_model, hf_gguf_tokenizer

    tok, base = hf_gguf_tokenizer(default_gguf_path), hf_gguf_model(default_gguf_path)
    root = tmp_path_factory.mktemp("lora")
    paths, refs = {}, {}

    def greedy(model, key):
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([tok(p).input_ids])
                out = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True, pad_token_id=0)
                refs[(key, p)] = (out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores)[:, 0])

    greedy(base, None)
    for i, (name, spec) in enumerate(zip(NAMES, SPECS)):
        torch.manual_seed(100 + i)
        # init_lora_weights=False: B random too (peft's default B = 0 would make every adapter the base)
        m = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **spec))
        paths[name] = str(root / name)
        m.save_pretrained(paths[name])
        merged = m.merge_and_unload().eval()
        greedy(merged, name)
        del m, merged
    return paths, refs


def engine(paths, **kw) -> LLMEngine:
    opts = dict(dtype="float32", quantization="none", kv_cache_memory="96MiB",
                lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=4)
    opts.update(kw)
    return LLMEngine(**opts)


def run(eng, jobs) -> dict:
    """jobs: [(adapter or None, prompt)] submitted at once; their greedy tokens, by job index."""
    rids = [eng.add_request(p, SamplingParams(max_tokens=N_NEW, temperature=0), lora=a) for a, p in jobs]
    got = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    assert_no_leaks(eng)
    return {i: got[r] for i, r in enumerate(rids)}


def test_each_adapter_equals_peft_merged_with_all_in_shared_steps(adapters):
    """16 + concurrent requests over 4 adapters and the base, in shared steps: each sequence's
    greedy tokens are what transformers gives with that adapter merged by peft (fp32, near-tie rule);
    steps held several adapters, and one LoRA product ran per projection and layer, not per adapter."""
    paths, refs = adapters
    eng = engine(paths)
    jobs = [(a, p) for a in [None, *NAMES] for p in PROMPTS] * 2
    got = run(eng, jobs)
    compare([got[i] for i in range(len(jobs))], [refs[job] for job in jobs], max_ties=2, what="peft's greedy tokens")
    lora = eng.lora
    assert lora.multi_adapter_steps > 0 and lora.lora_steps > 0
    layers = eng.model_config.num_hidden_layers
    assert lora.applies_last == 7 * layers  # q k v o gate up down, once per layer, whatever the adapters
    assert eng.runner.lora_eager_steps + eng.runner.lora_fused_steps == lora.lora_steps
    # the adapters differ from the base and from each other (random B): the test can tell them apart
    outs = {job: tuple(got[i]) for i, job in enumerate(jobs)}
    assert len({outs[(a, PROMPTS[0])] for a in [None, *NAMES]}) == 5


def test_max_loras_two_with_four_adapters_queues_and_completes(adapters):
    paths, refs = adapters
    eng = engine(paths, max_loras=2)
    seen = []
    step = eng.runner.run

    def spy(plan):  # which adapter slots each step held
        seen.append({s for s in (plan.lora_slots or []) if s >= 0})
        return step(plan)

    eng.runner.run = spy
    jobs = [(a, PROMPTS[0]) for a in NAMES for _ in range(2)] + [(None, PROMPTS[1])]
    got = run(eng, jobs)
    compare([got[i] for i in range(len(jobs))], [refs[job] for job in jobs], max_ties=1, what="peft's greedy tokens")
    assert max(len(s) for s in seen) == 2  # never more than --max-loras adapters in a step
    assert eng.lora.slot_writes >= 4  # all four went through the two slots


def test_prefix_cache_hits_never_cross_adapters(adapters):
    paths, _ = adapters
    eng = engine(paths, block_size=4)
    prompt = "A long shared prompt that fills several KV blocks: " + "one two three four five six " * 3

    def hit(adapter) -> int:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0), lora=adapter)
        req = eng.requests[rid]
        while eng.has_unfinished():
            eng.step()
        return req.prefix_hit_tokens

    assert hit("ad0") == 0
    assert hit("ad1") == 0  # same tokens, other adapter: its own K/V
    assert hit(None) == 0  # nor the base model's
    assert hit("ad0") > 0 and hit(None) > 0 and hit("ad1") > 0  # each finds its own
    assert_no_leaks(eng)


def first_token_logits(eng, jobs) -> list[torch.Tensor]:
    """The logits each job's first token was sampled from (its prompt's last row), by job."""
    rows: dict = {}
    execute = eng.runner.execute

    def keep(requests, num_new):
        out = execute(requests, num_new)
        for k, i in enumerate(out[1]):
            rows.setdefault(requests[i].request_id, out[0][k].clone())
        return out
    eng.runner.execute = keep
    rids = [eng.add_request(p, SamplingParams(max_tokens=1, temperature=0), lora=a) for a, p in jobs]
    while eng.has_unfinished():
        eng.step()
    eng.runner.execute = execute
    return [rows[r] for r in rids]


def kl(want: torch.Tensor, got: torch.Tensor) -> float:
    """KL(want || got) of the two logits rows' distributions (want's -inf entries weigh nothing)."""
    lp, lq = torch.log_softmax(want.double(), -1), torch.log_softmax(got.double(), -1)
    p = lp.exp()
    return float(torch.where(p > 0, p * (lp - lq), 0.0).sum())


def test_adapters_over_a_quantized_base_in_the_fused_step(adapters):
    """The default serving path (GGUF blocks, int8 activations) with adapters: decode steps with
    adapter rows run as one C++ call that adds the same deltas after the same layers, so its tokens
    equal the eager forward's exactly. Against peft-merged in fp32 the int8 activations are lossy, so
    the bound is on the first token's distribution: within KL 0.05 of peft's for every job (measured
    0.0003-0.025; the W4A8 base alone is 0.003 mean, 0.013 p99 KL from the dense model on WikiText,
    README), and for an adapter under a quarter of the KL its own deltas put between peft's and the
    base's (0.06-4.7): an adapter left out, or applied to the wrong rows, fails. The quality over
    longer outputs is benchmarks/lora.py's."""
    paths, refs = adapters
    jobs = [(a, p) for a in [None, *NAMES] for p in PROMPTS]
    eng = engine(paths, quantization="auto", dtype="auto")
    got = run(eng, jobs)
    assert type(eng.model.layers[0].qkv_proj.lora_base).__name__ != "Linear"  # the quantized layer, wrapped
    assert eng.runner.lora_fused_steps > 0 and eng.lora.multi_adapter_steps > 0
    eager = engine(paths, quantization="auto", dtype="auto", enforce_eager=True)
    assert run(eager, jobs) == got and eager.runner.lora_fused_steps == 0
    firsts = first_token_logits(eng, jobs)
    kls = {}
    for (a, p), row in zip(jobs, firsts):
        want = refs[(a, p)][1][0]
        kls[(a, p)] = ours, base = kl(want, row), kl(want, refs[(None, p)][1][0])
        print(f"{a} {p!r}: KL from peft-merged {ours:.4f}, the adapter's own from the base {base:.4f}")
    for (a, p), (ours, base) in kls.items():
        assert ours < 0.05, (a, p, ours)
        assert a is None or ours < base / 4, (a, p, ours, base)  # nearer peft's than the base's, by far


def test_runtime_load_unload_and_refusals(adapters, tmp_path):
    paths, refs = adapters
    eng = engine({"ad0": paths["ad0"]}, max_lora_rank=8)
    with pytest.raises(InferdError, match="rank 16 is over --max-lora-rank 8"):
        eng.control("load_lora", name="ad2", path=paths["ad2"])
    eng.control("load_lora", name="ad3", path=paths["ad3"])
    assert run(eng, [("ad3", PROMPTS[0])])[0] == refs[("ad3", PROMPTS[0])][0]
    with pytest.raises(InferdError, match="unknown LoRA adapter 'nope'"):
        eng.add_request("x", SamplingParams(max_tokens=1), lora="nope")
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0), lora="ad3")
    with pytest.raises(InferdError, match="1 requests in flight"):
        eng.control("unload_lora", name="ad3")
    eng.abort(rid)
    eng.control("unload_lora", name="ad3")
    assert eng.control("list_loras") == ["ad0"]
    # an adapter of another base model: its shapes say so
    bad = tmp_path / "other"
    bad.mkdir()
    conf = json.load(open(os.path.join(paths["ad0"], "adapter_config.json")))
    json.dump(conf, open(bad / "adapter_config.json", "w"))
    from safetensors.torch import load_file, save_file

    sd = {k: (v[:, :100].contiguous() if "lora_A" in k else v) for k, v in load_file(
        os.path.join(paths["ad0"], "adapter_model.safetensors")).items()}
    save_file(sd, str(bad / "adapter_model.safetensors"))
    with pytest.raises(InferdError, match="another base model"):
        eng.control("load_lora", name="other", path=str(bad))
    with pytest.raises(InferdError, match="no adapter_config.json"):
        eng.control("load_lora", name="empty", path=str(tmp_path))
    with pytest.raises(InferdError, match="without LoRA adapters"):
        LLMEngine(dtype="float32", quantization="none", kv_cache_memory="32MiB").control("list_loras")


def test_served_adapters_by_model_name_and_their_routes(adapters, tiny_chat_gguf):
    """`inferd serve --lora-modules` beside two `--model`s of different shapes: each adapter is served
    on the base it fits (the default model, not the tiny one); the official client names an adapter
    as its `model`; /v1/models lists adapters with their parent; vLLM's load/unload routes, with
    their refusals."""
    import threading

    import httpx
    import openai
    from conftest import ServerProc
    from helpers import wait_until

    paths, refs = adapters
    srv = ServerProc(["--model", "default", "--model", f"tiny={tiny_chat_gguf}", "--quantization", "none",
                      "--dtype", "float32", "--kv-cache-memory", "64MiB", "--threads", "1",
                      "--lora-modules", f"ad0={paths['ad0']}", f"ad1={paths['ad1']}", "--max-loras", "2",
                      "--max-lora-rank", "8"]).wait_ready()
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)

    def decode(ids):  # the server's own detokenizer (its tokenizer equals transformers': test_tokenizer.py)
        return httpx.post(srv.base + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    def text(model, prompt=PROMPTS[0]):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=N_NEW, temperature=0)
        assert r.model == model
        return r.choices[0].text

    try:
        cards = {c.id: c for c in client.models.list().data}
        assert {"ad0", "ad1", "default", "tiny"} <= set(cards)
        assert cards["ad0"].parent == cards["ad1"].parent == "default"
        for name in ("ad0", "ad1", None):
            want = decode(refs[(name, PROMPTS[0])][0])
            assert text(name or cards["ad0"].parent) == want, name
        with pytest.raises(openai.NotFoundError) as e:
            text("ad9")
        assert "ad0" in e.value.message and "ad1" in e.value.message
        r = httpx.post(srv.base + "/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": paths["ad2"]},
                       timeout=60)
        assert r.status_code == 400 and "over --max-lora-rank 8" in r.json()["error"]["message"]
        r = httpx.post(srv.base + "/v1/load_lora_adapter", json={"lora_name": "ad3", "lora_path": paths["ad3"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert text("ad3") == decode(refs[("ad3", PROMPTS[0])][0])
        done = {}

        def stream():  # a long request of ad3 in flight while its unload is asked for
            with httpx.stream("POST", srv.base + "/v1/completions", timeout=120,
                              json={"model": "ad3", "prompt": PROMPTS[1], "max_tokens": 100, "stream": True,
                                    "ignore_eos": True}) as resp:
                done["lines"] = [x for x in resp.iter_lines() if x.startswith("data: ")]

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: httpx.get(srv.base + "/v1/engine/state", params={"steps": 0}).json()["engines"][0]
                   .get("running"), 30, "the ad3 stream running")
        wait_until(lambda: 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="ad3"' in
                   httpx.get(srv.base + "/metrics").text, 30, "vLLM's LoRA gauge naming ad3 as running")
        r = httpx.post(srv.base + "/v1/unload_lora_adapter", json={"lora_name": "ad3"}, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_busy"
        t.join(120)
        assert done["lines"][-1] == "data: [DONE]" and len(done["lines"]) > 50  # not dropped
        r = httpx.post(srv.base + "/v1/unload_lora_adapter", json={"lora_name": "ad3"}, timeout=30)
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            text("ad3")
    finally:
        srv.stop()


def _tiny_adapter(folder, cfg, base=None, layers=(0,)):
    """A PEFT-format adapter of q_proj for a model of `cfg`'s shapes, written by hand (what the
    matching reads is the config and the header; peft itself writes the served one above)."""
    from safetensors.torch import save_file

    from inferd.loading.peft import projection_shapes

    os.makedirs(folder, exist_ok=True)
    n_in, n_out = projection_shapes(cfg)["q_proj"]
    sd = {}
    for i in layers:
        key = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        sd[f"{key}.lora_A.weight"] = torch.zeros(4, n_in)
        sd[f"{key}.lora_B.weight"] = torch.zeros(n_out, 4)
    save_file(sd, os.path.join(folder, "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    json.dump({**conf, **({"base_model_name_or_path": base} if base else {})},
              open(os.path.join(folder, "adapter_config.json"), "w"))
    return str(folder)


def test_flag_adapters_with_several_models_go_to_the_base_they_fit(adapters, tiny_chat_gguf, tmp_path):
    """Which model each --lora-modules adapter joins, decided at start from headers: by shape; between
    two models of one shape by the base its adapter_config.json names; refused in one line (exit 2)
    when it fits none, or several with none named."""
    import shutil
    import subprocess
    import sys

    from inferd.cli import build_parser
    from inferd.loading.peft import base_config
    from inferd.server.serve import model_specs

    paths, _ = adapters
    twin = str(tmp_path / "twin.gguf")
    shutil.copyfile(tiny_chat_gguf, twin)
    tiny = base_config(tiny_chat_gguf)
    named = _tiny_adapter(tmp_path / "named", tiny, base=twin)
    anonymous = _tiny_adapter(tmp_path / "anon", tiny, base="HuggingFaceTB/some-other-model")
    # an adapter of a third shape: the default's q_proj with 100 inputs
    alien = tmp_path / "alien"
    alien.mkdir()
    shutil.copyfile(os.path.join(paths["ad0"], "adapter_config.json"), alien / "adapter_config.json")
    from safetensors.torch import load_file, save_file

    save_file({k: (v[:, :100].contiguous() if "lora_A" in k else v) for k, v in load_file(
        os.path.join(paths["ad0"], "adapter_model.safetensors")).items()}, str(alien / "adapter_model.safetensors"))

    def specs(*argv):
        return {s.name: s.config.lora_modules for s in model_specs(build_parser().parse_args(["serve", *argv]))}

    got = specs("--model", "default", "--model", f"tiny={tiny_chat_gguf}", "--model", f"twin={twin}",
                "--lora-modules", f"ad0={paths['ad0']}", f"named={named}")
    assert got == {"default": [f"ad0={paths['ad0']}"], "tiny": None, "twin": [f"named={named}"]}
    with pytest.raises(InferdError, match=r"'anon' .* fits tiny, twin, and its adapter_config.json names none"):
        specs("--model", f"tiny={tiny_chat_gguf}", "--model", f"twin={twin}", "--lora-modules", f"anon={anonymous}")
    r = subprocess.run([sys.executable, "-m", "inferd", "serve", "--model", "default", "--model",
                        f"tiny={tiny_chat_gguf}", "--lora-modules", f"alien={alien}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'alien'" in r.stderr and "fits none of the served models" in r.stderr and "Traceback" not in r.stderr


def test_the_lora_kernel_on_every_variant():
    """inferd::lora_add_ against float64 (A then B per row and part), on every kernel variant this
    CPU runs: the same floats on each, and a row's delta independent of the batch around it."""
    from helpers import check_on_every_variant

    from inferd.kernels import native

    if native.ops() is None:
        pytest.skip(native.build_error() or "no native kernels")
    g = torch.Generator().manual_seed(0)
    S, R, K, parts = 3, 16, 576, [576, 192, 192]
    N = sum(parts)
    a = torch.randn(S, len(parts), R, K, generator=g)
    b = torch.randn(S, R, N, generator=g)
    ranks = torch.tensor([[16, 8, 0], [4, 4, 4], [16, 16, 16]])
    for s in range(S):
        for p in range(len(parts)):
            a[s, p, ranks[s, p]:] = 0
    T = 33
    x = torch.randn(T, K, generator=g)
    slots = torch.randint(-1, S, (T,), generator=g)
    want = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        s, off = int(slots[t]), 0
        for p, n in enumerate(parts):
            if s >= 0:
                bp = b[s].reshape(-1)[R * off:R * (off + n)].reshape(R, n).double()
                want[t, off:off + n] = (a[s, p].double() @ x[t].double()) @ bp
            off += n
    bound = float(x.abs().max()) * float(a.abs().max()) * float(b.abs().max()) * K * R

    def layer(xs):
        rows = slots[:xs.shape[0]] if xs.shape[0] == T or xs.data_ptr() == x.data_ptr() else slots[5:6]
        y = torch.zeros(xs.shape[0], N)
        native.ops().lora_add_(y, xs.contiguous(), a, b, rows.contiguous(), ranks, parts)
        return y

    check_on_every_variant(layer, x, want.float(), bound, 1e-6, rows=(1, 2, 7, 16))


def test_tensor_parallel_ranks_hold_their_share_of_each_adapter(adapters):
    """TP=2: A cut as the base layer's input (o, down), B as its output (q, k, v, gate, up); rank 0's
    slot writes repeated on rank 1; an adapter loaded at run time reaches both ranks. Tokens: peft's."""
    paths, refs = adapters
    eng = engine({n: paths[n] for n in NAMES[:3]}, tensor_parallel_size=2, max_loras=2)
    try:
        jobs = [(a, p) for a in [None, *NAMES[:3]] for p in PROMPTS]
        got = run(eng, jobs)
        compare([got[i] for i in range(len(jobs))], [refs[job] for job in jobs], max_ties=1,
                what="peft's greedy tokens")
        assert eng.lora.multi_adapter_steps > 0 and eng.lora.slot_writes >= 3
        eng.control("load_lora", name="ad3", path=paths["ad3"])
        compare([run(eng, [("ad3", PROMPTS[0])])[0]], [refs[("ad3", PROMPTS[0])]], max_ties=1)
    finally:
        eng.close()
