"""Files made by llama.cpp's own `llama-quantize` (Q4_K_M: Q4_K beside Q6_K, as people download them),
one per kind of layout the loader must get right: a biased Qwen2 whose fused q/k/v mixes types, a
mixture of experts (3-D expert tensors), Phi-3's fused attn_qkv and ffn_up, and Gemma 3 (norms stored
as 1 + w, a tied table). Each is served by default from its blocks; its dense route equals
`transformers` on the very weights gguf's own dequantizer gives (tests/hf_to_gguf.read_into: never
inferd's loader); its default int8-activation route stays within a stated KL and top-1 of that.
The files and their configs live in tests/data/quantized (regenerate.py remakes them)."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import teacher_forced  # noqa: E402
from hf_to_gguf import read_into  # noqa: E402

from inferd.engine.paths import weight_formats  # noqa: E402
from inferd.loading.loader import load_model  # noqa: E402
from inferd.model.layers import ContiguousKV  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quantized")
FILES = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "mixtral": ("MixtralForCausalLM", "llama"),
         "phi3": ("Phi3ForCausalLM", "phi3"), "gemma3": ("Gemma3ForCausalLM", "gemma3")}
MAX_TIES = 2  # of 48 positions
# the default route rounds activations to int8 per 32-block: a lossy path, bounded here and judged by
# `inferd eval` on real models (these widened random ones have sharper logits than real ones). A
# mixture of experts' router sees the rounded hidden state, and a flipped expert choice moves a
# position's logits wholesale: its top-1 bound is lower
KL_BOUND = 0.05
TOP1_BOUND = {"mixtral": 0.85}
TOP1_DEFAULT = 0.9


def path_of(name):
    return os.path.join(HERE, f"{name}-Q4_K_M.gguf")


def oracle(name):
    """transformers' model of the file: its config, gguf's dequantized weights."""
    cls, arch = FILES[name]
    with open(os.path.join(HERE, f"{name}.json")) as f:
        cfg_dict = json.load(f)
    cfg = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    hf = getattr(transformers, cls)(cfg).eval()
    read_into(hf, path_of(name), arch)
    return hf


def our_logits(model, ids):
    cache = ContiguousKV(model.cfg, len(ids), torch.float32, torch.device("cpu"))
    pos = torch.arange(len(ids))
    cache.set_positions(pos)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, cache))


@pytest.fixture(scope="module", params=list(FILES))
def case(request):
    name = request.param
    hf = oracle(name)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, hf.config.vocab_size, (1, 8), generator=g)
    with torch.no_grad():
        ids = hf.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0]
        ref = hf(ids[None]).logits[0].float()
    return name, ids, ref


def test_the_files_mix_k_quant_types():
    """llama-quantize's Q4_K_M really mixed types in every file: Q4_K beside Q6_K among the matrices."""
    from inferd.gguf_file import open_gguf

    for name in FILES:
        types = {t.tensor_type.name for t in open_gguf(path_of(name)).tensors if len(t.shape) >= 2}
        assert {"Q4_K", "Q6_K"} <= types, (name, types)


def test_served_by_default_from_their_blocks(case):
    """`auto` (what `inferd serve` does) builds every projection from the file's blocks: no dense
    projection, no dense fallback, the token table read in place."""
    name, ids, ref = case
    lm = load_model(path_of(name), quantization="auto", with_tokenizer=False)
    formats = weight_formats(lm.model)
    dense = formats.get("Linear", 0)
    routers = lm.config.num_hidden_layers if name == "mixtral" else 0  # the router stays float (vLLM's rule)
    assert dense == routers, formats
    assert lm.report["dense_fallback"] == {}, lm.report
    assert type(lm.model.embed_tokens).__name__ == "GGUFEmbedding"
    if name == "qwen2":  # the biased fused q/k/v whose parts differ in type: each part its kernel, one bias
        mixed = [x.qkv_proj for x in lm.model.layers if type(x.qkv_proj).__name__ == "FusedParts"]
        assert mixed and all(m.bias is not None for m in mixed)
    logits = our_logits(lm.model, ids)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
    print(f"{name}: mean KL {float(kl.mean()):.4f}, top-1 {float(top1):.3f}")
    assert float(kl.mean()) < KL_BOUND and float(top1) >= TOP1_BOUND.get(name, TOP1_DEFAULT)


def test_the_dense_route_equals_transformers(case):
    """`--quantization none --dtype float32`: the plan's names, row orders, fusions, expert slices and
    norm offsets give transformers' logits on gguf's own dequantized weights (teacher-forced; a
    different argmax only at a near tie, and those counted and bounded)."""
    name, ids, ref = case
    lm = load_model(path_of(name), quantization="none", dtype="float32", with_tokenizer=False)
    teacher_forced(our_logits(lm.model, ids), ref, max_ties=MAX_TIES, start=8, atol=2e-4, what=name)
