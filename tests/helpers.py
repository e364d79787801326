"""Helpers the test modules share (workloads, engine runs with leak checks, a hand-built AWQ
folder). Test modules import from here or from conftest, never from each other."""
import json
import os
import random
import time

import torch
from safetensors.torch import save_file

from inferd.engine.engine import LLMEngine
from inferd.engine.reference import reference_generate
from inferd.engine.request import SamplingParams

# -- engine workloads and runs ---------------------------------------------------------------------

N_REQ = 64


def make_requests(seed=0, n=N_REQ, vocab=512, shared_prefixes=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(40, 200))] for _ in range(shared_prefixes)]
    reqs = []
    for i in range(n):
        if prefixes:
            pre = prefixes[i % len(prefixes)]
            prompt = pre + [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
        reqs.append((prompt, rng.randint(1, 64)))
    return reqs


def reference_outputs(model, reqs):
    outs = []
    for prompt, n in reqs:
        r = reference_generate(model, prompt, n, keep_logits=True)
        outs.append((r.token_ids, r.logits))
    return outs


# Logprobs of one request computed in two batch shapes (a prefix-cache hit that leaves fewer
# tokens to compute, another batch, chunked prefill, a served against an offline run) are fp32 sums
# taken in another order; on AVX2 and AVX-512 CPUs they differ in the last bits (2e-6 seen). Two
# such runs agree on token ids exactly and on logprob values within this.
LOGPROB_ATOL = 1e-4


def assert_logprobs_close(got, want, what: str = "logprobs", atol: float = LOGPROB_ATOL):
    """got and want alike in structure (lists, tuples, dicts, None), their ints and strings (token
    ids, ranks, token texts) equal, their floats (logprobs) within atol."""
    if isinstance(got, float) or isinstance(want, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), (what, got, want)
        assert abs(got - want) <= atol, f"{what}: {got!r} vs {want!r} (more than {atol} apart)"
    elif isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{what}: {len(got)} entries vs {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_logprobs_close(a, b, f"{what}[{i}]", atol)
    elif isinstance(got, dict) and isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for k in got:
            assert_logprobs_close(got[k], want[k], f"{what}[{k!r}]", atol)
    else:
        assert got == want, f"{what}: {got!r} vs {want!r}"


# -- the near-tie rule ------------------------------------------------------------------------------
# Two computations of one model in fp32 (a batch against one sequence, paged against contiguous
# attention, inferd against transformers) sum in different orders, so their greedy tokens may part
# where the reference's top-2 logits are within NEAR_TIE, and only there. Every comparison that allows
# that is one of the helpers below, each taking `max_ties`, the most cut sequences (or skipped
# positions) its caller accepts, and each checking that what was compared covers at least half of
# the reference's tokens: a regression that turned every sequence into a "tie" would otherwise pass.
# tests/test_suite_hygiene.py fails a test that applies the rule itself or calls these without a bound.
NEAR_TIE = 1e-4
NEAR_TIE_HELPERS = ("compare", "compare_by_gaps", "compare_texts", "compare_texts_by_gaps", "teacher_forced")


def top2_gap(row) -> float:
    """How far the best of a logits (or logprobs) row is ahead of the second (a tensor, or the
    values of a top-k list)."""
    top2 = torch.topk(torch.as_tensor(row, dtype=torch.float64), 2).values
    return float(top2[0] - top2[1])


def _within_bound(ties: int, max_ties: int, compared: int, total: int, what: str) -> int:
    assert ties <= max_ties, f"{what}: {ties} near ties, at most {max_ties} allowed"
    assert 2 * compared >= total, f"{what}: the comparison covered {compared} of {total} reference tokens"
    return ties


def compare_by_gaps(got, ref, *, max_ties: int, gap: float = NEAR_TIE, what: str = "greedy tokens") -> int:
    """got: token lists; ref: (token list, each position's top-2 gap) per sequence, the reference's.
    Equal, or equal up to a first difference at a position whose gap is under `gap`; returns how
    many sequences were cut so (at most max_ties)."""
    assert len(got) == len(ref), f"{what}: {len(got)} sequences, reference {len(ref)}"
    ties = compared = total = 0
    for i, (toks, (want, gaps)) in enumerate(zip(got, ref)):
        total += len(want)
        j = next((j for j, (a, b) in enumerate(zip(toks, want)) if a != b), None)
        if j is None:  # (after a cut the two may stop at different lengths, at an end-of-sequence token)
            assert len(toks) == len(want), f"{what}: sequence {i}: {len(toks)} tokens, reference {len(want)}"
            compared += len(want)
            continue
        assert gaps[j] < gap, f"{what}: sequence {i} differs at token {j}: {toks[j]} vs {want[j]} (gap {gaps[j]:.2e})"
        ties += 1
        compared += j
    return _within_bound(ties, max_ties, compared, total, what)


def compare(got, ref, *, max_ties: int, gap: float = NEAR_TIE, what: str = "greedy tokens") -> int:
    """Token lists against reference runs [(token ids, logits rows)]: equal, or equal up to the
    first step where the reference's top-2 logits are within `gap`. Returns how many sequences were
    cut short by such a near tie (at most max_ties)."""
    return compare_by_gaps(got, [(want, [top2_gap(r) for r in logits[:len(want)]]) for want, logits in ref],
                           max_ties=max_ties, gap=gap, what=what)


def teacher_forced(mine: torch.Tensor, ref: torch.Tensor, *, max_ties: int, start: int = 0, atol: float = 2e-4,
                   gap: float = NEAR_TIE, what: str = "teacher-forced argmax") -> int:
    """Logits of one sequence, ours against the reference's ([positions, vocab]): from `start` on our
    argmax is the reference's, or within `gap` (NEAR_TIE unless the caller states its own bound) of it
    in the reference's own logits (a skipped position, at most max_ties of them); every logit within
    atol. Returns the skipped positions."""
    ties = 0
    for t in range(start, ref.shape[0]):
        a, b = int(mine[t].argmax()), int(ref[t].argmax())
        if a != b:
            assert float(ref[t, b] - ref[t, a]) < gap, f"{what}: position {t}: {a} vs the reference's {b}"
            ties += 1
    n = ref.shape[0] - start
    _within_bound(ties, max_ties, n - ties, n, what)
    torch.testing.assert_close(mine, ref, atol=atol, rtol=0)
    return ties


def run_engine(loaded, reqs, keep_history=False, **opts):
    eng = LLMEngine(loaded=loaded, dtype="float32", **opts)
    eng.keep_history = keep_history
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in reqs]
    outs = {rid: [] for rid in rids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert_no_leaks(eng)
    return [outs[r] for r in rids], eng


def assert_no_leaks(eng):
    bm = eng.block_manager
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks and all(r == 0 for r in bm.ref)
    assert not eng.requests and not eng.scheduler.running and not eng.scheduler.waiting


def mixed_requests(seed=0, n=32, vocab=512):
    """Random prompts, shared-prefix prompts and copy-style prompts (a passage, then its start
    again), each with its own output length."""
    rng = random.Random(seed)
    reqs = make_requests(seed=seed, n=n // 2, vocab=vocab)
    for i in range(n - len(reqs)):
        passage = [rng.randrange(vocab) for _ in range(rng.randint(20, 80))]
        prompt = passage + [rng.randrange(vocab) for _ in range(rng.randint(0, 5))] + passage[:rng.randint(3, 12)]
        reqs.append((prompt, rng.randint(8, 48)))
    rng.shuffle(reqs)
    return reqs


def run_spec(loaded, reqs, params=None, **opts):
    eng = LLMEngine(loaded=loaded, dtype="float32", **opts)
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0) if params is None else params(n))
            for p, n in reqs]
    outs = {rid: [] for rid in rids}
    finish = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            assert o.output_ids[-len(o.new_token_ids):] == o.new_token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
        eng.block_manager.check_invariants(eng.scheduler.running)
    assert_no_leaks(eng)
    if eng.spec is not None and hasattr(eng.spec.proposer, "bm"):  # a draft model's own cache
        dbm = eng.spec.proposer.bm
        dbm.check_invariants([])
        assert dbm.num_free == dbm.num_blocks and not eng.spec.proposer.seqs
    return [outs[r] for r in rids], [finish[r] for r in rids], eng


