"""`inferd` command line: argument parsing only; each sub-command calls into the package."""
from __future__ import annotations

import argparse
import os
import sys

from inferd.errors import InferdError
from inferd.quant import METHODS


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would add a usage block)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def add_model_args(p: argparse.ArgumentParser, several: bool = False):
    add_parallel_args(p)
    g = p.add_argument_group("model")
    if several:
        g.add_argument("--model", action="append", default=None,
                       help="embedded default (smollm2-135m), a .gguf file, or a Hugging Face model folder; "
                            "repeat it to serve several (NAME=PATH names one; the request's `model` picks it)")
    else:
        g.add_argument("--model", default=None,
                       help="embedded default (smollm2-135m), a .gguf file, or a Hugging Face model folder")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"],
                   help="dummy: random weights with the model's real shapes (built-in names too)")
    g.add_argument("--dtype", default="auto",
                   help="auto (CPU: float32 with --quantize-activations, bfloat16 with other --quantization, "
                        "dense: bfloat16 with AVX512-BF16, else float32; CUDA: bfloat16) | float32 | bfloat16")
    g.add_argument("--device", default="cpu", help="cpu | cuda")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--quantization", default="auto", choices=list(METHODS),
                   help="auto (default): a .gguf is served from its own blocks with int8 activations and the "
                        "file's own output layer (as --quantization gguf --quantize-activations "
                        "--quantize-lm-head; the fast path, as llama.cpp serves a GGUF), anything else as "
                        "none; none: the dequantized model; the others: weight-only quantization of the linear "
                        "layers (CPU packed kernels); *-gptq: the same formats with GPTQ rounding (a calibration "
                        "pass on WikiText-2 at load); awq: an AWQ checkpoint folder (picked automatically for "
                        "one); gguf: the file's own blocks (Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, IQ4_NL/XS)")
    g.add_argument("--quant-group-size", type=int, default=32, help="int4 group size (must divide the input size)")
    g.add_argument("--quantize-lm-head", action="store_true", help="quantize the output layer too")
    g.add_argument("--lm-head-quantization", default="none", choices=["none", "q4_k", "q5_k"],
                   help="a GGUF served from its blocks: decode's output layer rounded again to Q4_K (4.5 bits) "
                        "or Q5_K (5.5) at load, from a higher-bit one (a Q4_K_M file's Q6_K token table: 28 %% "
                        "fewer head bytes a token in Q4_K); the file's table stays for the embedding; lossy, off by "
                        "default: `inferd eval --quantization auto --lm-head-quantization none,q4_k` prints its "
                        "KL and top-1 against the file's head")
    g.add_argument("--quantize-activations", action="store_true",
                   help="round activations to int8 per 32-block and multiply with integer dot products: "
                        "W4A8 for int4 weights (int4, int4-gptq, gguf, awq; as llama.cpp's Q4 x Q8_1), W8A8 for "
                        "int8 ones (int8, int8-gptq, gguf's --quantize-lm-head); lossy, judge it with "
                        "`inferd eval --quantization int4+a8`")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the eager PyTorch modules: no fused C++ decode step (which "
                        "--quantize-activations models use for decode-only steps)")


def add_parallel_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks (processes started by inferd, each on its own cores)")
    g.add_argument("--tensor-parallel-backend", default="auto", choices=["auto", "shm", "gloo", "nccl"],
                   help="how ranks all-reduce: auto = shm (shared memory, one host) on CPU, nccl on CUDA; "
                        "gloo = torch.distributed over TCP")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="who starts ranks 1..N-1: mp = processes on this host; ray = Ray actors in a placement "
                        "group on the cluster at RAY_ADDRESS (or a local one), gloo between nodes, shared "
                        "memory when every rank lands on this node (pip install 'inferd[ray]')")
    g.add_argument("--ray-placement-strategy", default="PACK", type=str.upper,
                   choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="how the placement group places ranks: PACK = on this node where they fit, SPREAD = one "
                        "per node where possible (STRICT_*: or fail)")


def add_lora_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    g.add_argument("--lora-modules", nargs="+", default=None,
                   help="adapters to load at start, each name=path of a PEFT folder (adapter_config.json + "
                        "adapter_model.safetensors) or JSON {\"name\", \"path\"}; a request's `model` names one; with "
                        "several --model, each goes to the model whose shapes it fits")
    g.add_argument("--max-loras", type=int, default=1,
                   help="most adapters in one step (slots); requests of others wait for a slot")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")


