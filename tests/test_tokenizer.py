"""inferd.tokenizer against transformers (the oracle) loading the same GGUF file."""
import json
import os
import subprocess
import sys

import pytest

from inferd.errors import InferdError
from inferd.tokenizer import DEFAULT_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer

EXTRA_TEXTS = [
    "Hello 👋 world 🌍🎉! 👨‍👩‍👧‍👦 family",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "café naïve résumé Ångström Straße Œuvre",
    "Ελληνικά και русский текст",
    "line1\nline2\n\n\nline3\r\nline4\n",
    "a   b    c     d\t\te",
    "numbers like 12345 and 3.14 and 1,000,000 and -42",
    "digits after spaces: a  1, x   2024, 4 ½ months, 10² m²",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special <|im_start|> tokens<|endoftext|>",
    "code: def f(x):\n    return x ** 2  # square\n",
    "don't can't we'll I'M",
    "   leading spaces",
    "trailing spaces   ",
    " ",
    "\n",
]



CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本 🎉."},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\nd"},
    ],
]


@pytest.fixture(scope="module")
def wiki_lines(wikitext_file) -> list[str]:
    """WikiText-2's first 200 non-blank lines (the test skips without the file)."""
    with open(wikitext_file, encoding="utf-8") as f:
        return [line for line in f.read().split("\n") if line.strip()][:200]


@pytest.fixture(params=["extra", "wikitext"])
def texts(request) -> list[str]:
    """The hand-picked EXTRA_TEXTS, then (a second run) WikiText-2's lines, which skips without the file."""
    return EXTRA_TEXTS if request.param == "extra" else request.getfixturevalue("wiki_lines")


@pytest.fixture(scope="module")
def gguf_meta(default_gguf_path):
    from inferd.gguf_file import open_gguf, read_metadata

    return read_metadata(open_gguf(default_gguf_path))


@pytest.fixture(scope="module")
def tok(gguf_meta):
    return Tokenizer.from_gguf_metadata(gguf_meta)


@pytest.fixture(scope="module")
def hf(default_gguf_path):
    pytest.importorskip("transformers")
    from helpers import hf_gguf_tokenizer

    return hf_gguf_tokenizer(default_gguf_path)


# ---------------------------------------------------------------------------- ids vs transformers


def test_wikitext_lines_present(wiki_lines):
    assert len(wiki_lines) == 200


def test_ids_match_transformers_wikitext(tok, hf, wiki_lines):
    for line in wiki_lines:
        assert tok.encode(line) == hf.encode(line), line
        assert tok.encode(line, add_special_tokens=False) == hf.encode(line, add_special_tokens=False), line


@pytest.mark.parametrize("text", EXTRA_TEXTS)
def test_ids_match_transformers_extra(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_decode_matches_transformers(tok, hf, texts):
    for text in texts:
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_special_tokens_whole_in_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_single_tokens(tok):
    # SmolLM2's vocabulary has no multi-digit tokens.
    assert [tok.id_to_token(i) for i in tok.encode("12345 3.14")] == ["1", "2", "3", "4", "5", "Ġ", "3", ".", "1", "4"]


def test_metadata(tok, hf):
    assert tok.vocab_size == 49152 == len(hf)
    assert tok.bos_token_id == 1 == hf.bos_token_id
    assert tok.eos_token_id == 2 == hf.eos_token_id
    assert tok.pad_token_id == 2 == hf.pad_token_id
    assert tok.add_bos is False
    assert tok.eos_token_ids >= {2}
    assert tok.eos_token_ids <= {0, 2}  # <|endoftext|> may also end generation
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert all(tok.is_special(i) for i in range(17))
    assert not tok.is_special(17) and not tok.is_special(1000)
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("no-such-token-xyz") is None
    assert tok.id_to_token(10**7) is None


def test_roundtrip(tok, texts):
    for text in texts[:40]:
        assert tok.decode(tok.encode(text)) == text


# ---------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf, messages):
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == hf.encode(ours, add_special_tokens=False)
    assert ids[0] == 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_chat_template_features(tok):
    t = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template=(
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ strftime_now('%Y') | length }}{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}"
        "{{ extra_var }}"
    ))
    out = t.apply_chat_template([{"role": "user", "content": "é<b>", "name": None}], extra_var="!")
    # trim_blocks (as in transformers) eats the newline right after a block tag
    assert out == '<|im_start|>{"role": "user", "content": "é<b>"}4!'