def assert_speculated(eng, min_rate=0.0):
    s, sp = eng.stats, eng.spec.stats
    print(sp.as_dict(), "tokens", s.generated_tokens, "target steps per sequence", s.sample_events)
    assert sp.num_draft_tokens > 0 and sp.num_accepted_tokens > 0
    assert s.sample_events < s.generated_tokens  # fewer target forwards than tokens
    assert sp.acceptance_rate >= min_rate


FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def pack_by_hand(codes: torch.Tensor) -> torch.Tensor:
    """The GEMM word layout written out with Python integers (independent of pack_int4)."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows = []
    for r in codes.tolist():
        words = []
        for c in range(0, len(r), 8):
            v = sum(r[c + order[k]] << (4 * k) for k in range(8))
            words.append(v - 2**32 if v >= 2**31 else v)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def hf_awq_config(group, **over):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
         "torch_dtype": "float16",
         "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                 "version": "gemm"}}
    d.update(over)
    return d


def build_hf_awq_checkpoint(folder, group=32, seed=0):
    """Known integers for every linear -> a folder in the AutoAWQ GEMM layout; returns the
    intended dequantized torch-layout weights [out, in] (float64, exact) per HF linear name."""
    g = torch.Generator().manual_seed(seed)
    h, ff, hd = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    shapes = {"self_attn.q_proj": (4 * hd, h), "self_attn.k_proj": (2 * hd, h), "self_attn.v_proj": (2 * hd, h),
              "self_attn.o_proj": (h, 4 * hd), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h),
              "mlp.down_proj": (h, ff)}
    sd, want = {}, {}
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (n_out, n_in) in shapes.items():
            q = torch.randint(0, 16, (n_in, n_out), generator=g)  # [in, out]: the checkpoint's orientation
            z = torch.randint(0, 16, (n_in // group, n_out), generator=g)
            s = (torch.rand(n_in // group, n_out, generator=g) * 0.02 + 0.001).half()
            sd[p + name + ".qweight"] = pack_by_hand(q)
            sd[p + name + ".qzeros"] = pack_by_hand(z)
            sd[p + name + ".scales"] = s
            rep = lambda t: t.double().repeat_interleave(group, 0)  # noqa: E731  group row -> its input rows
            want[f"{i}.{name}"] = ((q.double() - rep(z)) * rep(s)).t()
        sd[p + "input_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
        sd[p + "post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
    sd["model.embed_tokens.weight"] = torch.randn(TINY["vocab_size"], h, generator=g).half()
    sd["model.norm.weight"] = torch.ones(h).half()
    sd["lm_head.weight"] = (0.1 * torch.randn(TINY["vocab_size"], h, generator=g)).half()
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_awq_config(group), f)
    return want, sd


def write_tiny_chat_gguf(path, n_layers=2, hidden=64, seed=0, qtype=None, types=None, ff=None, heads=4):
    """A tiny random Llama GGUF (2 layers, hidden 64) with SmolLM2's tokenizer and chat template
    copied from the embedded default: a served model whose requests finish in milliseconds.
    `qtype`: the matrices' GGUF type (default Q8_0); `types`: per tensor stem ("attn_v", "ffn_down",
    ...) a GGUF type name, K-quants (which gguf cannot quantize) as random blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter, quants

    from inferd.gguf_file import default_model_path

    src = GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    ff, nh, nkv = ff or 2 * hidden, heads, heads // 2
    hd = hidden // nh
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    rng = np.random.default_rng(seed)

    def add(name, shape, qt=qtype if qtype is not None else Q.Q8_0, norm=False):
        kind = (types or {}).get(name.split(".")[-2])
        if kind is not None and name.startswith("blk."):
            qt = Q[kind]
            if qt.name.endswith("_K") or qt.name == "IQ4_XS":
                from test_gguf_blocks import random_blocks

                w.add_tensor(name, random_blocks(kind, *shape, seed=len(w.tensors[0]) if w.tensors else 0), raw_dtype=qt)
                return
        arr = (1 + 0.1 * rng.standard_normal(shape)) if norm else 0.5 * rng.standard_normal(shape)
        arr = arr.astype(np.float32)
        if qt == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,), Q.F32, norm=True)
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (hidden,), Q.F32, norm=True)
        add(p + "ffn_norm.weight", (hidden,), Q.F32, norm=True)
        add(p + "attn_q.weight", (nh * hd, hidden))
        add(p + "attn_k.weight", (nkv * hd, hidden))
        add(p + "attn_v.weight", (nkv * hd, hidden))
        add(p + "attn_output.weight", (hidden, nh * hd))
        add(p + "ffn_gate.weight", (ff, hidden))
        add(p + "ffn_up.weight", (ff, hidden))
        add(p + "ffn_down.weight", (hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# A Qwen3-style chat template of our own: ChatML, an assistant turn's reasoning in <think> tags,
# and enable_thinking=false writing the empty think block into the prompt (as Qwen3's does).
THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINKING_REASONING, THINKING_ANSWER = "Let me think.", "Hello!"


def write_tiny_thinking_gguf(path, hidden=64):
    """A tiny thinking model whose greedy output is `<think>Let me think.</think>\n\nHello!`, then
    <|im_end|>, after any prompt its template ends (with thinking off, `Hello!` alone): SmolLM2's
    tokenizer plus `<think>` and `</think>` as single (user-defined) tokens, and one layer whose
    attention and MLP write nothing, so each next token is a function of the last one alone: the
    output matrix maps each token of the chain to the next. The engine runs it like any model, so
    the reasoning parser is exercised on the engine's real output."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from inferd.gguf_file import default_model_path, read_gguf_metadata
    from inferd.tokenizer import Tokenizer

    src = GGUFReader(default_model_path())
    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    tokens = [str(t) for t in src.fields["tokenizer.ggml.tokens"].contents()] + ["<think>", "</think>"]
    types = list(src.fields["tokenizer.ggml.token_type"].contents()) + [4, 4]  # user-defined: kept in text
    think, end_think = len(tokens) - 2, len(tokens) - 1
    vocab = len(tokens)

    def one(text):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    chain = [one("\n"), think, one("Let"), one(" me"), one(" think"), one("."), end_think, one("\n\n"),
             one("Hello"), one("!"), tok.eos_token_id]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                       "tokenizer.chat_template"):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_chat_template(THINKING_TEMPLATE)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    out = np.zeros((vocab, hidden), np.float32)
    for a, b in zip(chain, chain[1:]):
        out[b] = 10 * emb[a] / np.linalg.norm(emb[a])
    ones, hd = np.ones(hidden, np.float32), hidden // 4
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", out)
    p = "blk.0."
    w.add_tensor(p + "attn_norm.weight", ones)
    w.add_tensor(p + "ffn_norm.weight", ones)
    w.add_tensor(p + "attn_q.weight", 0.1 * rng.standard_normal((hidden, hidden)).astype(np.float32))
    w.add_tensor(p + "attn_k.weight", 0.1 * rng.standard_normal((2 * hd, hidden)).astype(np.float32))
    w.add_tensor(p + "attn_v.weight", 0.1 * rng.standard_normal((2 * hd, hidden)).astype(np.float32))
    w.add_tensor(p + "attn_output.weight", np.zeros((hidden, hidden), np.float32))  # attention adds nothing
    w.add_tensor(p + "ffn_gate.weight", 0.1 * rng.standard_normal((2 * hidden, hidden)).astype(np.float32))
    w.add_tensor(p + "ffn_up.weight", 0.1 * rng.standard_normal((2 * hidden, hidden)).astype(np.float32))
    w.add_tensor(p + "ffn_down.weight", np.zeros((hidden, 2 * hidden), np.float32))  # nor does the MLP
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def wait_until(predicate, timeout: float = 20, what: str = "condition"):
    """Poll predicate() every 0.1 s until it holds; fails the test naming `what` after `timeout` s.
    Wait on the condition a test depends on, never for a guessed time: a loaded machine only makes
    this slower, not wrong."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


_GGUF_READERS: dict = {}


def _read_gguf_once() -> None:
    """transformers builds a new `gguf.GGUFReader` for each object it makes from a GGUF (the config
    and the tokenizer's twice, the model again): five parses of the header for a tokenizer and a
    model, ~7 s each for Gemma 3's 262k-token vocabulary. A reader maps the file read-only and is
    never written through, so one per file (and size and mtime) serves the whole session; the
    oracle still reads the file with the `gguf` package's own code."""
    import gguf

    if getattr(gguf.GGUFReader, "inferd_tests_once", False):
        return
    real = gguf.GGUFReader

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real(path, mode)
        return _GGUF_READERS[key]

    reader.inferd_tests_once = True
    gguf.GGUFReader = reader  # transformers imports it from the package at each load


_HF_TOKENIZERS: dict = {}


def hf_gguf_tokenizer(path: str):
    """transformers' tokenizer of a GGUF file, built once a session (a tokenizer keeps no state
    between calls: the modules that check against it share it)."""
    import transformers

    _read_gguf_once()
    if path not in _HF_TOKENIZERS:
        d, f = os.path.split(path)
        _HF_TOKENIZERS[path] = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return _HF_TOKENIZERS[path]


def hf_gguf_model(path: str):
    """transformers' float32 model of a GGUF file, a new one each call (peft merges into it), read
    through the session's one parse of the file."""
    import torch
    import transformers

    _read_gguf_once()
    d, f = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def wait_for_log(read, text: str, timeout: float = 60) -> str:
    """Until the log `read()` returns holds `text`; returns that log. A line another process writes
    (the engine core, a rank, a Ray worker) may land after the server already answers: read the log
    for a line only through this, never once. Fails naming the line and showing the log's tail."""
    deadline = time.monotonic() + timeout
    while True:
        log = read()
        if text in log:
            return log
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for the log line {text!r}; "
                                 f"the log ends:\n{log[-3000:]}")
        time.sleep(0.1)


def engine_socket_dirs(pid: int, where: str | None = None) -> list[str]:
    """The directories holding the engine sockets of server process `pid` under `where` (the
    temporary directory): inferd-core-PID-... (inferd.distributed.tmpdirs)."""
    import tempfile

    where = where or tempfile.gettempdir()
    return sorted(n for n in os.listdir(where) if n.startswith(f"inferd-core-{pid}-"))


def compare_texts_by_gaps(texts, refs, tok, *, max_ties: int, gap: float = NEAR_TIE, what: str = "texts") -> int:
    """Texts against reference runs [(token ids, each position's top-2 gap)]: equal, or equal up to
    the first reference token k whose text is no longer a prefix of ours, where a gap at or before k
    is under `gap` (the tokens may part before their texts do: two spellings of one text). Returns
    how many were cut so (at most max_ties)."""
    ties = compared = total = 0
    for i, (ids, gaps) in enumerate(refs):
        def text(part):  # a character cut in half at the end is no difference yet
            return tok.decode(part, skip_special_tokens=True).rstrip("\ufffd")

        total += len(ids)
        if texts[i] == tok.decode(ids, skip_special_tokens=True):
            compared += len(ids)
            continue
        k = next((k for k in range(len(ids)) if not texts[i].startswith(text(ids[:k + 1]))), len(ids) - 1)
        assert any(g < gap for g in gaps[:k + 1]), \
            f"{what}: {i}: {texts[i]!r} vs {text(ids)!r}, no near tie by token {k}"
        ties += 1
        compared += k
    return _within_bound(ties, max_ties, compared, total, what)


def compare_texts(texts, refs, tok, *, max_ties: int) -> int:
    """Served texts against reference runs [(token ids, logits rows)]: compare_texts_by_gaps with
    the reference's top-2 logit gaps."""
    return compare_texts_by_gaps(texts, [(ids, [top2_gap(r) for r in logits[:len(ids)]]) for ids, logits in refs],
                                 tok, max_ties=max_ties)


def wait_up(base: str, seconds: float = 120) -> None:
    """Until `base`/health answers 200 (a server another process started); exits the process
    (these are client scripts) with one line when it never does."""
    import sys

    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"{base} never came up")


