"""`inferd eval`: what a configuration's speed costs in quality, against the unaltered model.

The reference is the model as loaded, dequantized to fp32, no quantization. Every configuration
sees the same token windows of WikiText-2; per next-token position we compare its distribution
with the reference's over the full vocabulary in fp32:

  perplexity       exp(mean NLL of the true next token)
  KL(P_ref||P_cfg) sum_v p_ref(v) (log p_ref(v) - log p_cfg(v)), mean and p99 over positions
  top-1 agreement  share of positions whose argmax equals the reference's

With --kv-cache-dtype (e.g. bfloat16,int8), each configuration is also run with its KV cache in each
of those dtypes through the engine's paged attention (the kernels that read the cache in place: an
int8 cache quantized as written, exactly as served); against the reference, a row's numbers are then
the cost of the weights and the cache together. Rows after the first KV dtype also report their KL
and top-1 against that first one (the same weights): the cost of the cache alone.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from inferd.data import EVAL_TEXT_CHARS, wikitext_path  # noqa: F401  (wikitext_path: re-exported)
from inferd.errors import InferdError
from inferd.model.layers import ContiguousKV


def token_windows(ids: list[int], ctx: int, n: int, offset: int = 0) -> list[list[int]]:
    """n consecutive non-overlapping windows of ctx tokens, starting at token `offset`."""
    out = []
    for i in range(n):
        a = offset + i * ctx
        if a + ctx > len(ids):
            break
        out.append(ids[a:a + ctx])
    if not out:
        raise InferdError(f"text too short for one window of {ctx} tokens")
    return out


@torch.inference_mode()
def window_logprobs(model, window: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at every position, fp32 [ctx, vocab]."""
    cache = ContiguousKV(model.cfg, len(window), model.dtype, model.device)
    pos = torch.arange(len(window), device=model.device)
    cache.set_positions(pos)
    h = model(torch.tensor(window, device=model.device), pos, cache)
    return torch.log_softmax(model.compute_logits(h).float(), -1)


