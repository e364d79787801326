"""The configuration route, one for every command: CLI flags or YAML -> EngineConfig -> the engine;
its model part, LoadConfig, goes whole to `inferd.loading.loader.load_model`. Knobs are named as vLLM names
them where the idea is the same."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, fields

from inferd.errors import InferdError


@dataclass
class LoadConfig:
    """What `load_model` needs to build a model: where it is, its dtype and device, and how to quantize it."""
    model: str | None = None  # None: the embedded default
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    dtype: str = "auto"  # auto: what the fastest path on this device takes (inferd.loading.loader.auto_dtype)
    device: str = "cpu"
    quantization: str = "none"  # a name in inferd.quant.METHODS; the loader builds what it is asked (the engine's default is auto)
    quant_group_size: int = 32
    quantize_lm_head: bool = False
    lm_head_quantization: str = "none"  # none | q4_k | q5_k: a GGUF's output layer rounded again, for decode
    quantize_activations: bool = False  # int4/int8 weights x int8 activations (W4A8/W8A8)
    dense_quant: bool = False  # quantized layers keep exact dequantized weights (fp32 evaluation)
    with_tokenizer: bool = True
    # what the engine will hold beside the weights, for the loader's guard (inferd.loading.memory):
    # an explicit KV size, and the batch shape of one step's working set
    kv_cache_memory: int | str | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass
class EngineConfig:
    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    # auto, as `inferd serve`: a GGUF file from its own blocks where the kernels run, else dense (vLLM's LLM
    # also takes a GGUF's own quantization); none: the dequantized model
    quantization: str = "auto"  # a name in inferd.quant.METHODS
    quant_group_size: int = 32
    quantize_lm_head: bool = False
    lm_head_quantization: str = "none"  # none | q4_k | q5_k (inferd.quant.kquants): lossy, off by default
    quantize_activations: bool = False  # int4 weights x int8 activations (W4A8 kernel)
    dense_quant: bool = False  # quantized layers keep their exact dequantized weights (fp32 evaluation; no flag)
    enforce_eager: bool = False  # no fused C++ decode step (inferd.model.fused_decode): read by the ModelRunner only
    threads: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes ("2GiB" too); CPU default: see kv_cache_bytes
    num_kv_blocks: int | None = None  # exact pool size, overrides the memory settings (tests)
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # auto: the model's dtype
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"  # continuous | static
    seed: int = 0
    speculative_method: str | None = None  # None | draft | ngram | suffix
    num_speculative_tokens: int = 4
    # vLLM's --speculative-config JSON: it sets the method and the fields below (see SPEC_CONFIG_KEYS)
    speculative_config: str | dict | None = None
    draft_model: str | None = None  # a model path, or self:layers=N (the target's first N layers)
    draft_quantization: str = "none"  # none | int8 | int4
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_backoff: int = 8  # after a verify that kept no guess, skip lookups for 1, 2, 4 .. this many steps; 0: never
    # suffix decoding (inferd.engine.speculative.suffix), vLLM's defaults
    suffix_max_tree_depth: int = 24  # the longest context matched (and the default number of guesses)
    suffix_max_spec_factor: float = 1.0  # guesses <= factor x the matched context's length
    suffix_min_token_prob: float = 0.1  # a guess's estimated probability (match frequencies) at least this
    suffix_max_cached_requests: int = 10000  # earlier requests' outputs kept for drafting (0: none)
    suffix_max_cached_tokens: int = 1 << 18  # ... and their tokens at most (least recently used dropped first)
    spec_cost_model: bool = True  # suffix: verify only the guesses whose expected acceptance pays for their rows
    # disaggregated prefill/decode: vLLM's --kv-transfer-config JSON, and --role as its shorthand
    # (parsed by inferd.distributed.kv_transfer.config, which this layer cannot import)
    kv_transfer_config: str | dict | None = None
    role: str | None = None  # prefill | decode | both
    # the second KV tier (inferd.engine.kv_tier): a directory ("shm": one on /dev/shm) and its size limit
    kv_tier: str | None = None
    kv_tier_size: int | str = "4GiB"
    # KV events in vLLM's format (inferd.distributed.kv_events): its --kv-events-config JSON
    kv_events_config: str | dict | None = None
    data_parallel_rank: int | None = None  # set per replica by --data-parallel-size: events' rank and port offset
    # tensor parallelism (inferd.distributed): ranks, and how they talk (auto: shm on CPU, nccl on CUDA)
    tensor_parallel_size: int = 1
    tensor_parallel_backend: str = "auto"  # auto | shm | gloo | nccl
    # who starts ranks 1..N-1: mp (processes on this host) or ray (actors a Ray placement group puts on nodes)
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "PACK"  # PACK: one node where they fit; SPREAD: one rank per node where possible
    # LoRA adapters (vLLM's flags): name=path PEFT folders loaded at start, slots per step, largest rank
    enable_lora: bool = False
    lora_modules: list | str | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    # what the engine runs (vLLM's --runner): auto (an encoder pools, a decoder generates), generate,
    # or pooling (embeddings: one forward a request, no KV cache; inferd.engine.pooling); --pooling
    # overrides the model's own pooling (mean | cls | last)
    runner: str = "auto"
    pooling: str | None = None

    def validate(self):
        if self.block_size < 1:
            raise InferdError("block_size must be at least 1")
        if self.max_num_seqs < 1:
            raise InferdError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise InferdError("max_num_batched_tokens must be at least 1")
        if self.scheduling not in ("continuous", "static"):
            raise InferdError(f"unknown scheduling {self.scheduling!r} (choose continuous or static)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InferdError("gpu_memory_utilization must be in (0, 1]")
        if self.speculative_config is not None:
            if self.speculative_method not in (None, "none", ""):
                raise InferdError("give --speculative-config or --speculative-method, not both")
            for k, v in parse_speculative_config(self.speculative_config).items():
                setattr(self, k, v)
            self.speculative_config = None  # applied: validating again (a copy, another process) is a no-op
        if self.speculative_method in ("none", ""):
            self.speculative_method = None
        if self.speculative_method is not None:
            if self.speculative_method not in SPEC_METHODS:
                raise InferdError(f"unknown speculative method {self.speculative_method!r} "
                                  f"(choose {', '.join(SPEC_METHODS)})")
            if self.num_speculative_tokens is None or self.num_speculative_tokens < 1:
                raise InferdError("num_speculative_tokens must be at least 1")
            if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
                raise InferdError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS} (each guess "
                                  "is a row of the verify step)")
            if self.speculative_method == "suffix":
                check_suffix_options(self)
            if self.speculative_method == "draft" and not self.draft_model:
                raise InferdError("speculative method draft needs --draft-model (a model path or self:layers=N)")
            if self.speculative_method == "ngram" and not 1 <= self.ngram_min <= self.ngram_max:
                raise InferdError("ngram lookup needs 1 <= ngram_min <= ngram_max")
            if self.ngram_backoff < 0:
                raise InferdError("ngram_backoff must be >= 0")
        if self.draft_quantization not in ("none", "int8", "int4"):
            raise InferdError(f"unknown draft quantization {self.draft_quantization!r} (choose none, int8, int4)")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.kv_tier_size = parse_bytes(self.kv_tier_size)
        if self.kv_tier is not None:
            if not self.enable_prefix_caching:
                raise InferdError("--kv-tier keeps prefix-cache blocks: it needs prefix caching (drop --no-prefix-caching)")
            if self.tensor_parallel_size > 1:
                raise InferdError("--kv-tier with tensor parallelism is not supported yet (each rank holds a "
                                  "share of every block): drop --tensor-parallel-size or --kv-tier")
            if self.kv_tier_size < 1:
                raise InferdError("--kv-tier-size must be positive")
        if self.tensor_parallel_size is None or self.tensor_parallel_size < 1:
            raise InferdError("tensor_parallel_size must be at least 1")
        if self.tensor_parallel_backend not in ("auto", "shm", "gloo", "nccl"):
            raise InferdError(f"unknown tensor-parallel backend {self.tensor_parallel_backend!r} "
                              "(choose auto, shm, gloo, nccl)")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise InferdError(f"unknown distributed executor backend {self.distributed_executor_backend!r} "
                              "(choose mp, ray)")
        self.ray_placement_strategy = str(self.ray_placement_strategy).upper()
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise InferdError(f"unknown Ray placement strategy {self.ray_placement_strategy!r} "
                              "(choose PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)")
        if isinstance(self.lora_modules, (str, dict)):
            self.lora_modules = [self.lora_modules]
        for spec in self.lora_modules or []:
            lora_module(spec)  # a malformed entry fails here, before any model loads
        if self.runner not in ("auto", "generate", "pooling"):
            raise InferdError(f"unknown runner {self.runner!r} (choose auto, generate, pooling)")
        if self.pooling not in (None, "mean", "cls", "last"):
            raise InferdError(f"unknown pooling {self.pooling!r} (choose mean, cls, last)")
        if self.lora_modules and not self.enable_lora:
            self.enable_lora = True  # naming adapters asks for them (vLLM wants both flags; one is enough)
        if self.enable_lora:
            if self.max_loras is None or self.max_loras < 1:
                raise InferdError("max_loras must be at least 1")
            if self.max_lora_rank is None or self.max_lora_rank < 1:
                raise InferdError("max_lora_rank must be at least 1")
            if self.kv_transfer_config is not None or self.role is not None:
                raise InferdError("LoRA adapters with disaggregated prefill/decode are not supported yet")
            if self.speculative_method == "draft":
                raise InferdError("LoRA adapters with a draft model are not supported yet (the draft would need "
                                  "each adapter too): use the ngram or suffix method, or drop --enable-lora")
        if self.tensor_parallel_size > 1:
            if self.kv_transfer_config is not None or self.role is not None:
                raise InferdError("tensor parallelism does not combine with disaggregated prefill/decode yet "
                                  "(the KV connector reads one pool): drop --tensor-parallel-size or --role")
            if self.speculative_method == "draft" and str(self.draft_model).startswith("self:"):
                raise InferdError("a self-draft shares the target's layers, which tensor parallelism splits: "
                                  "use --speculative-method ngram or a separate --draft-model")
        return self

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def load_config(self, **over) -> LoadConfig:
        """The model part of this configuration."""
        kw = {k: getattr(self, k) for k in LoadConfig.field_names() if hasattr(self, k)}
        return LoadConfig(**{**kw, **over})

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        """Parsed CLI arguments (YAML defaults already merged by the parser) -> a validated config;
        arguments a command lacks keep the defaults."""
        cfg = cls()
        for name in cls.field_names():
            if getattr(args, name, None) is not None:
                setattr(cfg, name, getattr(args, name))
        if isinstance(cfg.model, list):  # `inferd serve`'s repeatable --model (one model here)
            if len(cfg.model) > 1:
                raise InferdError("one --model here (several are for `inferd serve`)")
            cfg.model = cfg.model[0] if cfg.model else None
        if cfg.device == "cpu" and getattr(args, "gpu_memory_utilization", 0.9) != 0.9:
            sys.stderr.write("inferd: note: --gpu-memory-utilization applies to CUDA only; on CPU the KV pool "
                             "is sized by --kv-cache-memory\n")
        return cfg.validate()


SPEC_METHODS = ("draft", "ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 64
# vLLM's method names -> ours
_SPEC_METHOD_NAMES = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft", "draft": "draft"}
# --speculative-config keys (vLLM's, then inferd's own) -> (EngineConfig field, type)
SPEC_CONFIG_KEYS = {
    "num_speculative_tokens": ("num_speculative_tokens", int),
    "model": ("draft_model", str),
    "quantization": ("draft_quantization", str),
    "prompt_lookup_min": ("ngram_min", int),
    "prompt_lookup_max": ("ngram_max", int),
    "suffix_decoding_max_tree_depth": ("suffix_max_tree_depth", int),
    "suffix_decoding_max_spec_factor": ("suffix_max_spec_factor", float),
    "suffix_decoding_min_token_prob": ("suffix_min_token_prob", float),
    "suffix_decoding_max_cached_requests": ("suffix_max_cached_requests", int),
    "suffix_decoding_max_cached_tokens": ("suffix_max_cached_tokens", int),
    "ngram_backoff": ("ngram_backoff", int),
    "cost_model": ("spec_cost_model", bool),
}


def parse_speculative_config(value) -> dict:
    """vLLM's --speculative-config ({"method": "suffix", "num_speculative_tokens": 16, ...}, or the
    dict a YAML config gave) -> EngineConfig fields; anything it cannot honour is one InferdError.
    For suffix, num_speculative_tokens defaults to the tree depth, as in vLLM."""
    d = json_flag(value, "--speculative-config")
    method = d.pop("method", None)
    if method is None and d.get("model"):
        method = "draft_model"  # vLLM infers a draft model from "model"
    if method not in _SPEC_METHOD_NAMES:
        raise InferdError(f"--speculative-config: method must be one of {', '.join(sorted(_SPEC_METHOD_NAMES))}, "
                          f"got {method!r}")
    out: dict = {"speculative_method": _SPEC_METHOD_NAMES[method]}
    for key, v in d.items():
        if key not in SPEC_CONFIG_KEYS:
            raise InferdError(f"--speculative-config: unknown or unsupported key {key!r} (inferd reads "
                              f"method, {', '.join(SPEC_CONFIG_KEYS)})")
        field_name, kind = SPEC_CONFIG_KEYS[key]
        if v is None:
            continue
        ok = isinstance(v, bool) if kind is bool else (
            isinstance(v, kind) and not isinstance(v, bool) if kind is not float
            else isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            raise InferdError(f"--speculative-config: {key} must be {kind.__name__ if kind is not str else 'a string'}, "
                              f"got {v!r}")
        out[field_name] = float(v) if kind is float else v
    if out["speculative_method"] == "suffix" and "num_speculative_tokens" not in out:
        out["num_speculative_tokens"] = min(out.get("suffix_max_tree_depth", EngineConfig.suffix_max_tree_depth),
                                            MAX_SPECULATIVE_TOKENS)
    return out


def check_suffix_options(cfg: "EngineConfig"):
    if cfg.suffix_max_tree_depth < 1:
        raise InferdError("suffix_decoding_max_tree_depth must be at least 1")
    if not cfg.suffix_max_spec_factor > 0:
        raise InferdError("suffix_decoding_max_spec_factor must be > 0")
    if not 0 <= cfg.suffix_min_token_prob <= 1:
        raise InferdError("suffix_decoding_min_token_prob must be in [0, 1]")
    if cfg.suffix_max_cached_requests < 0 or cfg.suffix_max_cached_tokens < 0:
        raise InferdError("suffix_decoding_max_cached_requests and _tokens must be >= 0")


def yaml_defaults(path: str, dests: set[str]) -> dict:
    """A YAML file of `option: value` -> defaults for the options named in `dests` (dashes or
    underscores); an unknown key is a clear error, not ignored."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise InferdError(f"cannot read config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InferdError(f"invalid YAML in {path}: {e}") from None
    if not isinstance(data, dict):
        raise InferdError(f"config {path} must be a mapping of option: value")
    defaults = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key == "enable_prefix_caching":
            defaults[key] = bool(v)
            continue
        if key == "models" and key in dests:
            if not isinstance(v, list):
                raise InferdError(f"models in config {path} must be a list of mappings (model: PATH, name: ID, ...)")
            defaults[key] = v
            continue
        if key not in dests:
            raise InferdError(f"unknown key {k!r} in config {path}")
        defaults[key] = str(v) if key in ("model", "kv_cache_memory") and v is not None else v
    return defaults


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def json_flag(value, flag: str) -> dict:
    """A flag that takes a JSON object (vLLM's --kv-transfer-config, --kv-events-config), or the dict a
    YAML config gave: the dict, or one InferdError naming the flag."""
    if isinstance(value, dict):
        return dict(value)
    try:
        data = json.loads(value)
    except ValueError as e:
        raise InferdError(f"{flag} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InferdError(f"{flag} must be a JSON object")
    return data


def parse_bytes(v) -> int:
    if isinstance(v, (int, float)):
        return int(v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise InferdError(f"cannot read a memory size from {v!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def lora_module(spec) -> tuple[str, str]:
    """One --lora-modules entry -> (name, path): name=path, or vLLM's JSON {"name": .., "path": ..}."""
    if isinstance(spec, dict):
        name, path = spec.get("name"), spec.get("path")
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        import json

        try:
            d = json.loads(spec)
        except json.JSONDecodeError:
            raise InferdError(f"--lora-modules: {spec!r} is not name=path or a JSON object") from None
        name, path = (d.get("name"), d.get("path")) if isinstance(d, dict) else (None, None)
    else:
        name, _, path = str(spec).partition("=")
    if not name or not path:
        raise InferdError(f"--lora-modules: {spec!r} is not name=path")
    return str(name), str(path)