def stream_then_kill(base: str, body: dict, pid: int, after: int = 3) -> list[str]:
    """Stream a completion, SIGKILL `pid` once `after` events have arrived; the stream's events."""
    import signal

    import httpx

    events = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == after:
                    os.kill(pid, signal.SIGKILL)
    return events


def check_on_every_variant(layer, x, want, bound, tol, rows):
    """Run `layer` on x under every kernel variant this CPU runs: within tol * bound of `want`, the
    first m rows alone (m in `rows`) and a single row the same floats as in the whole batch, and every
    variant the same floats as the first."""
    import torch

    from inferd.kernels import native

    before = native.use_isa("auto")
    got = {}
    try:
        for isa in native.ops().runnable_isas():
            native.use_isa(isa)
            y = layer(x)
            assert ((y - want).abs() <= tol * bound + 1e-7).all(), (isa, float(((y - want).abs() / bound).max()))
            for m in rows:  # the first m rows alone: the same floats as in the batch
                assert torch.equal(layer(x[:m]), y[:m]), (isa, m)
            assert torch.equal(layer(x[5:6]), y[5:6])  # a row's place in the batch does not matter either
            got[isa] = y
    finally:
        native.use_isa(before)
    first = next(iter(got.values()))
    assert all(torch.equal(y, first) for y in got.values()), "the variants computed different floats"