@torch.inference_mode()
def paged_window_logprobs(model, window: list[int], kv_dtype: str, block_size: int = 16) -> torch.Tensor:
    """window_logprobs through the serving attention: a paged KV cache of `kv_dtype` (an
    --kv-cache-dtype name) read in place by the kernels, the whole window one prefill chunk."""
    from inferd.model.config import attention_scale, attention_windows
    from inferd.worker.attention import PagedAttention
    from inferd.worker.kv_pool import KVPool, kv_cache_dtype, kv_layout

    cfg, n = model.cfg, len(window)
    windows = attention_windows(cfg, n)
    layout = kv_layout(windows, cfg.num_hidden_layers)
    nb = -(-n // block_size)
    pool = KVPool(layout.group_size, nb * layout.num_groups, block_size, cfg.num_key_value_heads, cfg.head_dim,
                  kv_cache_dtype(kv_dtype, model.dtype), model.device)
    attn = PagedAttention(pool, cfg.head_dim, windows, scale=attention_scale(cfg), layout=layout,
                          softcap=cfg.attn_logit_softcapping)
    tables = [list(range(g * nb, (g + 1) * nb)) for g in range(layout.num_groups)]
    pos = attn.prepare([tables[0]], [0], [n], [tables[1:]] if layout.num_groups > 1 else None).to(model.device)
    h = model(torch.tensor(window, device=model.device), pos, attn)
    if attn.fallback_calls:
        raise InferdError(f"the KV cache rows ran the torch fallback ({attn.fallback_why}), not the kernels")
    return torch.log_softmax(model.compute_logits(h).float(), -1)


def compare(ref_lp: torch.Tensor, cfg_lp: torch.Tensor, targets: torch.Tensor) -> dict:
    """Per-position quality numbers for one window (positions 0..ctx-2 predict tokens 1..ctx-1)."""
    ref_lp, cfg_lp = ref_lp[:-1], cfg_lp[:-1]
    kl = (ref_lp.exp() * (ref_lp - cfg_lp)).sum(-1)
    return {
        "nll": -cfg_lp.gather(-1, targets[:, None]).squeeze(-1),
        "kl": kl.clamp(min=0),
        "agree": (ref_lp.argmax(-1) == cfg_lp.argmax(-1)).float(),
    }


@dataclass
class Accumulator:
    nll: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    agree: list = field(default_factory=list)

    def add(self, d: dict):
        self.nll.append(d["nll"])
        self.kl.append(d["kl"])
        self.agree.append(d["agree"])

    def summary(self) -> dict:
        nll, kl, agree = torch.cat(self.nll), torch.cat(self.kl), torch.cat(self.agree)
        return {"perplexity": math.exp(float(nll.mean())), "mean_kl": float(kl.mean()),
                "p99_kl": float(torch.quantile(kl, 0.99)), "top1_agreement": float(agree.mean()),
                "positions": int(nll.numel())}


def decode_speed(loaded, batch: int, prompt_len: int = 64, out_len: int = 32, kv_cache_dtype: str = "auto") -> float:
    """Output tok/s of the engine on `batch` identical-length greedy requests (ignore_eos)."""
    from inferd.engine.rate import decode_rate

    return decode_rate(loaded, list(range(100, 100 + prompt_len)), out_len, batch, kv_cache_dtype=kv_cache_dtype)


FIXED_PROMPTS = [
    "The capital of France is",
    "Water is made of",
    "def add(a, b):",
    "The three laws of motion are",
    "Once upon a time, in a small village,",
]


def split_config(c: str) -> tuple[str, bool]:
    """'int4+a8' -> ('int4', True): the weight method, and whether activations go to int8 (W4A8)."""
    return (c[:-3], True) if c.endswith("+a8") else (c, False)


def run_eval(model: str | None, configs: list[str], group_size: int = 32, ctx: int = 512, windows: int = 64,
             dtype: str = "auto", quantize_lm_head: bool = False, speed: bool = True,
             text_path: str | None = None, continuation_tokens: int = 16, progress=None,
             speed_dtype: str = "auto", awq_path: str | None = None, kv_dtypes: list[str] | None = None,
             heads: list[str] | None = None) -> dict:
    """`kv_dtypes`: --kv-cache-dtype's list; "auto" (the default) is the plain row of each configuration
    (attention over a contiguous cache in the activations' dtype), any other a row through the paged
    cache in that dtype. `heads`: --lm-head-quantization's list ("none": the file's own output layer),
    each a load of every configuration; one of the two lists at a time."""
    from inferd.engine.reference import reference_generate
    from inferd.loading.loader import load_model, resolve_dtype
    from inferd.quant import weight_bytes

    ref = load_model(model, dtype="float32")
    tok = ref.tokenizer
    if tok is None:
        raise InferdError("evaluation needs a model with a tokenizer")
    with open(text_path or wikitext_path(), encoding="utf-8") as f:
        text = f.read()
    # the first 200k characters hold far more than 64 x 512 tokens; AWQ calibrates on text after them
    ids = tok.encode(text[:EVAL_TEXT_CHARS], add_special_tokens=False)
    wins = token_windows(ids, ctx, windows)
    if tok.add_bos and tok.bos_token_id is not None:
        # as llama.cpp's perplexity does: a model trained to see BOS first (Gemma) scores each window
        # after it; the first token is never scored, so nothing is lost
        wins = [[tok.bos_token_id] + w[1:] for w in wins]
    # fp32 activations: quantized layers hold their exact dequantized weights (the packed kernels'
    # fp32 path is 5-70x slower, same maths); speed and memory are then measured on a second,
    # packed copy in the serving dtype, which is what `inferd serve` would run
    fp32 = resolve_dtype(dtype, "cpu") == torch.float32
    heads = list(heads or ["none"])
    if len(heads) > 1 and len(kv_dtypes or []) > 1:
        raise InferdError("--lm-head-quantization and --kv-cache-dtype: one list at a time")
    # each configuration once per head: its key "auto" or "auto lm_head=q4_k"
    variants = {c: [c if h == "none" else f"{c} lm_head={h}" for h in heads] for c in configs}
    head_of = {k: h for c in configs for k, h in zip(variants[c], heads)}
    loaded, labels = {}, {}
    for key in [k for c in configs for k in variants[c]]:
        c, h = key.split(" lm_head=")[0], head_of[key]
        base, a8 = split_config(c)
        labels[key] = base + (f" g{group_size}" if base in ("int4", "int4-gptq") else "")
        if base == "auto":  # what `inferd serve` runs by default, as it would load it
            loaded[key] = load_model(model, dtype=dtype, quantization="auto", lm_head_quantization=h)
            labels[key] = auto_label(loaded[key].model) + (f", lm_head {h}" if h != "none" else "")
            continue
        c = key
        if base == "awq":
            # W4A8's fast path takes fp32 glue (resolve_dtype); weight-only AWQ runs on bf16 activations
            awq_dtype = "float32" if a8 and dtype == "auto" else dtype
            loaded[c], labels[c] = _awq_config(model, awq_path, group_size, awq_dtype, ref)
            if a8:
                from inferd.quant.w4a8 import quantize_activations

                quantize_activations(loaded[c].model)
        elif a8:  # these layers round activations themselves: evaluated (and timed) in their packed form
            loaded[c] = load_model(model, dtype=dtype, quantization=base, quant_group_size=group_size,
                                   quantize_lm_head=quantize_lm_head, quantize_activations=True,
                                   lm_head_quantization=h)
        else:
            loaded[c] = load_model(model, dtype=dtype, quantization=base, quant_group_size=group_size,
                                   quantize_lm_head=quantize_lm_head, dense_quant=fp32, lm_head_quantization=h)
        if a8:
            labels[c] += " W8A8" if base.startswith("int8") else " W4A8"
        if h != "none":
            labels[c] += f", lm_head {h}"
    kv_dtypes = list(kv_dtypes or ["auto"])
    keys = [k for c in configs for k in variants[c]]
    rows_of = [(k, kv) for k in keys for kv in kv_dtypes]
    acc = {r: Accumulator() for r in rows_of}
    # the cache alone, or the head alone: each row against its configuration's first one
    vs_first = {r: Accumulator() for r in rows_of if (r[0], r[1]) not in
                {(variants[c][0], kv_dtypes[0]) for c in configs}}
    ref_acc = Accumulator()
    for wi, w in enumerate(wins):
        targets = torch.tensor(w[1:])
        ref_lp = window_logprobs(ref.model, w)
        ref_acc.add(compare(ref_lp, ref_lp, targets))
        for c in configs:
            first = None
            for key in variants[c]:
                for kv in kv_dtypes:
                    lp = (window_logprobs(loaded[key].model, w) if kv == "auto"
                          else paged_window_logprobs(loaded[key].model, w, kv))
                    acc[(key, kv)].add(compare(ref_lp, lp, targets))
                    if first is None:
                        first = lp
                    else:
                        vs_first[(key, kv)].add(compare(first, lp, targets))
        if progress:
            progress(wi + 1, len(wins))
    prompts = [tok.encode(p) for p in FIXED_PROMPTS]
    eos = tok.eos_token_ids
    cont_ref = [tok.decode(reference_generate(ref.model, p, continuation_tokens, eos_ids=eos).token_ids,
                           skip_special_tokens=True) for p in prompts]
    rows = []
    ref_row = {"config": "reference (fp32, dequantized)", **ref_acc.summary(),
               "weight_mib": weight_bytes(ref.model) / 2**20}
    for c in keys:
        lm = loaded[c]
        packed = lm
        base, a8 = split_config(c.split(" lm_head=")[0])
        if fp32 and base not in ("none", "awq", "auto") and not a8:  # dense weights: time the packed form
            packed = load_model(model, dtype=speed_dtype, quantization=base, quant_group_size=group_size,
                                quantize_lm_head=quantize_lm_head, with_tokenizer=base.endswith("-gptq"),
                                lm_head_quantization=head_of[c])
        label = labels[c] + (" +lm_head" if quantize_lm_head and base not in ("none", "awq", "auto") else "")
        conts = None
        for kv in kv_dtypes:
            row = {"config": f"{label} {str(lm.model.dtype)[6:]} act" + (f", KV {kv}" if kv != "auto" else ""),
                   **acc[(c, kv)].summary(), "weight_mib": weight_bytes(packed.model) / 2**20,
                   "activation_dtype": str(lm.model.dtype)[6:], "speed_dtype": str(packed.model.dtype)[6:],
                   "kv_cache_dtype": kv}
            if (c, kv) in vs_first:
                s = vs_first[(c, kv)].summary()
                against = {"mean_kl": s["mean_kl"], "p99_kl": s["p99_kl"], "top1_agreement": s["top1_agreement"]}
                if len(heads) > 1:
                    row["vs_first_head"] = {"lm_head": heads[0], **against}
                else:
                    row["vs_first_kv"] = {"kv_cache_dtype": kv_dtypes[0], **against}
            if speed:
                row["decode_tok_s_batch1"] = decode_speed(packed, 1, kv_cache_dtype=kv)
                row["throughput_tok_s_batch32"] = decode_speed(packed, 32, kv_cache_dtype=kv)
            if conts is None:  # greedy continuations of the weights (the reference loop's contiguous cache)
                conts = [tok.decode(reference_generate(lm.model, p, continuation_tokens, eos_ids=eos).token_ids,
                                    skip_special_tokens=True) for p in prompts]
                row["continuations"] = conts
            rows.append(row)
        if packed is not lm:
            del packed
    return {"model": model or "smollm2-135m", "ctx": ctx, "windows": len(wins), "group_size": group_size,
            "reference": ref_row, "configs": rows, "prompts": FIXED_PROMPTS, "reference_continuations": cont_ref,
            "note": "the reference is the model as its file holds it, in fp32 (a GGUF's quantized weights "
                    "dequantized: the embedded models are Q4_1 and Q4_K_M to begin with)",
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def auto_label(model) -> str:
    """'auto (gguf W4A8, lm_head W8A8Linear)': what --quantization auto resolved to for this model."""
    from inferd.engine.paths import module_paths

    p = module_paths(model)
    if not p["activation_quant"]:
        return "auto (none)"
    return f"auto (gguf {p['activation_quant']}, lm_head {p['lm_head']})"


def _awq_config(model, awq_path, group_size, dtype, ref):
    """The awq configuration: a saved AWQ folder, or the same calibration run in memory."""
    from inferd.loading.loader import load_model

    if awq_path is None:
        from inferd.loading.loader import awq_model

        lm, _ = awq_model(model, group_size, dtype)
        return lm, f"awq g{group_size}"
    lm = load_model(awq_path, dtype=dtype, quantization="awq")
    if lm.config.vocab_size != ref.config.vocab_size or lm.config.hidden_size != ref.config.hidden_size:
        raise InferdError(f"--awq-path {awq_path} is not a quantization of the evaluated model")
    from inferd.quant.awq_checkpoint import read_quant_config

    return lm, f"awq g{read_quant_config(awq_path)['group_size']}"


def format_table(res: dict) -> str:
    w = max(28, *(len(r["config"]) for r in [res["reference"], *res["configs"]]))
    speed = any("decode_tok_s_batch1" in r for r in res["configs"])  # absent with --no-speed: no nan columns
    head = f"{'config':<{w}} {'ppl':>8} {'mean KL':>9} {'p99 KL':>8} {'top-1':>7} {'MiB':>7}"
    if speed:
        head += f" {'b1 tok/s':>9} {'b32 tok/s':>10}"
    lines = [f"inferd eval: {res['model']}, {res['windows']} windows x {res['ctx']} tokens (WikiText-2 test)",
             f"note: {res['note']}", head, "-" * len(head)]
    r = res["reference"]
    lines.append(f"{r['config']:<{w}} {r['perplexity']:>8.3f} {0:>9.4f} {0:>8.4f} {100:>6.1f}% {r['weight_mib']:>7.0f}")
    for r in res["configs"]:
        line = (f"{r['config']:<{w}} {r['perplexity']:>8.3f} {r['mean_kl']:>9.4f} {r['p99_kl']:>8.4f} "
                f"{100 * r['top1_agreement']:>6.1f}% {r['weight_mib']:>7.0f}")
        if speed:
            line += (f" {r.get('decode_tok_s_batch1', float('nan')):>9.1f}"
                     f" {r.get('throughput_tok_s_batch32', float('nan')):>10.1f}")
        lines.append(line)
    cache = [r for r in res["configs"] if "vs_first_kv" in r]
    if cache:  # the cache alone: each KV row against the same weights with the first KV dtype
        lines += ["", f"{'KV cache alone (same weights)':<{w}} {'vs KV':>9} {'mean KL':>9} {'p99 KL':>8} {'top-1':>7}"]
        for r in cache:
            v = r["vs_first_kv"]
            lines.append(f"{r['config']:<{w}} {v['kv_cache_dtype']:>9} {v['mean_kl']:>9.4f} {v['p99_kl']:>8.4f} "
                         f"{100 * v['top1_agreement']:>6.1f}%")
    alone = [r for r in res["configs"] if "vs_first_head" in r]
    if alone:  # the head alone: each row against the same configuration with the file's own output layer
        lines += ["", f"{'output layer alone (same weights)':<{w}} {'vs head':>9} {'mean KL':>9} {'p99 KL':>8} "
                      f"{'top-1':>7}"]
        for r in alone:
            v = r["vs_first_head"]
            lines.append(f"{r['config']:<{w}} {v['lm_head']:>9} {v['mean_kl']:>9.4f} {v['p99_kl']:>8.4f} "
                         f"{100 * v['top1_agreement']:>6.1f}%")
    lines.append("")
    lines.append("greedy continuations:")
    for i, p in enumerate(res["prompts"]):
        lines.append(f"  {p!r}")
        lines.append(f"    reference: {res['reference_continuations'][i]!r}")
        for r in res["configs"]:
            if "continuations" in r:  # the weights' (the reference loop's contiguous cache), whatever KV row holds them
                lines.append(f"    {r['config'].split(', KV ')[0]}: {r['continuations'][i]!r}")
    return "\n".join(lines)


def plot_speed_vs_kl(res: dict, path: str) -> None:
    """PNG: decode speed (batch 1 and batch 32) against mean KL vs the reference, one point per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["configs"] if "decode_tok_s_batch1" in r]
    if not rows:
        raise InferdError("the speed-vs-KL plot needs the speed columns (run without --no-speed)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    floor = min([r["mean_kl"] for r in rows if r["mean_kl"] > 0] + [1e-3]) / 10
    for ax, key, title in ((axes[0], "decode_tok_s_batch1", "batch-1 decode"),
                           (axes[1], "throughput_tok_s_batch32", "batch-32 decode throughput")):
        for r in rows:
            kl = max(r["mean_kl"], floor)  # an exact config (KL 0) sits on the left edge of the log axis
            ax.scatter(kl, r[key], s=20 + r["weight_mib"] / 2, alpha=0.7)
            ax.annotate(f"{r['config']}\n{r['weight_mib']:.0f} MiB, top-1 {100 * r['top1_agreement']:.1f}%",
                        (kl, r[key]), textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("mean KL(P_ref || P_config) per token, nats (log; lower is better)")
        ax.set_ylabel("output tok/s (higher is better)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"inferd eval: {res['model']}, {res['windows']} x {res['ctx']} tokens; "
                 "reference = the file's weights in fp32 (dequantized where the file is quantized)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
