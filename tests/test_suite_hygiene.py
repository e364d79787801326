"""The suite's own hygiene, read from its source with `ast` (no server, well under a second):

- no absolute filesystem path in a string literal: CI clones the repository anywhere, with
  `shared/` beside it (conftest's find_wikitext finds the data there), so a path that exists on one
  machine fails on the next. The kernel's and the system's fixed places are allowed (ALLOWED).
- no test outside the `integration` marker asserts a clock-measured time or rate against a number:
  a shared or busy CI machine stretches any elapsed time, so such a bound fails at random. The logic
  stays in the suite; the bound goes to a test marked integration (`make test-integration`).
- every near-tie count has a bound: the rule (tokens may part where the reference's top-2 logits
  are within 1e-4) lives in tests/helpers.py's NEAR_TIE_HELPERS, each of which takes `max_ties`
  with no default; a test that calls one without it, or computes a top-2 gap itself (`topk(x, 2)`,
  `top[0] - top[1] < eps`, its own NEAR_TIE), could excuse any number of cut sequences.

A clock reading is a call of time.monotonic / perf_counter / time (and their _ns forms) or a value
the bench recorded from one: a key or attribute ending in `_ns` (a timestamp) or `_ms` (a duration).
A difference of readings is a duration, and so is anything computed from one (a rate); an `assert`
that orders a duration against a number other than 0 is a threshold. Comparing a reading with a
deadline (`time.monotonic() < deadline`, a wait on a condition) is not.
"""
from __future__ import annotations

import ast
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent

# the first component of a path on the filesystem (URL paths such as /v1 or /health are not these)
FS_ROOTS = {"bin", "boot", "data", "dev", "etc", "home", "lib", "lib64", "media", "mnt", "nfs", "opt", "proc",
            "root", "run", "sbin", "scratch", "shared", "srv", "sys", "tmp", "usr", "var", "work", "workspace"}
# the same on every Linux machine: the kernel's interfaces, shared memory, the null device, a browser
ALLOWED = ("/proc", "/dev/shm", "/dev/null", "/usr/bin/chromium")
PATH = re.compile(r"^/([A-Za-z0-9._-]+)(/|$)")

CLOCK_CALLS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns"}
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


# -- absolute paths ------------------------------------------------------------------------------

def _allowed(path: str) -> bool:
    return any(path == a or path.startswith(a + "/") for a in ALLOWED)


def absolute_paths(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each string literal that starts with an absolute filesystem path; in an
    f-string only its start counts (a later "/tmp" part follows something else)."""
    tree = ast.parse(source)
    later_parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values[1:]}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in later_parts:
            m = PATH.match(n.value)
            if m and m.group(1) in FS_ROOTS and not _allowed(n.value):
                out.append((n.lineno, n.value))
    return sorted(out)


# -- wall-clock thresholds ----------------------------------------------------------------------

def _is_clock_call(n: ast.AST) -> bool:
    if not isinstance(n, ast.Call):
        return False
    f = n.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "time":
        return f.attr in CLOCK_CALLS
    return isinstance(f, ast.Name) and f.id in CLOCK_CALLS - {"time"}


def _recorded(n: ast.AST) -> str | None:
    """'stamp' or 'duration' for a reading the bench recorded (q["send_ns"], res["p99_ttft_ms"])."""
    key = None
    if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
        key = n.slice.value
    elif isinstance(n, ast.Attribute):
        key = n.attr
    if key is None:
        return None
    return "stamp" if key.endswith("_ns") else "duration" if key.endswith("_ms") else None


class _Clocks:
    """Which names of one test hold clock readings ('stamp') or durations and rates ('duration')."""

    def __init__(self, fn: ast.AST):
        self.names: dict[str, str] = {}
        bindings = []  # (target, value): assignments, for loops and comprehensions
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                bindings += [(t, n.value) for t in n.targets]
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                bindings.append((n.target, n.value))
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                bindings.append((n.target, n.iter))
        changed = True
        while changed:  # to a fixed point: a name may be bound from a name bound later in the text
            changed = False
            for target, value in bindings:
                kind = self.kind(value)
                if kind is None:
                    continue
                for t in ast.walk(target):
                    if isinstance(t, ast.Name) and self.names.get(t.id) not in ("duration", kind):  # only ever up
                        self.names[t.id] = kind
                        changed = True

    def kind(self, e: ast.AST) -> str | None:
        stamp = False
        for n in ast.walk(e):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and (self.kind(n.left) or self.kind(n.right)):
                return "duration"  # a difference of readings
            k = self.names.get(n.id) if isinstance(n, ast.Name) else _recorded(n)
            if k == "duration":
                return "duration"
            stamp = stamp or k == "stamp" or _is_clock_call(n)
        return "stamp" if stamp else None


def _numbers(e: ast.AST) -> list[float]:
    return [n.value for n in ast.walk(e) if isinstance(n, ast.Constant)
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)]


def _marked_integration(decorators: list[ast.expr]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "integration" for d in decorators for n in ast.walk(d))


def _tests(tree: ast.Module):
    """Every test function (module level, or a method of a Test class) not marked integration."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if _marked_integration([node.value]):
                return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if not _marked_integration(node.decorator_list):
                yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test") \
                and not _marked_integration(node.decorator_list):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test") \
                        and not _marked_integration(m.decorator_list):
                    yield m