def tp_greedy(path, tp, prompts, max_tokens, formats):
    """Greedy tokens of `prompts` from an engine on `path` (--quantization auto) split over `tp`
    ranks, after checking its weight formats are `formats`."""
    from inferd.engine.engine import LLMEngine
    from inferd.engine.paths import engine_paths
    from inferd.engine.request import SamplingParams

    eng = LLMEngine(model=str(path), quantization="auto", tensor_parallel_size=tp, kv_cache_memory="16MiB")
    try:
        reqs = [eng.requests[eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
                for p in prompts]
        while eng.has_unfinished():
            eng.step()
        paths = engine_paths(eng)
        assert paths["weight_formats"] == formats and paths["tensor_parallel_size"] == tp, paths
        return [list(r.output_ids) for r in reqs]
    finally:
        eng.close()


def run_recording(eng, reqs):
    """Greedy outputs of `reqs` with the logits each token was sampled from, per request: the form
    `compare_texts` takes as its reference (no speculation: one sampled row per request and step)."""
    rows: dict = {}
    execute = eng.runner.execute

    def keep(requests, num_new):  # the logits rank 0 samples from, as they leave the runner
        out = execute(requests, num_new)
        for j, i in enumerate(out[1]):
            rows.setdefault(requests[i].request_id, []).append(out[0][j].clone())
        return out
    eng.runner.execute = keep
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in reqs]
    outs = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [(outs[r], torch.stack(rows[r])) for r in rids]


