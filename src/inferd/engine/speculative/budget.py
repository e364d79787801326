"""How many of each draft's guesses a step verifies: the budget between proposing and scheduling.

The decoder hands every step's drafts, whichever proposer made them, to one budget and verifies
what it keeps. `VerifyAll` keeps every guess. `CostBudget` keeps of each draft only the guesses
whose expected acceptance pays for their rows in this step (cost.py: the step's seconds by rows,
measured on this machine at start, and acceptance learned from verification); before that it cuts a
constrained request's draft where its grammar forbids a token (that row could never be accepted).
It counts where every guess went: verified, cut by the grammar, skipped by the cost model, or
trimmed by the scheduler's token budget.

Suffix decoding runs under `CostBudget`; prompt lookup and draft models under `VerifyAll`, as they
always have: cutting their drafts would change their outputs under sampling (the request's random
stream is consumed per guess verified) and their counters. `CostBudget` reads only what every
`Draft` has, so any proposer could run under it.
"""
from __future__ import annotations

import logging
import statistics
import time

from inferd.engine.request import Status
from inferd.engine.speculative import cost as spec_cost
from inferd.worker.runner import StepPlan

log = logging.getLogger("inferd")

EXPLORE_MIN, EXPLORE_MAX = 16, 256  # a skipped request verifies one guess after this many skipped drafts
PROBE_EVERY = 64  # steps with drafts between two drafts the cost model cut, verified whole


class VerifyAll:
    """The identity budget: every guess proposed is verified, nothing is learned or counted here."""
    cost: spec_cost.StepCost | None = None  # no curve decides

    def __init__(self):
        self.pending: dict[str, tuple] = {}  # rid -> (its draft, guesses chosen) of the guesses in flight

    def choose(self, running, reqs, drafts: list) -> list[int]:
        """-> how many guesses of each request's draft to verify (0: none)."""
        return [len(d.tokens) if d is not None else 0 for d in drafts]

    def after_schedule(self, requests: dict):
        """The scheduler has trimmed or dropped guesses (`requests`: the engine's, by id)."""

    def verified(self, rid: str, verified: int, accepted: int):
        """Of the request's `verified` guesses, the first `accepted` were kept."""

    def keep_only(self, alive: set[str]):
        """What is kept for requests that are done goes."""

    def observe_step(self, total: float, forward: float, rows: int):
        """A step's seconds in all and in its forward of `rows` rows."""


