"""The router's two-phase flow for disaggregated prefill/decode (vLLM's proxy protocol).

1. The request goes to a prefill worker as a one-token, non-streaming request marked
   `kv_transfer_params: {"do_remote_decode": true}`; the worker computes the prompt, leases its KV
   and answers with kv_transfer_params naming the lease and where to pull it.
2. The original request, with those kv_transfer_params added, goes to a decode worker, which pulls
   the KV, computes the last prompt position and streams the answer; that answer is the client's.

A request the prefill pool cannot take (no worker up, a 5xx, an answer without kv_transfer_params)
goes to a decode worker as it is, which then computes its prompt itself (counted: path=fallback);
a 4xx from the prefill worker is the client's answer. Requests that need every prompt position
computed where they decode (echo, prompt logprobs), several prompts in one request, and prompts
shorter than --disagg-min-prompt-chars (Dynamo's conditional disaggregation: a short prompt costs
less to compute than to hand over) skip the prefill pool.
"""
from __future__ import annotations

from typing import Any


def route(body: dict, chat: bool, text: str, min_chars: int) -> str:
    """'disagg' or why not: 'short', 'ineligible'."""
    if not chat:
        p = body.get("prompt")
        single = isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, int) for x in p)) or \
            (isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)))
        if not single or body.get("echo") or body.get("prompt_logprobs") is not None:
            return "ineligible"
    elif body.get("prompt_logprobs") is not None:
        return "ineligible"
    if body.get("kv_transfer_params") is not None:
        return "ineligible"  # the client runs its own flow
    if len(text) < min_chars:
        return "short"
    return "disagg"


def prefill_body(body: dict, chat: bool) -> dict[str, Any]:
    """The request as the prefill worker gets it: one token, no stream, one sample, KV leased."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "best_of", "min_tokens", "logprobs",
                                                      "top_logprobs", "max_completion_tokens", "n")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if chat:
        out["logprobs"] = False
    return out


def kv_params_of(answer: Any) -> dict | None:
    """A prefill worker's answer -> its kv_transfer_params, if it is a producer's answer."""
    if not isinstance(answer, dict):
        return None
    kvp = answer.get("kv_transfer_params")
    if isinstance(kvp, dict) and kvp.get("do_remote_prefill"):
        return kvp
    return None