def add_engine_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes (e.g. 2GiB); CPU default: 20%% of free RAM, at most 2 GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA only: fraction of GPU memory for weights + KV cache (ignored on CPU, "
                        "where --kv-cache-memory sizes the pool)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype) | float32 | bfloat16 | int8 (8-bit codes and an fp16 scale per 32 "
                        "values: 1.0625 bytes a value, 1.88x bf16's tokens)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off automatic prefix caching")
    g.add_argument("--kv-tier", default=None, metavar="DIR|shm",
                   help="a second KV tier: full prefix blocks are written through to this directory (shm: one on "
                        "/dev/shm) and loaded from it instead of recomputed; engines and restarts with the same "
                        "directory and model share it")
    g.add_argument("--kv-tier-size", default="4GiB", help="most bytes the KV tier keeps (least recently used go first)")
    g.add_argument("--kv-events-config", default=None,
                   help='vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                        '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "", '
                        '"buffer_steps": 10000}: publish blocks stored and removed (msgpack over ZeroMQ PUB)')
    g.add_argument("--scheduling", default="continuous", choices=["continuous", "static"],
                   help="continuous: admit and retire sequences every step; static: run fixed batches to the "
                        "end (to compare)")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="auto: an encoder (BERT) runs as a pooling model, a decoder generates; pooling: "
                        "embeddings from any model (/v1/embeddings, /pooling, /api/embed): one forward a request, "
                        "no KV cache")
    g.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="how a pooling model makes one vector of a sequence's hidden states (default: the model's "
                        "sentence-transformers files; else cls for an encoder, last for a decoder)")
    add_spec_args(p)


def add_spec_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s JSON, e.g. {"method": "suffix", "num_speculative_tokens": 16}: methods suffix, ngram, '
                        'draft_model; keys num_speculative_tokens, model, quantization, prompt_lookup_min/max, '
                        'suffix_decoding_max_tree_depth, suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob, '
                        'suffix_decoding_max_cached_requests (and inferd\'s suffix_decoding_max_cached_tokens, '
                        'ngram_backoff, cost_model); instead of the flags below')
    g.add_argument("--speculative-method", default=None, choices=["none", "draft", "ngram", "suffix"],
                   help="draft: a draft model guesses; ngram: prompt lookup; suffix: suffix decoding over this and "
                        "earlier requests (no second model)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens guessed per step (K)")
    g.add_argument("--draft-model", default=None,
                   help="draft: a model path with the same vocabulary, or self:layers=N (the target's first N layers)")
    g.add_argument("--draft-quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the draft (a self-draft's layers are copied first)")
    g.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix to look up")
    g.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix to look up")
    g.add_argument("--ngram-backoff", type=int, default=8,
                   help="ngram: after a step whose guesses were all rejected, skip lookups for 1, 2, 4 .. up to "
                        "this many steps (a rejected guess run costs a verify step; 0: always guess)")


