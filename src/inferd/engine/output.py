"""Output processing, per request and per token: append it, decide whether the request stops (end
token, stop token, max_tokens, context limit, stop string) and cut the text delta a client sees."""
from __future__ import annotations

from inferd.engine.request import Request


def record_token(req: Request, tok: int, now: float, lp, eos_ids, max_model_len: int) -> None:
    """Append the sampled token (its logprob entry, its time) and set finish/stop reasons if it ends
    the request. Stop strings are found later, in the text (detokenize)."""
    req.output_ids.append(tok)
    if lp is not None:
        req.logprobs.append(lp)
        req.cumulative_logprob += lp[0]
    t = req.timings
    if t.first_token is None:
        t.first_token = now
    t.token_times.append(now)
    p = req.params
    if len(req.output_ids) >= p.min_tokens:
        if not p.ignore_eos and tok in eos_ids:
            req.finish_reason, req.stop_reason = "stop", None
        elif tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", tok
    if req.finish_reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len):
        req.finish_reason = "length"


def detokenize(req: Request, tok: int) -> str:
    """Text delta for the new token, with stop strings cut: a stop string is never emitted
    (unless asked), nothing after it is, and only a possible partial match is held back."""
    p = req.params
    new = req.detok.add([tok])
    if req.finish_reason is not None:
        new += req.detok.flush()
    buf = req.held + new
    if p.stop:
        hit = None
        for s in p.stop:
            j = buf.find(s)
            if j >= 0 and (hit is None or j < hit[0]):
                hit = (j, s)
        if hit is not None:
            j, s = hit
            out = buf[: j + len(s)] if p.include_stop_str_in_output else buf[:j]
            req.held = ""
            req.finish_reason, req.stop_reason = "stop", s
            return out
        if req.finish_reason is None:
            keep = max((k for s in p.stop for k in range(min(len(s) - 1, len(buf)), 0, -1)
                        if buf.endswith(s[:k])), default=0)
            req.held = buf[len(buf) - keep:] if keep else ""
            buf = buf[: len(buf) - keep]
    else:
        req.held = ""
    return buf