class CostBudget(VerifyAll):
    def __init__(self, engine, stats, cost: spec_cost.StepCost | None):
        super().__init__()
        self.engine = engine
        self.stats = stats
        self.cost = cost  # None: every draft is verified whole (acceptance is still learned)
        self.calibration = spec_cost.Calibration()
        self.overhead = 0.0  # a step's seconds outside its forward (observe_step)
        self.steps_since_probe = 0  # steps with drafts since a cut one was verified whole
        self.explore: dict[str, list[int]] = {}  # rid -> [drafts skipped since its last verify, interval]

    def choose(self, running, reqs, drafts: list) -> list[int]:
        ks = [0] * len(reqs)
        live = []  # (index, request, draft) of the drafts the grammar left something of
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if d is not None and self._grammar_cut(r, d):
                live.append((i, r, d))
        if not live:
            return ks
        st = self.stats
        for (i, r, d), k in zip(live, self._lengths(running, live)):
            if k == 0:
                k = self._explore(r.request_id)
            if k < len(d.tokens):
                st.num_cost_skipped_tokens += len(d.tokens) - k
                st.num_cost_skipped_drafts += k == 0
            if k:
                ks[i] = k
                self.pending[r.request_id] = (d, k)
        return ks

    def _grammar_cut(self, r, d) -> bool:
        """Counts the draft in, cut where the request's grammar forbids a guess; -> whether any is left."""
        st = self.stats
        st.num_proposed_tokens += len(d.tokens)
        if r.matcher is not None:
            n = r.matcher.validate_tokens(d.tokens)
            if n < len(d.tokens):
                st.num_grammar_cut_tokens += len(d.tokens) - n
                d.cut(n)
            if not n:
                return False
        st.num_cache_drafts += d.source == "cache"
        return True

    def _lengths(self, running, live) -> list[int]:
        """Guesses of each live draft that pay for their rows (all of them without a curve)."""
        if self.cost is None:
            return [len(d.tokens) for _, _, d in live]
        cal = self.calibration
        expected = [cal.expected(r.request_id, d) for _, r, d in live]
        rows, tokens = self._base_rows(running)
        lengths = spec_cost.choose_lengths(expected, rows, tokens, self._step_seconds)
        self.steps_since_probe += 1
        cut = [j for j, ((_, _, d), k) in enumerate(zip(live, lengths)) if k and k < len(d.tokens)]
        if cut and self.steps_since_probe >= PROBE_EVERY:
            # now and then a draft the cost model cut short is verified whole: the curve learns
            # what the longer step really costs (it is only corrected where steps run)
            j = max(cut, key=lambda j: len(live[j][2].tokens) - lengths[j])
            lengths[j] = len(live[j][2].tokens)
            self.steps_since_probe = 0
            self.stats.num_cost_probes += 1
        return lengths

    def _step_seconds(self, rows: float) -> float:
        return self.cost(rows) + self.overhead

    def _explore(self, rid: str) -> int:
        """A request whose drafts the cost model keeps skipping verifies one guess now and then, so
        that its acceptance (and the table's) keeps being learned; the pauses double while those
        guesses fail (16 .. 256 drafts) and shrink back once one is accepted."""
        ex = self.explore.setdefault(rid, [0, EXPLORE_MIN])
        ex[0] += 1
        if ex[0] < ex[1]:
            return 0
        ex[0] = 0
        self.stats.num_explored += 1
        return 1

    def _base_rows(self, running) -> tuple[int, int]:
        """(rows, sampled sequences) of this step before any guess: a row per decoding sequence, and
        the prompt tokens waiting, as far as the token budget goes."""
        decode = prefill = 0
        for r in running:
            left = r.num_tokens - r.num_computed
            if r.status == Status.RUNNING and left == 1:
                decode += 1
            elif left > 0:
                prefill += left
        prefill += sum(r.num_tokens - r.num_computed for r in self.engine.scheduler.waiting)
        return max(1, min(self.engine.config.max_num_batched_tokens, decode + prefill)), max(decode, 1)

    def after_schedule(self, requests: dict):
        for rid, (_, chosen) in list(self.pending.items()):
            req = requests.get(rid)
            left = len(req.spec_tokens) if req is not None else 0
            # the scheduler trims guesses a short token budget cannot hold (or drops an unscheduled
            # sequence's): counted, so that every proposed guess is accounted for
            self.stats.num_budget_cut_tokens += chosen - left
            if not left:
                del self.pending[rid]

    def verified(self, rid: str, verified: int, accepted: int):
        info = self.pending.pop(rid, None)
        if info is not None:
            self.calibration.update(rid, info[0], verified, accepted)
            ex = self.explore.get(rid)
            if ex is not None:  # an explored guess: pauses shrink once one is accepted, else grow
                ex[1] = EXPLORE_MIN if accepted else min(EXPLORE_MAX, 2 * ex[1])

    def keep_only(self, alive: set[str]):
        for rid in [r for r in self.explore if r not in alive]:
            del self.explore[rid]
        for rid in [r for r in self.calibration.requests if r not in alive]:
            self.calibration.forget(rid)

    def observe_step(self, total: float, forward: float, rows: int):
        """The forward corrects the cost curve where it ran; what a step costs beside its rows
        (scheduling, sampling, verifying, detokenizing) is paid once a step however many tokens it
        yields, so it counts toward what a guess saves (a running average)."""
        if self.cost is not None:
            self.cost.observe(rows, forward)
            self.overhead = 0.9 * self.overhead + 0.1 * max(0.0, total - forward)


