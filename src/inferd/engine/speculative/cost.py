"""When guesses pay: what a step costs at each number of rows, measured on this machine at start,
how likely each guess is to be accepted, and how many guesses of each request to verify.

A step's time grows with its rows (query tokens). At batch 1 a decode step reads every weight for
one row and a few more rows cost little more; at large batch the step is compute-bound and a row
costs about what a sequence's decode costs. A guess yields a token only if it and every guess
before it are accepted, so its worth is that probability; the guesses verified are those that
maximise the step's expected tokens per second (`choose_lengths`; the step's seconds are the
curve's plus what a step costs outside its forward, which the engine observes as it runs). At batch 1 that verifies any
guess with a fair chance; at batch 16 only near-certain ones, and speculation switches itself off
for requests whose guesses fail.

The probabilities (`Calibration`) start from the draft's own estimate (the share of earlier
occurrences that continued this way, `suffix.walk`) and learn from every verified guess: a table
over (context length, share, support) of how often such guesses were accepted, and per request the
ratio of its accepted tokens to those expected (a request that paraphrases instead of copying
drops out quickly; one that copies gets long drafts).
"""
from __future__ import annotations

import bisect
import logging
import time

log = logging.getLogger("inferd")

MEASURE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
OBSERVE_RATE = 0.05  # weight of a step the engine ran against the curve's point (after its first few)


class StepCost:
    """Seconds of a step of R rows: the measured points, linear between them, proportional to R past
    the last. Kept non-decreasing and at most R one-row steps: a noisy point never says rows are
    free, nor that a batch costs more than its rows one by one. Steps the engine runs correct it as
    they come (`observe`): the point nearest each step's rows moves toward what that step took, so a
    curve measured while the machine was busy does not decide for the rest of the engine's life."""

    def __init__(self, points: list[tuple[int, float]], learn: bool = True):
        self.learn = learn  # False: a curve given as it is (tests say which costs they assume)
        pts = sorted(points)
        self.rows = [r for r, _ in pts]
        self.measured = [t for _, t in pts]
        self.scale = [1.0] * len(pts)  # per point: observed / measured, a running average
        self.seen = [0] * len(pts)
        self._fit()

    def _fit(self):
        vals = [t * m for t, m in zip(self.measured, self.scale)]
        # a point no step has come near is older news than one that steps did: never above it
        for i in range(len(vals) - 2, -1, -1):
            if not self.seen[i] and vals[i] > vals[i + 1]:
                vals[i] = vals[i + 1]
        secs: list[float] = []
        for r, t in zip(self.rows, vals):
            # never below a smaller step, never above that many one-row steps (a noisy point)
            secs.append(min(max(t, secs[-1]), r * secs[0] / self.rows[0]) if secs else t)
        self.secs = secs

    def observe(self, R: int, seconds: float):
        """A step of R rows took `seconds` (its forward and logits)."""
        if not self.learn or R < 1 or seconds <= 0:
            return
        i = min(range(len(self.rows)), key=lambda j: abs(self.rows[j] - R))
        want = seconds / self(R) * self.scale[i]
        self.seen[i] += 1
        rate = max(OBSERVE_RATE, 1.0 / self.seen[i])
        self.scale[i] += rate * (want - self.scale[i])
        self._fit()

    def __call__(self, R: float) -> float:
        rows, secs = self.rows, self.secs
        if R >= rows[-1]:  # past what was measured: as if every row cost the last point's share (no
            return secs[-1] * R / rows[-1]  # cheaper rows are assumed than were seen)
        i = bisect.bisect_left(rows, R)
        if rows[i] == R or i == 0:
            return secs[i]
        r0, r1, t0, t1 = rows[i - 1], rows[i], secs[i - 1], secs[i]
        return t0 + (t1 - t0) * (R - r0) / (r1 - r0)

    def describe(self) -> str:
        return ", ".join(f"{r}: {1000 * t:.2f} ms" for r, t in zip(self.rows, self.secs))


def choose_lengths(expected: list[list[float]], base_rows: int, base_tokens: float, cost) -> list[int]:
    """expected[i][j]: the probability that request i's first j + 1 guesses are all accepted (not
    increasing in j). -> how many guesses of each request to verify: the set that maximises
    (base_tokens + expected accepted) / cost(base_rows + guesses). Guesses are taken in order of
    that probability (a request's in order, ties to the earlier), each prefix of that order tried."""
    items = sorted(((e, j, i) for i, es in enumerate(expected) for j, e in enumerate(es) if e > 0),
                   key=lambda x: (-x[0], x[1]))
    rows, tokens = base_rows, float(base_tokens)
    best_rate, best_n = tokens / cost(rows), 0
    for n, (e, _, _) in enumerate(items, 1):
        rows += 1
        tokens += e
        rate = tokens / cost(rows)
        if rate > best_rate:
            best_rate, best_n = rate, n
    ks = [0] * len(expected)
    for _, j, i in items[:best_n]:
        ks[i] = max(ks[i], j + 1)
    return ks


