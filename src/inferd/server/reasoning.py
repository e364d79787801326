"""The reasoning split (`--reasoning-parser`, vLLM's flag): a thinking model's `<think>…</think>`
text, told apart from its answer as it streams.

Every dialect reads the same split: chat's `reasoning_content`, the Responses API's reasoning
items, Anthropic's thinking blocks, Ollama's `thinking`. One `ReasoningSplit` per sample turns
text deltas into ("reasoning" | "content", text) pieces, holding back only what could still be
the start of a tag, so a stream and the body folded from it cannot differ.

The parsers differ in where reasoning may begin:
* qwen3: where the output opens with `<think>` (Qwen3's template writes the empty
  `<think></think>` block itself when thinking is off, so output without the tag is an answer);
* deepseek_r1: at the start (R1's template opens the block in the prompt, so output reads
  reasoning until `</think>`, with or without its own `<think>`).
Either starts inside the block when the rendered prompt ends with an open `<think>` (Qwen3-2507's
and R1's templates). Whitespace next to a tag is dropped: it is the template's layout, not text.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")

REASONING, CONTENT = "reasoning", "content"


def prompt_opens_block(prompt_tail: str) -> bool:
    """The rendered prompt ends inside a think block its template opened."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    """State machine over one sample's text: detect (qwen3's start) -> reasoning -> content."""

    def __init__(self, parser: str, prompt_opened: bool = False):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        if prompt_opened or parser == "deepseek_r1":
            self.state = REASONING
        else:
            self.state = "detect"
        self.buf = ""
        self.strip_next = True  # whitespace right after a tag (or at the start) is layout
        self.ws = ""  # reasoning's trailing whitespace, held until more reasoning follows
        self.tagged = False  # the output's own <think> was seen (it may open the reasoning once)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "detect":
                head = self.buf.lstrip()
                if OPEN.startswith(head):  # still could be the tag (or nothing but whitespace yet)
                    break
                if head.startswith(OPEN):
                    self.buf, self.state, self.tagged = head[len(OPEN):], REASONING, True
                    self.strip_next = True
                    continue
                self.state = CONTENT
                continue
            if self.state == CONTENT:
                self._emit(out, CONTENT, self.buf)
                self.buf = ""
                break
            # reasoning: an opening tag of the output's own is dropped once, at its start
            if not self.tagged:
                head = self.buf.lstrip()
                if OPEN.startswith(head) and len(head) < len(OPEN):
                    break
                if head.startswith(OPEN):
                    self.buf, self.tagged = head[len(OPEN):], True
                    self.strip_next = True
                    continue
                if head:
                    self.tagged = True
            j = self.buf.find(CLOSE)
            if j >= 0:
                self._emit(out, REASONING, self.buf[:j])
                self.ws = ""  # whitespace before the closing tag is layout
                self.buf, self.state, self.strip_next = self.buf[j + len(CLOSE):], CONTENT, True
                continue
            keep = _partial_tag(self.buf, CLOSE)
            self._emit(out, REASONING, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _emit(self, out: list, kind: str, text: str):
        if self.strip_next:
            text = text.lstrip()
            if not text:
                return
            self.strip_next = False
        if kind == REASONING:
            text = self.ws + text
            body = text.rstrip()
            text, self.ws = body, text[len(body):]
        if text:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))

    def finish(self) -> list[tuple[str, str]]:
        """The end of the output: what was held back is text after all (an unfinished tag, or the
        answer of a qwen3 output that was only whitespace so far)."""
        out: list[tuple[str, str]] = []
        rest, self.buf = self.buf, ""
        if self.state == "detect":
            self.state = CONTENT
        if rest:
            self._emit(out, self.state, rest)
        return out
