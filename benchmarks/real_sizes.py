"""Models of the sizes people run on a CPU (1B-8B GGUFs, Q4_K_M and the other types people download):
inferd's default path against llama.cpp on the same file, with each side's load time and peak
resident memory.

The files have the real shapes (and tokenizer size) of Llama 3.2 1B and 3B, Llama 3.1 8B, Qwen2.5 7B
(q/k/v biases, GQA 7:1) and OLMoE-1B-7B (64 experts, 8 active) with random weights: written as F16
by the `gguf` package's writer (tensor by tensor, never the whole model in memory), then quantized
by llama.cpp's own `llama-quantize` (built by benchmarks/llamacpp.py). Random weights are fair for
speed: every dense layer reads and multiplies the same bytes whatever their values (a mixture of
experts' routing is random too, which spreads tokens evenly over the experts).

Per round, interleaved (inferd, then llama.cpp), each contender in a fresh process:
  - inferd: `LLM(model=FILE, quantization="auto", max_model_len=1024, kv_cache_memory="256MiB")`
    (what `inferd serve` does by default), its load time (the call, imports excluded) and the
    process's peak RSS (mapped file pages counted); batch-1 decode tok/s over 128 tokens and the
    tok/s of one 512-token prompt;
  - llama.cpp: `llama-bench -p 512 -n 128` (pp512, tg128: the numbers its users quote), and
    `llama-server`'s start to its /health answering (its context ready), with its peak RSS.
Medians over the rounds, min-max beside them; the roofline: decode at the machine's read bandwidth
over the bytes a token reads.

    .venv/bin/python benchmarks/real_sizes.py                          # 1B and 3B, Q4_K_M, 3 rounds
    .venv/bin/python benchmarks/real_sizes.py --shapes 8b --rounds 1   # Llama 3.1 8B
    .venv/bin/python benchmarks/real_sizes.py --tiny                   # a smoke run (the suite's)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# hidden, layers, heads, kv heads, head dim, ff, vocab, tied head; family extras
SHAPES = {
    "1b": dict(name="Llama 3.2 1B", arch="llama", hidden=2048, layers=16, heads=32, kv=8, head_dim=64, ff=8192,
               vocab=128256, tied=True, ctx=131072, theta=500000.0),
    "3b": dict(name="Llama 3.2 3B", arch="llama", hidden=3072, layers=28, heads=24, kv=8, head_dim=128, ff=8192,
               vocab=128256, tied=True, ctx=131072, theta=500000.0),
    "8b": dict(name="Llama 3.1 8B", arch="llama", hidden=4096, layers=32, heads=32, kv=8, head_dim=128, ff=14336,
               vocab=128256, tied=False, ctx=131072, theta=500000.0),
    "qwen7b": dict(name="Qwen2.5 7B", arch="qwen2", hidden=3584, layers=28, heads=28, kv=4, head_dim=128, ff=18944,
                   vocab=152064, tied=False, ctx=32768, theta=1000000.0, bias=True),
    "olmoe": dict(name="OLMoE-1B-7B", arch="olmoe", hidden=2048, layers=16, heads=16, kv=16, head_dim=128, ff=1024,
                  vocab=50304, tied=False, ctx=4096, theta=10000.0, experts=64, used=8),
    # the suite's smoke shape: seconds to write, no llama.cpp
    "tiny": dict(name="tiny", arch="llama", hidden=256, layers=2, heads=4, kv=2, head_dim=64, ff=512, vocab=1024,
                 tied=True, ctx=2048, theta=10000.0),
}
CACHE = os.path.join(os.environ.get("INFERD_BENCH_CACHE", os.path.expanduser("~/.cache/inferd-bench")), "real-sizes")


# -- the files ---------------------------------------------------------------------------------------

def tensors(s: dict):
    """(name, numpy shape [rows, cols] or [n]) of every tensor of shape `s`, in llama.cpp's names."""
    h, hd = s["hidden"], s["head_dim"]
    yield "token_embd.weight", (s["vocab"], h)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,)
        yield b + "attn_q.weight", (s["heads"] * hd, h)
        yield b + "attn_k.weight", (s["kv"] * hd, h)
        yield b + "attn_v.weight", (s["kv"] * hd, h)
        if s.get("bias"):
            yield b + "attn_q.bias", (s["heads"] * hd,)
            yield b + "attn_k.bias", (s["kv"] * hd,)
            yield b + "attn_v.bias", (s["kv"] * hd,)
        if s["arch"] == "olmoe":  # its q/k norms span the whole projection
            yield b + "attn_q_norm.weight", (s["heads"] * hd,)
            yield b + "attn_k_norm.weight", (s["kv"] * hd,)
        yield b + "attn_output.weight", (h, s["heads"] * hd)
        yield b + "ffn_norm.weight", (h,)
        if s.get("experts"):
            e = s["experts"]
            yield b + "ffn_gate_inp.weight", (e, h)
            yield b + "ffn_gate_exps.weight", (e, s["ff"], h)
            yield b + "ffn_up_exps.weight", (e, s["ff"], h)
            yield b + "ffn_down_exps.weight", (e, h, s["ff"])
        else:
            yield b + "ffn_gate.weight", (s["ff"], h)
            yield b + "ffn_up.weight", (s["ff"], h)
            yield b + "ffn_down.weight", (h, s["ff"])
    yield "output_norm.weight", (h,)
    if not s["tied"]:
        yield "output.weight", (s["vocab"], h)