# -- two machines on one: network namespaces joined by a veth pair ----------------------------------

def netns_unavailable() -> str | None:
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` for network namespaces"
    probe = f"inferd-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """Namespaces `a` and `b` (addresses `ip_a`, `ip_b`; veth ends `dev_a`, `dev_b`), each with its
    loopback up; `run(ns, argv)` starts a process in one. Everything started and both namespaces
    go at `close()`."""

    def __init__(self, tag: str = "x"):
        import subprocess

        n = os.getpid() % 10000
        self.a, self.b, self.dev_a, self.dev_b = f"inferd-{tag}a{n}", f"inferd-{tag}b{n}", f"if{tag}a{n}", f"if{tag}b{n}"
        net = 200 + (os.getpid() + sum(map(ord, tag))) % 50
        self.ip_a, self.ip_b = f"10.231.{net}.1", f"10.231.{net}.2"
        self.procs = []

        def sh(*c):
            subprocess.run(c, check=True, capture_output=True)
        try:
            sh("ip", "netns", "add", self.a)
            sh("ip", "netns", "add", self.b)
            sh("ip", "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            for ns, dev, ip in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def run(self, ns: str, argv: list[str], log=None, env=None, **kw):
        import subprocess

        kw.setdefault("stderr", subprocess.STDOUT if log else None)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, env=env, **kw)
        self.procs.append(p)
        return p

    def close(self):
        import signal
        import subprocess

        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