def clock_thresholds(source: str) -> list[tuple[int, str]]:
    """(line, test name) of each assert, in a test not marked integration, that orders a duration
    or rate measured on a clock against a number other than 0."""
    out = []
    for fn in _tests(ast.parse(source)):
        clocks = _Clocks(fn)
        for a in (n for n in ast.walk(fn) if isinstance(n, ast.Assert)):
            for c in (n for n in ast.walk(a.test) if isinstance(n, ast.Compare)):
                sides = [c.left, *c.comparators]
                if (any(isinstance(op, ORDERINGS) for op in c.ops)
                        and any(clocks.kind(s) == "duration" for s in sides)
                        and any(v != 0 for v in _numbers(c))):
                    out.append((a.lineno, fn.name))
                    break
    return out


# -- near-tie counts ------------------------------------------------------------------------------

# a top-2 that is no tie rule: the engine's reported top-2 logprobs compared with torch's
TOP2_ALLOWED = {"test_sampling.py"}


def near_tie_helpers(helpers_source: str) -> dict[str, bool]:
    """{name: whether it takes a keyword-only max_ties with no default} for each of helpers.py's
    NEAR_TIE_HELPERS (read with ast: no torch)."""
    tree = ast.parse(helpers_source)
    names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "NEAR_TIE_HELPERS" for t in n.targets))
    out = {}
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name in names:
            kw = dict(zip((a.arg for a in n.args.kwonlyargs), n.args.kw_defaults))
            out[n.name] = "max_ties" in kw and kw["max_ties"] is None
    return {name: out.get(name, False) for name in names}


def _called(n: ast.Call) -> str | None:
    return n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else None


def _index(n: ast.AST) -> object:
    return n.slice.value if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) else None


def _top2_gap(e: ast.AST) -> bool:
    """x[0] - x[1], or float() of it."""
    if isinstance(e, ast.Call) and _called(e) == "float" and len(e.args) == 1:
        e = e.args[0]
    return isinstance(e, ast.BinOp) and isinstance(e.op, ast.Sub) and _index(e.left) == 0 and _index(e.right) == 1


def near_tie_offences(source: str, helpers: tuple[str, ...], top2_allowed: bool = False) -> list[tuple[int, str]]:
    """(line, what) of each near-tie count a module leaves unbounded: a call of a helper without
    max_ties=, a top-2 gap computed in place, a NEAR_TIE of its own."""
    tree = ast.parse(source)
    # the helpers this module imports from helpers.py (another module's `compare` is another function)
    imported = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module == "helpers" for a in n.names if a.name in helpers}

    def helper(n: ast.Call) -> str | None:
        f = n.func
        if isinstance(f, ast.Name):
            return imported.get(f.id)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "helpers":
            return f.attr if f.attr in helpers else None
        return None

    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and helper(n) and not any(k.arg == "max_ties" for k in n.keywords):
            out.append((n.lineno, f"{helper(n)}() without max_ties="))
        elif isinstance(n, ast.Call) and _called(n) == "topk" and not top2_allowed:
            # torch.topk(x, k) / topk(x, k) take the tensor first; x.topk(k) does not
            method = isinstance(n.func, ast.Attribute) and not (isinstance(n.func.value, ast.Name)
                                                                and n.func.value.id == "torch")
            k = n.args[0 if method else 1:][:1] or [kw.value for kw in n.keywords if kw.arg == "k"]
            if k and isinstance(k[0], ast.Constant) and k[0].value == 2:
                out.append((n.lineno, "a top-2 computed in place (helpers.top2_gap and the helpers' bound)"))
        elif isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.Lt, ast.LtE)) and _top2_gap(n.left):
            out.append((n.lineno, "a top-2 gap compared in place"))
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "NEAR_TIE" for t in n.targets):
            out.append((n.lineno, "a NEAR_TIE of its own"))
    return sorted(out)


# -- the suite ----------------------------------------------------------------------------------

def _suite() -> dict[str, str]:
    """Every module in tests/ but this one, whose own checks below hold offenders on purpose."""
    me = pathlib.Path(__file__).resolve()
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(TESTS.glob("*.py")) if p.resolve() != me}