def test_chat_template_errors(tok):
    t = Tokenizer(tok.backend, chat_template="{{ raise_exception('no system role allowed') }}")
    with pytest.raises(InferdError, match="no system role allowed"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    t = Tokenizer(tok.backend, chat_template="{% for %}")
    with pytest.raises(InferdError):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    t = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InferdError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_fallback(tok):
    t = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2)
    assert t.chat_template is None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    assert t.apply_chat_template(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "im_start" in DEFAULT_CHAT_TEMPLATE


# ---------------------------------------------------------------------------- incremental detokenizer


def _stream(tok, ids, chunk, skip):
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_full_decode(tok, chunk, skip, texts):
    for text in texts:
        ids = tok.encode(text)
        full = tok.decode(ids, skip_special_tokens=skip)
        deltas = _stream(tok, ids, chunk, skip)
        assert "".join(deltas) == full.rstrip("\ufffd"), text
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas), text


def test_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"
    assert detok.flush() == ""


def test_detokenizer_flush_drops_incomplete_tail(tok):
    ids = tok.encode("ok 🎉")
    detok = IncrementalDetokenizer(tok)
    out = detok.add(ids[:-1])
    out += detok.flush()
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the cut really is inside the emoji
    assert out == tok.decode(ids[:-1]).rstrip("\ufffd") == "ok " and detok.text == out


def test_detokenizer_window_stays_small(tok, wiki_lines):
    ids = tok.encode(" ".join(wiki_lines[:50]))
    assert len(ids) > 1000
    lengths = []

    class Spy:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, window, skip_special_tokens=False):
            lengths.append(len(window))
            return tok.decode(window, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Spy())
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(lengths) <= 8
    assert len(lengths) <= 2 * len(ids) + 2


def test_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHello<|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == "assistant\nHello"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == "<|im_start|>assistant\nHello<|im_end|>"


# ---------------------------------------------------------------------------- HF folders and load()


def _write_folder(tmp_path, tok, **cfg):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": tok.chat_template,
    }
    config.update(cfg)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_from_hf_folder(tmp_path, tok, texts):
    path = _write_folder(tmp_path, tok)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    ht = Tokenizer.from_hf_folder(path)
    for text in texts[:50]:
        assert ht.encode(text) == tok.encode(text), text
        assert ht.decode(ht.encode(text)) == text
    assert (ht.bos_token_id, ht.eos_token_id, ht.pad_token_id, ht.add_bos) == (1, 2, 2, False)
    assert ht.eos_token_ids == {0, 2}
    assert ht.vocab_size == tok.vocab_size
    assert all(ht.is_special(i) for i in range(17)) and not ht.is_special(17)
    assert ht.chat_template == tok.chat_template
    for messages in CONVERSATIONS:
        assert ht.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert Tokenizer.load(path).encode("hello world") == tok.encode("hello world")


def test_hf_folder_matches_transformers(tmp_path, tok):
    transformers = pytest.importorskip("transformers")
    path = _write_folder(tmp_path, tok, eos_token="<|im_end|>")
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ht = Tokenizer.from_hf_folder(path)
    for text in EXTRA_TEXTS:
        assert ht.encode(text) == ref.encode(text)
    for messages in CONVERSATIONS:
        assert ht.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_hf_folder_add_bos_and_jinja_file(tmp_path, tok):
    path = _write_folder(tmp_path, tok, add_bos_token=True, chat_template=None)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ht = Tokenizer.from_hf_folder(path)
    assert ht.add_bos is True
    assert ht.encode("hi") == [1] + tok.encode("hi")
    assert ht.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert ht.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi"
    assert ht.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True) == [1] + tok.encode("hi")


def test_load_gguf_file_and_folder(default_gguf_path, tok):
    t = Tokenizer.load(default_gguf_path)
    assert t.encode("Hello, world!") == tok.encode("Hello, world!")
    assert t.eos_token_ids == tok.eos_token_ids


def test_load_errors(tmp_path):
    with pytest.raises(InferdError, match="not found"):
        Tokenizer.load(str(tmp_path / "missing"))
    with pytest.raises(InferdError, match="no tokenizer"):
        Tokenizer.load(str(tmp_path))
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(InferdError):
        Tokenizer.load(str(bad))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 16)
    with pytest.raises(InferdError):
        Tokenizer.load(str(fake))
    with pytest.raises(InferdError):
        Tokenizer.from_gguf_metadata({})
    with pytest.raises(InferdError, match="unsupported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.model": "bert"})