def step_of_rows(engine, depth: int = 512):
    """run_rows(R): one step of R decode rows through the runner as a step runs (fused or eager, every
    tensor-parallel rank), each row one token at a context of up to `depth` tokens over the same
    blocks (as the k + 1 rows of one verifying sequence read them). The K/V written land in free
    blocks, which any request writes before it reads. Returns (run_rows, the context it reached)."""
    runner = engine.runner
    bs = engine.config.block_size
    nb = max(1, min(engine.num_kv_blocks, -(-depth // bs)))
    ctx = nb * bs - 1
    table = list(range(nb))
    groups = engine.kv_layout.num_groups

    def run_rows(R: int):
        plan = StepPlan([0] * R, [table] * R, [ctx] * R, [1] * R, list(range(R)), list(range(R)),
                        kv_tables=[[table] * (groups - 1)] * R if runner.attn.layout is not None else None,
                        lora_slots=None)
        if runner.comm is not None:
            runner.comm.send_obj(plan)
        runner.run(plan)
    return run_rows, ctx


def measure_step_cost(engine, k: int) -> spec_cost.StepCost | None:
    """Seconds of a step of R decode rows on this machine, R up to what a step can hold (every
    sequence with k + 1 rows, within the token budget): one row each at a context of up to 512
    tokens (attention's share of a row, as a chat's). The runner's and the attention's path
    counters are put back, so that they count requests' steps only."""
    cfg = engine.config
    runner = engine.runner
    max_rows = max(2, min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (k + 1)))
    saved = _counters(runner)
    run_rows, _ = step_of_rows(engine, 512)
    t0 = time.monotonic()
    try:
        cost = spec_cost.measure(run_rows, max_rows)
    except Exception as e:  # noqa: BLE001 - no curve: every draft is verified whole, and the log says so
        if runner.comm is not None:  # a rank out of step cannot be recovered from here
            raise
        log.warning("speculative cost model off: measuring the step cost failed (%s: %s); every draft is "
                    "verified whole", type(e).__name__, e)
        return None
    finally:
        _restore(runner, saved)
    log.info("speculative cost model: step seconds by rows measured in %.1f s (%s)", time.monotonic() - t0,
             cost.describe())
    return cost


def verify_cost_curve(engine, rows: list[int], depths: list[int], reps: int = 5) -> dict:
    """{depth: {R: median seconds of a step of R rows}}: rounds over every (depth, R) in turn (a burst
    of other load slows all of them alike), the path counters put back afterwards."""
    saved = _counters(engine.runner)
    try:
        runs = {d: step_of_rows(engine, d) for d in depths}
        times = {d: {r: [] for r in rows} for d in depths}
        for rep in range(reps + 1):
            for d, (run_rows, _) in runs.items():
                for r in rows:
                    t0 = time.perf_counter()
                    run_rows(r)
                    if rep:  # the first round warms up
                        times[d][r].append(time.perf_counter() - t0)
        return {runs[d][1] + 1: {r: statistics.median(v) for r, v in times[d].items()} for d in depths}
    finally:
        _restore(engine.runner, saved)


_COUNTERS = (("runner", "fused_steps"), ("runner", "eager_decode_steps"), ("runner", "lora_fused_steps"),
             ("runner", "lora_eager_steps"), ("attn", "kernel_calls"), ("fused", "steps"), ("fused", "max_rows"))


def _counters(runner) -> dict:
    """The path counters a measured step moves (the dashboard and the benchmarks' records read them)."""
    objs = {"runner": runner, "attn": runner.attn, "fused": runner.fused}
    out = {}
    for o, name in _COUNTERS:
        obj = objs[o]
        if obj is not None and hasattr(obj, name):
            out[(o, name)] = getattr(obj, name)
    lora = getattr(runner, "lora", None)
    if lora is not None:
        out[("lora", "lora_steps")] = lora.lora_steps
        out[("lora", "multi_adapter_steps")] = lora.multi_adapter_steps
    return out


def _restore(runner, saved: dict):
    objs = {"runner": runner, "attn": runner.attn, "fused": runner.fused, "lora": getattr(runner, "lora", None)}
    for (o, name), v in saved.items():
        setattr(objs[o], name, v)