# context-length and share buckets of the calibration table
_LEN_EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32)


def bucket(context: int, share: float, support: int, edit: bool = False) -> tuple[int, int, bool]:
    lb = bisect.bisect_right(_LEN_EDGES, context)
    if support <= 1:
        sb = 0
    else:
        sb = 1 if share < 0.5 else 2 if share < 0.8 else 3 if share < 1.0 else 4
    return lb, sb, edit


PRIOR = 4.0  # pseudo-observations behind the draft's own estimate
PRIOR_DISCOUNT = 0.6  # ... which it trusts only this much before anything is verified
DECAY = 0.8  # weight of a request's older verify steps against its newest


class Calibration:
    """Acceptance learned from verification: per bucket (accepted, tried) counts, per request the
    decayed sums of accepted and expected tokens."""

    def __init__(self):
        self.table: dict[tuple, list[float]] = {}
        self.requests: dict[str, list[float]] = {}  # rid -> [accepted, expected]

    def token_probs(self, draft) -> list[float]:
        """Per guess, the probability it is accepted if every guess before it was."""
        out = []
        for j, (p, c) in enumerate(zip(draft.probs, draft.support)):
            b = bucket(draft.match_len + j, p, c, draft.edit)
            acc, tried = self.table.get(b, (0.0, 0.0))
            prior = PRIOR_DISCOUNT * p
            out.append((acc + PRIOR * prior) / (tried + PRIOR))
        return out

    def _products(self, draft) -> list[float]:
        out, cum = [], 1.0
        for q in self.token_probs(draft):
            cum *= q
            out.append(cum)
        return out

    def expected(self, rid: str, draft) -> list[float]:
        """Running products of token_probs, scaled by the request's accepted / expected so far."""
        acc, exp = self.requests.get(rid, (0.0, 0.0))
        ratio = (acc + 1.0) / (exp + 1.0)
        return [min(1.0, e * ratio) for e in self._products(draft)]

    def update(self, rid: str, draft, verified: int, accepted: int):
        """After a verify of `verified` guesses of which the first `accepted` were kept. The request's
        ratio compares with the table's expectation alone (not one it already scaled)."""
        expected = sum(self._products(draft)[:verified])
        for j in range(min(verified, accepted + 1)):
            b = bucket(draft.match_len + j, draft.probs[j], draft.support[j], draft.edit)
            row = self.table.setdefault(b, [0.0, 0.0])
            row[0] += j < accepted
            row[1] += 1
        st = self.requests.setdefault(rid, [0.0, 0.0])
        st[0] = DECAY * st[0] + accepted
        st[1] = DECAY * st[1] + expected

    def forget(self, rid: str):
        self.requests.pop(rid, None)


def row_counts(max_rows: int) -> list[int]:
    out = [r for r in MEASURE_ROWS if r <= max_rows]
    if out[-1] != max_rows and max_rows > out[-1]:
        out.append(max_rows)
    return out


def measure(run_rows, max_rows: int, reps: int = 3, budget_s: float = 6.0) -> StepCost:
    """run_rows(R) runs one step of R decode rows. One warm-up round over every row count, then
    `reps` rounds, each over every row count in turn (a burst of other load slows all of them
    alike); each count's fastest run. Row counts the warm-up could not reach within budget_s are
    extrapolated."""
    counts = row_counts(max_rows)
    t_start = time.perf_counter()
    reached = []
    for R in counts:
        run_rows(R)
        reached.append(R)
        if time.perf_counter() - t_start > budget_s / (reps + 1) and len(reached) >= 2:
            break
    best = {R: float("inf") for R in reached}
    for _ in range(reps):
        for R in reached:
            t0 = time.perf_counter()
            run_rows(R)
            best[R] = min(best[R], time.perf_counter() - t0)
    # counts not reached get a point too, proportional to the last one reached: a guess on the
    # dear side, which the first steps the engine runs near it replace (StepCost.observe)
    last, t_last = reached[-1], best[reached[-1]]
    for R in counts[len(reached):]:
        best[R] = t_last * R / last
    return StepCost(sorted(best.items()))