def engine_config_from_args(args):
    from inferd.config import EngineConfig

    return EngineConfig.from_args(args)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of tokens with this "
                   "much probability (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="inferd", description="LLM inference engine and serving benchmark")
    from inferd import __version__

    p.add_argument("--version", action="version", version=f"inferd {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p.subcommands = sub.choices  # name -> its parser (YAML defaults are set on it)

    g = sub.add_parser("generate", help="complete one prompt and print the result")
    add_model_args(g)
    add_spec_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", default=None, help="prompt text (default: read standard input)")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap the prompt as a user message with the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal (streams tokens)")
    add_model_args(c)
    add_spec_args(c)
    add_sampling_args(c, max_tokens=512)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="HTTP server speaking OpenAI's, Anthropic's and Ollama's APIs (streaming, "
                                      "Prometheus /metrics)")
    add_model_args(sv, several=True)
    add_engine_args(sv)
    add_lora_args(sv)
    sv.add_argument("--config", default=None, help="YAML file of options (keys as flag names, _ or -)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    sv.add_argument("--served-model-name", default=None, help="model id the API reports and accepts")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (or INFERD_API_KEY)")
    sv.add_argument("--max-waiting", type=int, default=512, help="queued requests beyond this get 503")
    sv.add_argument("--log-level", default="info", help="debug | info | warning | error")
    sv.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                    help="a larger request body gets 413 before it is read whole")
    sv.add_argument("--max-request-header-bytes", type=int, default=16 * 1024,
                    help="larger request headers get 431")
    sv.add_argument("--request-body-timeout", type=float, default=30.0,
                    help="seconds to wait for each piece of a request body (then 408)")
    sv.add_argument("--stream-stall-timeout", type=float, default=30.0,
                    help="a stream whose client has not read for this many seconds is aborted (0: never)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM/SIGINT, seconds open requests get to finish before the server exits")
    sv.add_argument("--allowed-origins", default=None,
                    help="CORS origins allowed to call the API, as a JSON list or comma-separated (default: none)")
    sv.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    sv.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    sv.add_argument("--engine-in-process", action="store_true",
                    help="run the engine loop on a thread of the server process instead of in its own process "
                         "(debugging; the default process boundary keeps HTTP work off the engine's cores)")
    sv.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="engine processes (model copies) behind this server, each pinned to its share of the cores")
    sv.add_argument("--data-parallel-routing", default="prefix", choices=["prefix", "least_loaded", "round_robin"],
                    help="how requests are spread over the engines (prefix: the engine holding the longest "
                         "prefix of the prompt, unless loads are uneven)")
    sv.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="usage.prompt_tokens_details.cached_tokens in answers: prompt tokens not computed "
                         "for this request (prefix cache hits, KV pulled from a prefill worker)")
    sv.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                    help="split a thinking model's <think>...</think> text from its answer: chat's "
                         "reasoning_content, Responses' reasoning items, Anthropic's thinking blocks, Ollama's "
                         "thinking")
    rg = sv.add_argument_group("the Responses API's store (previous_response_id, GET /v1/responses/ID)")
    rg.add_argument("--responses-store-entries", type=int, default=1024,
                    help="most responses kept; past it the oldest go (0: keep none)")
    rg.add_argument("--responses-store-bytes", default="64MiB",
                    help="most bytes of kept responses and their conversations (JSON); past it the oldest go")
    rg.add_argument("--responses-store-ttl", type=float, default=3600.0,
                    help="seconds a response stays retrievable after it was made")
    mg = sv.add_argument_group("several models (repeated --model, or models: in the --config YAML)")
    mg.add_argument("--preload", action="store_true",
                    help="load every model at start (default with one model; with several each loads on its "
                         "first request, which waits for it)")
    mg.add_argument("--keep-alive", type=float, default=None,
                    help="seconds a model stays loaded without requests (-1: never; default: 300 with several "
                         "models, never with one)")
    mg.add_argument("--max-loaded-models", type=int, default=0,
                    help="most models loaded at once; loading another unloads the least recently used idle one "
                         "(0: no limit)")
    mg.add_argument("--models-memory-budget", default=None,
                    help="most resident memory of the loaded models' engines (e.g. 8GiB); loading past it "
                         "unloads the least recently used idle ones")
    sv.set_defaults(models=None)  # the config's models: list (per-model engine options)
    dg = sv.add_argument_group("disaggregated prefill/decode")
    dg.add_argument("--kv-transfer-config", default=None,
                    help='vLLM\'s JSON: {"kv_connector": "ZmqConnector"|"SharedMemoryConnector", "kv_role": '
                         '"kv_producer"|"kv_consumer"|"kv_both", "kv_ip", "kv_port", "engine_id", '
                         '"kv_connector_extra_config": {"lease_timeout_s", "transfer_timeout_s", "advertise_host"}}')
    dg.add_argument("--role", default=None, choices=["prefill", "decode", "both"],
                    help="shorthand: kv_role kv_producer / kv_consumer / kv_both with the ZmqConnector "
                         "(merged with --kv-transfer-config when both are given)")
    sv.set_defaults(func=cmd_serve)

    ev = sub.add_parser("eval", help="quality of quantized configs vs the unaltered model (ppl, KL, top-1)")
    ev.add_argument("--model", default=None, help="the unaltered model: .gguf, Hugging Face folder "
                    "(default: the embedded default, whose weights are already Q4_1)")
    ev.add_argument("--quantization", default="none,int8,int4",
                    help="comma-separated configurations to compare with the fp32 reference: a --quantization "
                         "method, +a8 for int8 activations (int4+a8), or auto (what `inferd serve` runs by "
                         "default)")
    ev.add_argument("--quant-group-size", type=int, default=32, help="input channels per scale of int4/awq")
    ev.add_argument("--awq-path", default=None,
                    help="awq config: this AWQ folder (from inferd quantize); default: calibrate in memory "
                         "at --quant-group-size the way inferd quantize does")
    ev.add_argument("--quantize-lm-head", action="store_true", help="quantize the output layer too")
    ev.add_argument("--lm-head-quantization", default="none",
                    help="comma list (none, q4_k, q5_k): each configuration of a GGUF served from its blocks "
                         "(auto, gguf) also loaded with its output layer rounded again to that type; rows after "
                         "the first also report KL and top-1 against the first (the head's cost alone)")
    ev.add_argument("--dtype", default="auto", help="activation dtype of the evaluated configs")
    ev.add_argument("--dataset", default="wikitext", choices=["wikitext"],
                    help="evaluation text (WikiText-2 test split, shipped with the repository)")
    ev.add_argument("--dataset-path", default=None, help="a text file instead of WikiText-2's test split")
    ev.add_argument("--ctx", type=int, default=512, help="tokens per window")
    ev.add_argument("--windows", type=int, default=64, help="windows of --ctx tokens evaluated")
    ev.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of KV cache dtypes each configuration also runs with through the paged "
                         "cache (e.g. bfloat16,int8; auto: the plain contiguous cache); rows after the first "
                         "also report KL and top-1 against the first (the cache's cost alone)")
    ev.add_argument("--no-speed", dest="speed", action="store_false", help="skip the decode speed columns")
    ev.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ev.add_argument("--result-json", default=None, help="write the results as JSON")
    ev.add_argument("--plot", default=None, help="PNG of decode speed against mean KL, one point per config")
    ev.add_argument("--speed-dtype", default="auto",
                    help="activation dtype of the speed columns when --dtype float32 (default: the serving dtype)")
    ev.set_defaults(func=cmd_eval)

    qz = sub.add_parser("quantize", help="AWQ int4: calibrate, search scales and clipping, write a Hugging Face "
                                         "AWQ folder that inferd serve/generate/eval load")
    qz.add_argument("--model", default=None, help="the model to quantize (default: the embedded default)")
    qz.add_argument("--method", default="awq", choices=["awq"], help="quantization method")
    qz.add_argument("--group-size", type=int, default=64, help="input channels per scale: 32, 64, 128 or 256")
    qz.add_argument("--calib", default="wikitext",
                    help="wikitext (WikiText-2 test text after the characters inferd eval uses) or a text file")
    qz.add_argument("--calib-samples", type=int, default=32, help="calibration sequences")
    qz.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration sequence")
    qz.add_argument("--grid", type=int, default=20, help="grid points of the scale exponent and of the clipping")
    qz.add_argument("--no-clip", dest="clip", action="store_false", help="skip the clipping search")
    qz.add_argument("--out", required=True, help="output folder (created; must be empty)")
    qz.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    qz.set_defaults(func=cmd_quantize)

    t = sub.add_parser("throughput", help="offline throughput of the engine on N seeded requests")
    add_model_args(t)
    add_engine_args(t)
    t.add_argument("--num-prompts", type=int, default=64, help="requests to run")
    t.add_argument("--dataset", default="random", choices=["random", "jsonl"],
                   help="random: seeded token ids; jsonl: prompts from --dataset-path")
    t.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\": ..., \"output_len\": N} per line")
    t.add_argument("--input-len", default="64-256", help="prompt tokens: N or MIN-MAX (uniform)")
    t.add_argument("--output-len", default="32-256", help="output tokens: N or MIN-MAX (uniform)")
    t.add_argument("--ignore-eos", action="store_true", help="always generate exactly the output length")
    t.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    t.add_argument("--seed", type=int, default=0, help="seed of the prompts and of sampling")
    t.add_argument("--output-json", default=None, help="write the results as JSON")
    t.set_defaults(func=cmd_throughput)

    b = sub.add_parser("bench", help="load-test any OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput, SLA); "
                                     "`inferd bench report TRACE` recomputes a saved run")
    b.add_argument("action", nargs="*", help="`report TRACE.jsonl|SWEEP.json` recomputes a saved run (and "
                                             "redraws --html); `compare A.json B.json ...` puts results side by side")
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    b.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions | /v1/chat/completions | /v1/responses | /v1/messages | /v1/embeddings "
                        "(an embeddings workload: requests/s, latency percentiles, input tokens/s; /pooling and "
                        "/api/embed too)")
    b.add_argument("--endpoint-type", default="auto", choices=["auto", "completions", "chat", "responses", "messages", "embeddings"],
                   help="the API the endpoint speaks (auto: from its path): OpenAI's completions, chat completions "
                        "or Responses API, Anthropic's Messages, or embeddings; TTFT and TPOT are measured the same way in each")
    b.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    b.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)")
    b.add_argument("--dataset", default="random",
                   choices=["random", "wikitext", "jsonl", "sharegpt", "prefix-families", "multi-turn", "mixed",
                            "mooncake-trace", "azure-trace", "agent-loop", "code-edit", "json-extraction",
                            "low-rep-chat"],
                   help="mixed: request classes from --mix; mooncake-trace / azure-trace: replay a trace at its "
                        "own arrival times (default: a small synthetic one shipped with inferd); agent-loop, "
                        "code-edit, json-extraction, low-rep-chat: chat workloads for speculative decoding (their "
                        "messages to a chat endpoint, a transcript to a completions one)")
    b.add_argument("--mix", default=None, help="mixed: NAME:FRACTION:INPUT_LEN:OUTPUT_LEN,... (lengths as "
                   "--input-len; fractions add up to 1; default chat:0.8:128:128,rag:0.2:2048:16)")
    b.add_argument("--trace-speedup", default="1", help="trace datasets: divide the trace's inter-arrival times "
                   "by this (2 = twice the load)")
    b.add_argument("--trace-block-size", type=int, default=512, help="mooncake-trace: tokens per hash id "
                   "(Mooncake's 512); equal hash ids get equal tokens, so shared prefixes hit the prefix cache")
    b.add_argument("--prefix-families", type=int, default=8,
                   help="prefix-families / multi-turn: shared system prompts (conversations)")
    b.add_argument("--question-len", default="32", help="prefix-families / multi-turn: tokens of each question")
    b.add_argument("--dataset-path", default=None, help="wikitext: a text file; jsonl: {\"prompt\", "
                   "\"output_len\"} lines; sharegpt: JSON conversations; mooncake-trace: Mooncake JSONL; "
                   "azure-trace: TIMESTAMP,ContextTokens,GeneratedTokens CSV")
    b.add_argument("--tokenizer", default=None, help="tokenizer.json | HF folder | .gguf | server "
                   "(default: the default model's)")
    b.add_argument("--num-prompts", type=int, default=100, help="requests to send (trace datasets: at most "
                   "this many rows, the first)")
    b.add_argument("--input-len", default="1024", help="prompt tokens: N, MIN-MAX or normal:MEAN,STD")
    b.add_argument("--output-len", default=None, help="output tokens asked for (max_tokens + ignore_eos): N, "
                   "MIN-MAX or normal:MEAN,STD (default: 128; jsonl/sharegpt: from the file)")
    b.add_argument("--request-rate", default="inf", help="requests/s, or inf to send all at once (trace "
                   "datasets: ignored, the trace sets the times)")
    b.add_argument("--burstiness", default="1", help="gamma shape of the gaps: 1 = Poisson, inf = constant rate")
    b.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    b.add_argument("--warmup", type=int, default=0, help="requests sent (and left out of the results) first")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument("--extra-body", default=None, help="JSON merged into every request body (null removes a key)")
    b.add_argument("--percentiles", default="50,90,95,99", help="percentiles reported for each latency")
    b.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000; "
                   "also gives slo_attainment (share of requests meeting all), and a rate sweep's goodput_rate")
    b.add_argument("--sla", default=None, help="e.g. \"p99_ttft_ms<500,p99_tpot_ms<50\": violated -> exit 3")
    b.add_argument("--result-json", default=None, help="write the results as JSON")
    b.add_argument("--csv", default=None, help="one row per request")
    b.add_argument("--trace", default=None, help="raw trace (JSONL) for `inferd bench report`")
    b.add_argument("--html", default=None, help="self-contained HTML report with plots (a run or a --sweep)")
    b.add_argument("--sweep", default=None, help="concurrency:1,2,4,... | rate:1,2,5,... | auto[:N]: one run per "
                                                 "load; with --sla, the highest load meeting it (capacity)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress line on stderr (default: when stderr is a terminal)")
    b.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                   help="do not scrape the server's /metrics for the client-vs-server cross-check")
    b.set_defaults(func=cmd_bench)

    rt = sub.add_parser("router", help="OpenAI-compatible router over several servers (prefix-, load-aware)")
    from inferd.router.main import add_router_args

    add_router_args(rt)
    rt.set_defaults(func=cmd_router)

    en = sub.add_parser("env", help="this machine and build: CPU features, the kernel variant chosen, torch, threads "
                                    "(INFERD_ISA=generic|avx2|avx512|avx512_vnni|avx512_amx forces a variant)")
    en.add_argument("--json", action="store_true", help="print JSON")
    en.set_defaults(func=cmd_env)

    ms = sub.add_parser("mock-server", help="OpenAI-compatible server with an exact, known token schedule")
    ms.add_argument("--ttft-ms", type=float, default=200.0, help="time to the first token")
    ms.add_argument("--tpot-ms", type=float, default=20.0, help="time between tokens")
    ms.add_argument("--output-len", type=int, default=128, help="tokens before 'EOS' (ignore_eos: max_tokens)")
    ms.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens in each streamed chunk")
    ms.add_argument("--role-chunk", action="store_true", help="chat: begin with a role-only chunk")
    ms.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ms.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ms.add_argument("--served-model-name", default="mock", help="model id the API reports and accepts")
    ms.add_argument("--log", default=None, help="JSONL log of every chunk's actual send time")
    ms.set_defaults(func=cmd_mock_server)
    return p