def add_metadata(w, s: dict) -> None:
    """The keys llama.cpp and inferd read, and an SPM tokenizer of the real vocabulary size (three
    specials, the 256 byte tokens, then plain pieces)."""
    from gguf import TokenType

    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s["theta"])
    w.add_vocab_size(s["vocab"])
    w.add_file_type(1)  # mostly F16
    if s.get("experts"):
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["used"])
        w.add_expert_feed_forward_length(s["ff"])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(s["vocab"] - len(tokens))]
    types += [TokenType.NORMAL] * (s["vocab"] - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(s["vocab"] - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_f16(path: str, s: dict) -> None:
    """Random N(0, 0.02) weights in F16, norms 1 in F32, streamed tensor by tensor."""
    import numpy as np
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)  # 32 MiB, rolled
    items = list(tensors(s))
    w = GGUFWriter(path, s["arch"])
    add_metadata(w, s)
    for name, shape in items:
        one_d = len(shape) == 1
        dtype = np.float32 if one_d else np.float16
        n = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(dtype), n * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    offset = 0
    for name, shape in items:
        n = int(np.prod(shape))
        if len(shape) == 1:
            a = np.ones(n, dtype=np.float32) if name.endswith("norm.weight") else np.zeros(n, dtype=np.float32)
        else:
            idx = (offset + np.arange(n, dtype=np.int64) * 7) % pool.size if n <= pool.size else None
            a = pool[idx] if idx is not None else np.resize(np.roll(pool, offset % pool.size), n)
            offset += 1_000_003
        w.write_tensor_data(a.reshape(shape))
    w.close()


def model_file(shape: str, qtype: str) -> str:
    """The cached file of `shape` in `qtype` (written and quantized on first use)."""
    os.makedirs(CACHE, exist_ok=True)
    s = SHAPES[shape]
    out = os.path.join(CACHE, f"{shape}-{qtype}.gguf")
    if os.path.exists(out):
        return out
    f16 = os.path.join(CACHE, f"{shape}-F16.gguf")
    if not os.path.exists(f16):
        t0 = time.monotonic()
        write_f16(f16 + ".part", s)
        os.replace(f16 + ".part", f16)
        print(f"[files] wrote {f16} ({os.path.getsize(f16) / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
    if qtype == "F16":
        return f16
    if shape == "tiny":  # the smoke run: the gguf package's own Q8_0, no llama.cpp
        return tiny_quantized(f16, out, qtype)
    import llamacpp

    exe = llamacpp.build(("llama-quantize",))["llama-quantize"]
    t0 = time.monotonic()
    subprocess.run([str(exe), f16, out + ".part", qtype, "2"], check=True, capture_output=True)
    os.replace(out + ".part", out)
    print(f"[files] {qtype}: {out} ({os.path.getsize(out) / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    if os.environ.get("INFERD_KEEP_F16") != "1" and shape in ("8b", "qwen7b", "olmoe"):
        os.remove(f16)  # 15 GB a file: kept only where asked
    return out


def tiny_quantized(src: str, out: str, qtype: str) -> str:
    """The tiny shape in Q8_0 by the gguf package (the suite builds no llama.cpp)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter, quants

    s = SHAPES["tiny"]
    w = GGUFWriter(out, s["arch"])
    add_metadata(w, s)
    for t in GGUFReader(src).tensors:
        a = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape(tuple(reversed([int(x) for x in t.shape])))
        if a.ndim == 1:
            w.add_tensor(t.name, a)
        else:
            w.add_tensor(t.name, quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# -- the contenders ----------------------------------------------------------------------------------

def inferd_worker(path: str, threads: int, gen: int, prompt: int) -> dict:
    """Run in a fresh process: load as `inferd serve` does, then decode and prefill at batch 1."""
    import resource

    import torch

    from inferd import LLM, SamplingParams
    from inferd.engine.paths import engine_paths

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model=path, quantization="auto", max_model_len=1024, kv_cache_memory="256MiB", threads=threads,
              max_num_batched_tokens=max(512, prompt))
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(300, vocab, (prompt + 8,), generator=g).tolist()
    p = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)

    def timed(tokens, n):
        t = time.perf_counter()
        llm.generate([tokens], SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))
        return time.perf_counter() - t

    llm.generate([ids[:8]], p)  # warm-up: first-call allocations
    t1 = timed(ids[:8], 1)
    tn = timed(ids[:8], gen + 1)
    decode = gen / max(tn - t1, 1e-9)
    tp = timed(ids[8:8 + prompt], 1)
    report = getattr(llm.engine, "load_report", None) or {}
    return {"load_s": load_s, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "decode": decode, "prefill": prompt / tp, "paths": engine_paths(llm.engine),
            "weight_bytes": report.get("weight_bytes"), "dense_fallback": report.get("dense_fallback")}


def run_inferd(path: str, threads: int, gen: int, prompt: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--threads", str(threads), "--gen", str(gen),
           "--prompt", str(prompt)]
    import llamacpp

    # the OpenMP wait policy llama.cpp gets (passive on a loaded machine, active on a quiet one), for
    # both sides alike: it decides a 2-thread decode's speed by up to 4x either way
    env = {**llamacpp.llamacpp_env(), "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"inferd worker failed: {(r.stderr or r.stdout).strip().splitlines()[-3:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_server_load(path: str, threads: int) -> dict:
    """llama-server's start to /health answering 200 (its model and context ready), and its peak RSS."""
    import socket

    import llamacpp

    exe = llamacpp.build(("llama-server",))["llama-server"]
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(exe), "-m", path, "-t", str(threads), "-c", "1024", "--host", "127.0.0.1",
                             "--port", str(port), "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=llamacpp.llamacpp_env())
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        with open(f"/proc/{proc.pid}/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        return {"load_s": ready, "peak_rss": hwm}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_llamacpp(path: str, threads: int, gen: int, prompt: int) -> dict:
    import llamacpp

    bench = llamacpp.llama_bench(path, threads=threads, prompt=prompt, gen=gen, reps=3)
    return {"decode": bench[f"tg{gen}"], "prefill": bench[f"pp{prompt}"], **llama_server_load(path, threads)}


# -- the report --------------------------------------------------------------------------------------

def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def rng(rows: list[dict], key: str, fmt: str = "{:.1f}") -> str:
    vals = [r[key] for r in rows]
    return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,3b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_K_M", help="comma list: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_XS, ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a smoke run on a tiny shape, without llama.cpp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(inferd_worker(args.worker, args.threads, args.gen, args.prompt)))
        return
    from common import check_rows, cpu_features, read_bandwidth_gbs, report_header, tiny_skips, write_json

    if args.tiny:
        args.shapes, args.types, args.rounds, args.gen, args.prompt = "tiny", "Q8_0", 1, 8, 64
        args.skip_llamacpp = True
    bw = read_bandwidth_gbs(args.threads)
    setup = {"threads": args.threads, "decode": f"{args.gen} tokens at batch 1 after an 8-token prompt",
             "prefill": f"one {args.prompt}-token prompt", "rounds": f"{args.rounds}, interleaved, medians (min-max)",
             "inferd": 'LLM(model=FILE, quantization="auto", max_model_len=1024, kv_cache_memory="256MiB")',
             "read bandwidth": f"{bw:.1f} GB/s", "weights": "random, in the real shapes (fair for speed)"}
    if args.skip_llamacpp:
        if args.tiny:
            tiny_skips("llama-bench and llama-server")
    else:
        import llamacpp

        setup["llama.cpp"] = (f"{llamacpp.isa_choice()['note']}; llama-bench -p {args.prompt} -n {args.gen} -r 3, "
                              "llama-server's start to /health")
    import llamacpp

    setup["OpenMP wait policy"] = f"{llamacpp.omp_env()['OMP_WAIT_POLICY']} (both sides, by the load at start)"
    rows, paths, lines = [], {}, []
    for shape in args.shapes.split(","):
        for qtype in args.types.split(","):
            path = model_file(shape, qtype)
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(run_inferd(path, args.threads, args.gen, args.prompt))
                if not args.skip_llamacpp:
                    theirs.append(run_llamacpp(path, args.threads, args.gen, args.prompt))
            name = f"{SHAPES[shape]['name']} {qtype}"
            paths[f"inferd {name}"] = ours[-1]["paths"]
            if theirs:
                import llamacpp

                paths[f"{llamacpp.row_name(llamacpp.build_info(), 'llama-bench')} {name}"] = llamacpp.build_info()
            rows += table_rows(name, path, ours, theirs)
            lines += report(name, path, os.path.getsize(path), ours, theirs, bw)
    report_header("# models of real sizes: inferd's default path against llama.cpp on the same file", setup, paths)
    print("\n".join(lines))
    check_rows(paths)
    write_json(args.json, setup, rows, paths)


def table_rows(name: str, path: str, ours: list, theirs: list) -> list[dict]:
    from common import spread

    out = []
    for who, runs in (("inferd", ours), ("llama.cpp", theirs)):
        for key in ("decode", "prefill", "load_s", "peak_rss") if runs else ():
            out.append({"label": f"{who} {name} {key}", "file_bytes": os.path.getsize(path),
                        **spread([r[key] for r in runs])})
    return out


def report(name: str, path: str, size: int, ours: list, theirs: list, bw: float) -> list[str]:
    gib = 2**30
    roof = bw * 1e9 / size  # a decode step reads every weight once (a tied head reads the table)
    out = [f"\n## {name}: {path} ({size / gib:.2f} GiB); decode roofline ~{roof:.1f} tok/s at {bw:.1f} GB/s",
           f"inferd    load {rng(ours, 'load_s', '{:.2f}')} s, peak RSS {med(ours, 'peak_rss') / gib:.2f} GiB "
           f"({med(ours, 'peak_rss') / size:.2f}x the file), decode {rng(ours, 'decode')} tok/s "
           f"({med(ours, 'decode') / roof:.0%} of the roofline), prefill {rng(ours, 'prefill')} tok/s",
           f"          dense fallback: {ours[-1]['dense_fallback']}"]
    if theirs:
        out.append(f"llama.cpp load {rng(theirs, 'load_s', '{:.2f}')} s, peak RSS {med(theirs, 'peak_rss') / gib:.2f} "
                   f"GiB ({med(theirs, 'peak_rss') / size:.2f}x), tg {rng(theirs, 'decode')} tok/s, "
                   f"pp {rng(theirs, 'prefill')} tok/s")
        ratios = {"decode": med(ours, "decode") / med(theirs, "decode"),
                  "prefill": med(ours, "prefill") / med(theirs, "prefill"),
                  "load": med(ours, "load_s") / med(theirs, "load_s"),
                  "peak RSS": med(ours, "peak_rss") / med(theirs, "peak_rss")}
        out.append("ratios inferd / llama.cpp: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        bound = 2 * med(theirs, "load_s") + 1
        out.append(f"load bound 2 x llama.cpp's + 1 s = {bound:.2f} s: inferd "
                   f"{'within' if med(ours, 'load_s') <= bound else 'OVER'}")
    bound = 1.3 * size + 1.25 * gib
    out.append(f"memory bound 1.3 x file + 1.25 GiB = {bound / gib:.2f} GiB: inferd "
               f"{'within' if med(ours, 'peak_rss') <= bound else 'OVER'}")
    return out


if __name__ == "__main__":
    main()
