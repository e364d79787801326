"""The text inferd evaluates and calibrates on: WikiText-2's test split from ../shared/data (never
downloaded), split so that calibration never sees the evaluation windows."""
from __future__ import annotations

import os

from inferd.errors import InferdError

WIKITEXT_RELATIVE = os.path.join("..", "shared", "data", "wikitext-2", "test.txt")
# `inferd eval` takes its windows from the first EVAL_TEXT_CHARS characters; calibration reads after them
EVAL_TEXT_CHARS = 200_000


def wikitext_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(os.path.join(here, "..", ".."))
    for p in (os.path.join(root, WIKITEXT_RELATIVE), os.path.join(os.getcwd(), WIKITEXT_RELATIVE)):
        if os.path.isfile(p):
            return p
    raise InferdError("WikiText-2 not found: expected ../shared/data/wikitext-2/test.txt beside the project")


def calibration_ids(tok, n_samples: int, seqlen: int, calib: str = "wikitext") -> list[list[int]]:
    """n_samples windows of seqlen tokens. `wikitext`: WikiText-2 test text after the characters
    `inferd eval` takes its windows from, so calibration never sees the evaluation text; otherwise
    a path to a text file."""
    if n_samples < 1 or seqlen < 2:
        raise InferdError("calibration needs at least 1 sample of at least 2 tokens")
    if calib == "wikitext":
        with open(wikitext_path(), encoding="utf-8") as f:
            text = f.read()[EVAL_TEXT_CHARS:]
    else:
        if not os.path.isfile(calib):
            raise InferdError(f"calibration text not found: {calib} (use wikitext or a text file)")
        with open(calib, encoding="utf-8", errors="replace") as f:
            text = f.read()
    need = n_samples * seqlen
    # tokenizing a megabyte takes seconds; ~4 characters a token, so read a generous prefix first
    ids = tok.encode(text[:need * 8], add_special_tokens=False)
    if len(ids) < need:
        ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < need:
        raise InferdError(f"calibration text has {len(ids)} tokens; {n_samples} x {seqlen} = {need} needed")
    return [ids[i * seqlen:(i + 1) * seqlen] for i in range(n_samples)]