def cmd_env(args) -> int:
    from inferd.commands.env import run_env

    return run_env(args)


def cmd_generate(args) -> int:
    from inferd.commands.generate import run_generate

    return run_generate(args)


def cmd_chat(args) -> int:
    from inferd.commands.generate import run_chat

    return run_chat(args)


def apply_yaml_config(parser: argparse.ArgumentParser, argv: list[str], args):
    """Options from a YAML file become the subcommand's defaults; flags on the command line win."""
    from inferd.config import yaml_defaults

    sub = parser.subcommands[args.cmd]
    dests = {a.dest for a in sub._actions} - {"config", "func", "help"}
    if args.cmd == "serve":
        dests.add("models")
    found = yaml_defaults(args.config, dests)
    several = any(a.dest == "model" and isinstance(a, argparse._AppendAction) for a in sub._actions)
    if several and "model" in found:
        # an appending flag would add the command line's models to the file's: the command line wins
        found["model"] = None if "--model" in argv or any(x.startswith("--model=") for x in argv) else (
            [found["model"]] if found["model"] is not None else None)
    sub.set_defaults(**found)
    return parser.parse_args(argv)


def cmd_serve(args) -> int:
    from inferd.server.serve import serve

    return serve(args)


def cmd_eval(args) -> int:
    from inferd.commands.eval import run

    return run(args)