# ---------------------------------------------------------------------------- sentencepiece-style GGUF


def _tiny_spm_meta(lines):
    """A small SentencePiece-style vocabulary (no merges in the file: derived from scores), its
    pieces the frequent word starts of `lines`."""
    import collections

    corpus = " ".join(lines)
    words = collections.Counter("▁" + w for w in corpus.split())
    chars = sorted(set(corpus.replace(" ", "▁")) | {"▁"})
    pieces = collections.Counter()
    for w, c in words.most_common(1500):
        for k in range(2, len(w) + 1):
            pieces[w[:k]] += c
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, ch in enumerate(chars):
        tokens.append(ch)
        types.append(1)
        scores.append(-1000.0 - i)
    seen = set(tokens)
    for i, (p, _) in enumerate(pieces.most_common(3000)):
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)
            scores.append(-float(i))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_gguf_matches_transformers(wiki_lines):
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = _tiny_spm_meta(wiki_lines)
    ours = Tokenizer.from_gguf_metadata(meta)
    d = {
        "tokenizer_type": "llama",
        "tokens": meta["tokenizer.ggml.tokens"],
        "scores": meta["tokenizer.ggml.scores"],
        "token_type": meta["tokenizer.ggml.token_type"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unk_token_id": 0,
    }
    ref, _ = convert_gguf_tokenizer("llama", d)
    assert ours.add_bos and ours.encode("hi")[0] == 1
    for text in wiki_lines[:60] + EXTRA_TEXTS + ["</s> x <s> <unk>"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
        for chunk in (1, 3):
            deltas = _stream(ours, ids, chunk, True)
            assert "".join(deltas) == ours.decode(ids, skip_special_tokens=True), text


# ---------------------------------------------------------------------------- Llama 3 and Qwen BPE

# The split regexes Llama 3's and Qwen2's tokenizer.json publish (Split, then ByteLevel without its own
# regex): digits in runs of up to three for Llama 3, one at a time for Qwen2
PUBLISHED_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("pre", list(PUBLISHED_SPLITS))
def test_llama3_and_qwen_bpe_gguf_match_transformers(pre, wiki_lines, tmp_path):
    """A byte-level BPE trained here (the `tokenizers` library) with Llama 3's or Qwen2's published
    pre-tokenizer, saved as a Hugging Face folder (tokenizer.json) and as the GGUF metadata llama.cpp
    writes for it (tokens, merges, `tokenizer.ggml.pre`): our tokenizer from the GGUF encodes and
    decodes as transformers does from the folder."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PUBLISHED_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(wiki_lines, trainers.BpeTrainer(
        vocab_size=3000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    import json

    model = json.loads(hf.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [t for t, _ in vocab],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t, _ in vocab],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
    }
    ours = Tokenizer.from_gguf_metadata(meta)
    digits = "In 2024, 1234567 people paid $3.14159 for 42 items; 007 agents."
    for text in wiki_lines[:60] + EXTRA_TEXTS + [digits, "<|eot_id|> x <|begin_of_text|>"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
    # the two splits differ where they should: Llama 3 cuts digits in threes (merges within them),
    # Qwen2 one at a time
    pieces = [ours.decode([i]) for i in ours.encode("1234567", add_special_tokens=False)]
    cuts = {sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)}
    if pre == "llama-bpe":
        assert {3, 6} <= cuts and max(len(p) for p in pieces) > 1
    else:
        assert all(len(p) == 1 for p in pieces)
    assert 2 in ours.eos_token_ids  # <|eot_id|>: the end of a turn stops generation


# ---------------------------------------------------------------------------- import hygiene


def test_import_does_not_pull_transformers():
    code = "import sys, inferd.tokenizer; sys.exit(1 if 'transformers' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_hf_folder_post_processor_bos(tmp_path, tok):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing

    backend = RustTokenizer.from_str(tok.backend.to_str())
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "add_bos_token": True}))
    ht = Tokenizer.from_hf_folder(str(tmp_path))
    assert ht.add_bos is True and ht.eos_token_id is None and ht.eos_token_ids == {0, 2}
    assert ht.encode("hi") == [1] + tok.encode("hi")  # one BOS, not two
    assert ht.encode("hi", add_special_tokens=False) == tok.encode("hi")
