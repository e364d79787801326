"""Tokenizers for inferd: built from a GGUF file's vocabulary, or loaded from a Hugging Face folder.

Everything runs on the Rust `tokenizers` library; chat templates are rendered with a sandboxed
jinja2 environment configured the way Hugging Face renders them. `transformers` is never imported
here (the tests use it as an oracle only).

GGUF files carry no `tokenizer.json`, only llama.cpp's description of one: the token strings, the
merges, a per-token type and the name of the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the
tokenizer from that the same way `transformers` does when it loads a GGUF, so that token ids agree
with it:

* `gpt2` (byte-level BPE): a BPE model over the byte alphabet, a pre-tokenizer split chosen by
  `tokenizer.ggml.pre` for the families whose regex differs from GPT-2's (Llama 3, Qwen 2, GPT-4o
  style), and plain GPT-2 `ByteLevel` otherwise -- `smollm` included, see `_BYTE_LEVEL_SPLITS`.
* `llama` (SentencePiece-style BPE with byte fallback): Metaspace pre-tokenizer, merges from the
  file or derived from the token scores.

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added
tokens, so both are matched whole in text.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.models import BPE

from inferd.errors import InferdError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "DEFAULT_CHAT_TEMPLATE"]

# llama.cpp token types (gguf TokenType)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Special tokens that end a turn in the common chat formats. A token with one of these names that the
# vocabulary marks as special (control) also stops generation, as llama.cpp does ("end of generation").
_END_OF_TURN_NAMES = frozenset(
    {
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|endoftext|>",
        "<|end|>",
        "<end_of_turn>",
        "<|return|>",
        "</s>",
        "<｜end▁of▁sentence｜>",
    }
)

# Pre-tokenizer split regexes (the ones these model families publish in their tokenizer.json), keyed
# by `tokenizer.ggml.pre`. A name not listed here gets GPT-2's ByteLevel regex -- which is also what
# transformers does, and is why `smollm` is absent: SmolLM2's own tokenizer.json isolates every digit
# (Digits(individual_digits=True) before ByteLevel), but transformers' GGUF loader does not, and we
# follow transformers. With SmolLM2's vocabulary (no merges between digits) the two only differ when
# a digit follows two or more whitespace characters: "a  1" -> ["a", "Ġ", "Ġ", "1"] here (and in
# transformers) but ["a", "ĠĠ", "1"] with SmolLM2's tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}

# Used when a model has no chat template at all.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters stand for themselves; the remaining 68 are given the
    code points from U+0100 upwards, in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _special_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InferdError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InferdError(f"cannot read {path}: expected a JSON object")
    return data


class Tokenizer:
    """A text <-> token id mapping plus the model's special tokens and chat template."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: set[int]
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        special_ids: Iterable[int] | None = None,
    ):
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._valid(bos_token_id)
        self.eos_token_id = self._valid(eos_token_id)
        self.pad_token_id = self._valid(pad_token_id)
        self.unk_token_id = self._valid(unk_token_id)
        self.add_bos = bool(add_bos) and self.bos_token_id is not None
        self.add_eos = bool(add_eos) and self.eos_token_id is not None
        self.chat_template = chat_template or None

        if special_ids is None:
            special_ids = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
        self._special_ids = frozenset(int(i) for i in special_ids)

        eos = {int(i) for i in extra_eos_ids if self._valid(i) is not None}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        for i in self._special_ids:
            if backend.id_to_token(i) in _END_OF_TURN_NAMES:
                eos.add(i)
        self.eos_token_ids = eos
        self._compiled_template = None

    def _valid(self, i) -> int | None:
        if i is None:
            return None
        try:
            i = int(i)
        except (TypeError, ValueError):
            return None
        return i if 0 <= i < self.vocab_size else None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, "
            f"eos_ids={sorted(self.eos_token_ids)}, add_bos={self.add_bos})"
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(cls, model_path: str) -> "Tokenizer":
        """From a .gguf file, a Hugging Face model folder (tokenizer.json), or a folder with one .gguf."""
        path = os.path.expanduser(str(model_path))
        if os.path.isfile(path):
            from inferd.gguf_file import GGUF_MAGIC, read_gguf_metadata

            with open(path, "rb") as f:
                magic = f.read(len(GGUF_MAGIC))
            if magic == GGUF_MAGIC or path.lower().endswith(".gguf"):
                return cls.from_gguf_metadata(read_gguf_metadata(path))
            if os.path.basename(path) == "tokenizer.json":
                return cls.from_hf_folder(os.path.dirname(path) or ".")
            raise InferdError(f"cannot load a tokenizer from {path}: expected a .gguf file or a model folder")
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                return cls.from_hf_folder(path)
            ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                return cls.load(os.path.join(path, ggufs[0]))
            if len(ggufs) > 1:
                raise InferdError(f"{path} holds several .gguf files ({', '.join(ggufs)}); name one of them")
            raise InferdError(f"no tokenizer in {path}: expected tokenizer.json or a .gguf file")
        raise InferdError(f"model path not found: {path}")

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise InferdError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        tokens = [str(t) for t in tokens]
        kind = meta.get("tokenizer.ggml.model", "gpt2")
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        if len(types) != len(tokens):
            types = [_TT_NORMAL] * len(tokens)

        if kind == "gpt2":
            backend, vocab_names = cls._byte_level_from_gguf(meta, tokens)
            add_bos_default = False
        elif kind == "llama":
            backend, vocab_names = cls._sentencepiece_from_gguf(meta, tokens, types)
            add_bos_default = True
        else:
            raise InferdError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE, llama sentencepiece BPE)"
            )

        # Control (and unknown) tokens are matched whole and are "special" (skipped by decode(skip_special_tokens));
        # user-defined ones are matched whole but kept in decoded text. In a byte-level vocabulary a
        # "control" token spelled outside the byte alphabet is a converter mislabel and is left out.
        alphabet = set(_byte_alphabet().values()) if kind == "gpt2" else None
        control, user = [], []
        for tok, ttype in zip(tokens, types):
            if ttype in (_TT_CONTROL, _TT_UNKNOWN) and (alphabet is None or set(tok) <= alphabet):
                control.append(AddedToken(tok, normalized=False, special=True))
            elif ttype == _TT_USER_DEFINED and tok in vocab_names:
                user.append(AddedToken(tok, normalized=False, special=False))
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        extra_eos = [i for i in (tid("eot_token_id"), tid("eom_token_id")) if i is not None]
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        special_ids = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
        return cls(
            backend,
            bos_token_id=tid("bos_token_id"),
            eos_token_id=tid("eos_token_id"),
            extra_eos_ids=extra_eos,
            pad_token_id=tid("padding_token_id"),
            unk_token_id=tid("unknown_token_id"),
            add_bos=add_bos_default if add_bos is None else bool(add_bos),
            add_eos=bool(add_eos),
            chat_template=(meta.get("tokenizer.chat_template")
                           or _family_template(meta.get("general.architecture"))),
            special_ids=special_ids,
        )

    @staticmethod
    def _byte_level_from_gguf(meta: dict, tokens: list[str]) -> tuple[_RustTokenizer, set[str]]:
        alphabet = _byte_alphabet()
        chars = set(alphabet.values())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            # Some converters store a token's raw text rather than its byte-alphabet spelling.
            if not set(tok) <= chars:
                tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
            vocab[tok] = i
        merges = [tuple(m.split(" ", 1)) for m in (meta.get("tokenizer.ggml.merges") or [])]
        model = BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        backend = _RustTokenizer(model)
        split = _BYTE_LEVEL_SPLITS.get(meta.get("tokenizer.ggml.pre") or "")
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        return backend, set(vocab)

    @staticmethod
    def _sentencepiece_from_gguf(meta: dict, tokens: list[str], types: list[int]) -> tuple[_RustTokenizer, set[str]]:
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges_raw = meta.get("tokenizer.ggml.merges")
        if merges_raw:
            merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        else:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = _merges_from_scores(tokens, [float(s) for s in scores])
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        unk_token = tokens[int(unk)] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
        model = BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None)
        backend = _RustTokenizer(model)
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
        add_prefix = True if add_prefix is None else bool(add_prefix)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
        )
        seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            seq.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(seq)
        return backend, set(vocab)

    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        path = os.path.expanduser(str(path))
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise InferdError(f"no tokenizer.json in {path} (only fast-tokenizer folders are supported)")
        try:
            backend = _RustTokenizer.from_file(tj)
        except Exception as e:
            raise InferdError(f"cannot load {tj}: {e}") from None
        # Padding/truncation saved in tokenizer.json are batch settings; encode() is per text.
        backend.no_padding()
        backend.no_truncation()

        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        gen_path = os.path.join(path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}

        # Tokens listed in tokenizer_config's added_tokens_decoder that tokenizer.json lacks.
        decoder_cfg = cfg.get("added_tokens_decoder") or {}
        if isinstance(decoder_cfg, dict):
            have = backend.get_vocab(with_added_tokens=True)
            missing = []
            for spec in decoder_cfg.values():
                name = _special_name(spec)
                if name and name not in have:
                    missing.append(AddedToken(name, special=bool(spec.get("special", False)), normalized=False))
            if missing:
                backend.add_tokens(missing)

        def tok_id(key: str) -> int | None:
            name = _special_name(cfg.get(key))
            return backend.token_to_id(name) if name is not None else None

        def gen_ids(key: str) -> list[int]:
            v = gen.get(key)
            if isinstance(v, bool):
                return []
            if isinstance(v, int):
                return [v]
            if isinstance(v, list):
                return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
            return []

        bos = tok_id("bos_token")
        if bos is None and gen_ids("bos_token_id"):
            bos = gen_ids("bos_token_id")[0]
        eos = tok_id("eos_token")
        gen_eos = gen_ids("eos_token_id")
        if eos is None and gen_eos:
            eos = gen_eos[0]
        pad = tok_id("pad_token")
        if pad is None and gen_ids("pad_token_id"):
            pad = gen_ids("pad_token_id")[0]

        # BOS: the tokenizer.json post-processor may already add it; tokenizer_config can ask for it.
        add_bos_cfg = cfg.get("add_bos_token")
        probe_with = backend.encode("a", add_special_tokens=True).ids
        probe_without = backend.encode("a", add_special_tokens=False).ids
        post_adds_bos = bos is not None and probe_with[:1] == [bos] and probe_without[:1] != [bos]
        manual_bos = bool(add_bos_cfg) and not post_adds_bos

        template = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if template is None:
            template = _pick_template(cfg.get("chat_template"))
        if template is None:
            ct_path = os.path.join(path, "chat_template.json")
            if os.path.isfile(ct_path):
                template = _pick_template(_read_json(ct_path).get("chat_template"))
        if template is None and os.path.isfile(os.path.join(path, "config.json")):
            template = _family_template(_read_json(os.path.join(path, "config.json")).get("model_type"))

        tok = cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_ids=gen_eos,
            pad_token_id=pad,
            unk_token_id=tok_id("unk_token"),
            add_bos=manual_bos,
            add_eos=False,
            chat_template=template,
        )
        tok._post_adds_bos = post_adds_bos
        tok.add_bos = tok.add_bos or post_adds_bos
        tok._special_token_names = {
            k: _special_name(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        return tok

    # ------------------------------------------------------------------ encode / decode

    _post_adds_bos = False
    _special_token_names: dict | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos and not self._post_adds_bos:
                ids = [self.bos_token_id] + ids
            if self.add_eos:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self.backend.token_to_id(s)

    def is_special(self, i: int) -> bool:
        return int(i) in self._special_ids

    # ------------------------------------------------------------------ chat template

    def _token_name(self, key: str) -> str:
        names = self._special_token_names or {}
        if names.get(key) is not None:
            return names[key]
        i = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id, "unk_token": self.unk_token_id,
             "pad_token": self.pad_token_id}[key]
        return (self.id_to_token(i) or "") if i is not None else ""

    def _template(self):
        if self._compiled_template is None:
            try:
                self._compiled_template = _jinja_env().from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
            except Exception as e:
                raise InferdError(f"invalid chat template: {type(e).__name__}: {e}") from None
        return self._compiled_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise InferdError("chat messages must be a list of objects with 'role' and 'content'")
        # Like Hugging Face: keys set to None (e.g. OpenAI's content=None) are dropped, not rendered.
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {
            "bos_token": self._token_name("bos_token"),
            "eos_token": self._token_name("eos_token"),
            "unk_token": self._token_name("unk_token"),
            "pad_token": self._token_name("pad_token"),
            "tools": None,
            "documents": None,
        }
        variables.update(kwargs)
        variables["messages"] = msgs
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        template = self._template()
        try:
            return render_bounded(template, variables)
        except InferdError:
            raise
        except Exception as e:
            raise InferdError(f"chat template error: {type(e).__name__}: {e}") from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> str | list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if tokenize:
            # The template writes BOS itself when the model wants one.
            return self.encode(text, add_special_tokens=False)
        return text


# A model file without a chat template (a base model's) gets its family's own turn format, as llama.cpp
# falls back on a built-in one: GGUF general.architecture or config.json model_type -> inferd/templates/
FAMILY_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma"}


def _family_template(family: str | None) -> str | None:
    name = FAMILY_TEMPLATES.get(family or "")
    if name is None:
        return None
    from importlib import resources

    return resources.files("inferd").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens of the
    vocabulary is a merge, ranked by the merged token's score (higher first)."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for tok, score in zip(tokens, scores):
        pairs = []
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in index and right in index:
                pairs.append((index[left], index[right], left, right))
        pairs.sort()
        for _, _, left, right in pairs:
            ranked.append((-score, len(left), len(right), left, right))
    ranked.sort(key=lambda r: (r[0], r[1], r[2]))
    return [(r[3], r[4]) for r in ranked]


_ENV = None

# A chat template comes with the model file: untrusted code. The sandbox already refuses attribute
# escapes (`__class__`, `__subclasses__`); these bound what it may cost: loop iterations over
# range() and calls, the size of `*` and `**` results, and the rendered text.
TEMPLATE_MAX_STEPS = 1_000_000  # range() items plus calls, in one render
TEMPLATE_MAX_CHARS = 8 * 1024 * 1024  # rendered text; also the largest str/list a `*` may build
_steps = None  # contextvars.ContextVar of the current render's remaining steps (created with the env)


def render_bounded(template, variables: dict) -> str:
    token = _steps.set([TEMPLATE_MAX_STEPS])
    try:
        out, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            if n > TEMPLATE_MAX_CHARS:
                raise InferdError(f"chat template output is larger than {TEMPLATE_MAX_CHARS} characters")
            out.append(piece)
        return "".join(out)
    finally:
        _steps.reset(token)


def _charge(n: int):
    left = _steps.get(None)
    if left is None:  # rendering outside render_bounded (a test, a tool): no budget
        return
    left[0] -= n
    if left[0] < 0:
        raise InferdError(f"chat template takes more than {TEMPLATE_MAX_STEPS} steps (a loop that does not end?)")


def _jinja_env():
    """A sandboxed environment set up like Hugging Face's chat template renderer."""
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
        # just renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Unlike jinja's own filter: no HTML escaping, and json.dumps' options are exposed.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    import contextvars

    from jinja2.exceptions import SecurityError

    global _steps
    _steps = contextvars.ContextVar("inferd_template_steps")
    widths = {"ljust", "rjust", "center", "zfill", "expandtabs"}

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(right) > 256:
                raise SecurityError("exponent too large in chat template")
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and len(seq) * k > TEMPLATE_MAX_CHARS:
                        raise SecurityError("sequence repetition too large in chat template")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _charge(1)
            if getattr(__obj, "__name__", None) in widths and any(isinstance(a, int) and a > 1_000_000 for a in args):
                raise SecurityError("width too large in chat template")
            return super().call(__context, __obj, *args, **kwargs)

    def bounded_range(*args):
        r = range(*args)
        if len(r) > TEMPLATE_MAX_STEPS:
            raise SecurityError(f"range of {len(r)} items in chat template")
        _charge(len(r))
        return r

    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.globals["range"] = bounded_range
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _ENV = env
    return env


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Each step decodes only a short window of tokens: those from `prefix_offset` (the start of the
    text emitted last time) to the end, and subtracts the decoding of the already-emitted part of
    that window (`prefix_offset:read_offset`). Decoding a window rather than single tokens keeps
    multi-token characters and decoder rules (e.g. SentencePiece spaces) right; text ending in
    U+FFFD (an incomplete UTF-8 character) is held back until the next token completes it. The
    concatenated deltas equal `tokenizer.decode(all_ids, skip_special_tokens)` with the U+FFFD that
    an incomplete character at the very end decodes to removed: when the sequence stops inside a
    multi-byte character (max_tokens cut it), flush() drops those bytes rather than emit U+FFFD, as
    vLLM's incremental detokenizer does, streamed or not.

    `prompt_ids` is accepted for API compatibility but not used: the output is defined as the
    decoding of the generated ids alone, which is what a non-streaming response returns too.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(_ids[_prefix_offset:_read_offset])

    def _trim(self) -> None:
        # Tokens before the window are never decoded again: drop them to keep memory flat.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def add(self, new_ids: list[int]) -> str:
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        tok = self.tokenizer
        if self.skip_special_tokens:
            # A skipped token contributes nothing, exactly as if it were absent from the sequence.
            new_ids = [int(i) for i in new_ids if not tok.is_special(i)]
        else:
            new_ids = [int(i) for i in new_ids]
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        window = tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(window) <= len(self._prefix_text) or window.endswith("\ufffd"):
            return ""
        delta = window[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = tok.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        window = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        delta = window[len(self._prefix_text) :].rstrip("\ufffd")  # the bytes of an unfinished character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self.tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        self._trim()
        self.text += delta
        return delta