def test_no_absolute_paths_in_the_suite():
    found = [f"{name}:{line}: {text!r}" for name, src in _suite().items() for line, text in absolute_paths(src)]
    assert not found, "absolute paths (find the file from the repository, e.g. conftest.find_wikitext):\n" + \
        "\n".join(found)


def test_no_wall_clock_thresholds_outside_integration():
    found = [f"{name}:{line}: {test}" for name, src in _suite().items() for line, test in clock_thresholds(src)]
    assert not found, ("wall-clock thresholds outside the integration marker (assert the logic here, move "
                       "the bound to a test marked @pytest.mark.integration):\n" + "\n".join(found))


def test_every_near_tie_count_has_a_bound():
    suite = _suite()
    helpers = near_tie_helpers(suite.pop("helpers.py"))
    assert helpers and all(helpers.values()), f"helpers without a required keyword-only max_ties: {helpers}"
    found = [f"{name}:{line}: {what}" for name, src in suite.items()
             for line, what in near_tie_offences(src, tuple(helpers), name in TOP2_ALLOWED)]
    assert not found, ("near-tie counts without a bound (compare through tests/helpers.py's NEAR_TIE_HELPERS, "
                       "max_ties= the most cut sequences the test accepts):\n" + "\n".join(found))


# -- the lint itself, on small sources ----------------------------------------------------------

def test_the_path_check_sees_filesystem_paths_only():
    src = '''
WIKITEXT = "/work/shared/data/wikitext-2/test.txt"
LOG = f"/tmp/run-{1}.log"
ok = [open("/proc/self/statm"), f"/proc/{2}/status", "/dev/shm", "/dev/null", "/usr/bin/chromium",
      base + "/v1/completions", "/health", f"{base}/tmp/x", "/nonexistent/model.gguf", "a/b"]
'''
    assert absolute_paths(src) == [(2, "/work/shared/data/wikitext-2/test.txt"), (3, "/tmp/run-")]


def test_the_clock_check_sees_elapsed_times_and_rates():
    src = '''
import pytest, time

def test_elapsed():
    t0 = time.monotonic()
    work()
    assert time.monotonic() - t0 < 30

def test_elapsed_name():
    t0 = time.perf_counter()
    dt = time.perf_counter() - t0
    assert result and dt <= 2.5

def test_recorded_rate(reqs, res):
    sends = sorted(q["send_ns"] for q in reqs)
    gaps = [(b - a) / 1e9 for a, b in zip(sends, sends[1:])]
    rate = len(gaps) / ((sends[-1] - sends[0]) / 1e9)
    assert abs(rate - 100) / 100 <= 0.05
    assert res["p99_send_lag_ms"] < 10

def test_allowed(res, reqs):
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline, "a wait on a condition"
        break
    t0 = time.monotonic()
    print(time.monotonic() - t0)
    sends = [q["send_ns"] for q in reqs]
    assert res["mean_ttft_ms"] > 0 and res["achieved_send_rate"] == len(sends) / (sends[-1] - sends[0])
    assert len(reqs) < 100

@pytest.mark.integration
def test_timing():
    t0 = time.monotonic()
    assert time.monotonic() - t0 < 30
'''
    assert clock_thresholds(src) == [(7, "test_elapsed"), (12, "test_elapsed_name"), (18, "test_recorded_rate"),
                                     (19, "test_recorded_rate")]
    assert clock_thresholds("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.integration]\n" + src) == []


def test_the_near_tie_check_sees_unbounded_counts():
    helpers_src = '''
NEAR_TIE_HELPERS = ("compare", "loose")

def compare(got, ref, *, max_ties, gap=1e-4):
    pass

def loose(got, ref, max_ties=3):
    pass
'''
    assert near_tie_helpers(helpers_src) == {"compare": True, "loose": False}
    src = '''
import torch
from helpers import compare
NEAR_TIE = 1e-4

def test_a(got, ref, logits, tops, shares):
    print("near ties:", compare(got, ref))
    helpers.compare(got, ref, max_ties=1)
    from inferd.eval import compare as other
    other(got, ref)
    top2 = torch.topk(logits[0], 2).values
    assert float(top2[0] - top2[1]) < 1e-4
    assert tops[0] - tops[1] < 1e-3
    v = logits[1].topk(2)
    assert shares[0] - shares[1] == 4
    ok = torch.topk(logits[2], 3)
'''
    assert near_tie_offences(src, ("compare",)) == [
        (4, "a NEAR_TIE of its own"), (7, "compare() without max_ties="),
        (11, "a top-2 computed in place (helpers.top2_gap and the helpers' bound)"),
        (12, "a top-2 gap compared in place"), (13, "a top-2 gap compared in place"),
        (14, "a top-2 computed in place (helpers.top2_gap and the helpers' bound)")]