def cmd_quantize(args) -> int:
    from inferd.commands.quantize import run

    return run(args)


def cmd_throughput(args) -> int:
    import json

    from inferd.commands.throughput import run_throughput

    res = run_throughput(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def cmd_bench(args) -> int:
    from inferd.bench.main import main as bench_main

    return bench_main(args)


def cmd_router(args) -> int:
    from inferd.router.main import run

    return run(args)


def cmd_mock_server(args) -> int:
    from inferd.bench.mock_server import main as mock_main

    if args.tokens_per_chunk < 1 or args.output_len < 0 or args.ttft_ms < 0 or args.tpot_ms < 0:
        raise InferdError("mock-server: --tokens-per-chunk must be >= 1; times and --output-len >= 0")
    return mock_main(args)


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    code, args = _run(parser, argv, args)
    if (getattr(args, "tensor_parallel_size", 1) or 1) > 1:
        from inferd.distributed.comm import torchrun_rank

        if torchrun_rank() is not None:
            # A rank torchrun started ends without interpreter teardown, as the ranks inferd starts do:
            # destroying gloo's process group and the rendezvous store there aborted rank 0 now and then
            # (SIGABRT, "terminate called without an active exception") after its work was done and printed.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _run(parser, argv, args) -> tuple[int, object]:
    try:
        if getattr(args, "config", None):
            args = apply_yaml_config(parser, argv, args)
        if (getattr(args, "tensor_parallel_size", 1) or 1) > 1:
            from inferd.distributed.comm import torchrun_rank
            from inferd.distributed.tp_worker import run_torchrun_rank

            launched = torchrun_rank()
            if launched is not None and launched[0] != 0:  # torchrun's other ranks serve rank 0's engine
                from inferd.config import EngineConfig

                return run_torchrun_rank(EngineConfig.from_args(args), *launched), args
        return args.func(args) or 0, args
    except InferdError as e:
        sys.stderr.write(f"inferd: error: {e}\n")
        return 2, args
    except KeyboardInterrupt:
        return 130, args
    except Exception as e:  # an unexpected failure still gets one line; INFERD_DEBUG=1 shows the trace
        if os.environ.get("INFERD_DEBUG"):
            raise
        sys.stderr.write(f"inferd: internal error: {type(e).__name__}: {e}\n")
        return 1, args


if __name__ == "__main__":
    sys.exit(main())
